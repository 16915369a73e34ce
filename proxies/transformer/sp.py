"""Sequence-parallel pieces of StageShard (model.py): Megatron's sequence parallelism
(Korthikanti et al. 2022) with the traffic and the memory Megatron has.

Between tensor-parallel regions every rank keeps its sequence shard (B,Ts,C): layernorms,
residuals, the MoE router. Per layer, with tp_buf's contiguous block i being rank i's shard:

    forward   ln1 -> AG -> qkv, attention, proj -> RS -> ln2 -> AG -> fc, GELU, fcproj -> RS
    backward  AG(d out) -> fcproj, GELU backward -> AG(ln2 again) -> fc backward -> RS
              -> ln2 backward -> AG(d out) -> proj, attention backward -> AG(ln1 again)
              -> qkv backward -> RS -> ln1 backward

4 all-gathers and 2 reduce-scatters backward: a column-parallel linear (qkv, fc, the LM
head) saves only the sequence shard of its input, as Megatron's
LinearWithGradAccumulationAndAsyncCommunication does, and all-gathers it again in backward
for its weight gradient. So the real compute here saves ln1, ln2 and ln_f as shards, gathers
them into one shared scratch when a matmul needs them, and never keeps a (B,T,C) input per
layer. With MoE the MLP's gathers are replaced by the token dispatcher's (moe.py).
"""

from __future__ import annotations

import numpy as np

from proxies.transformer.setup import Chunk


class SequenceParallelPieces:
    """The pieces only sequence parallelism has, and its views of tp_buf. `_sp_<piece>`
    replaces `_<piece>` under sequence parallelism (StageShard.compute)."""

    # ------------------------------------------------------------------------------------
    # tp_buf as shards

    def _blocks(self) -> np.ndarray:
        """tp_buf as (tp,B,Ts,C): block i is rank i's sequence shard (allgather and
        reduce-scatter work on contiguous blocks of the flat buffer)."""
        S = self.S
        return self.tp_buf.reshape(S.tp, S.B, S.T // S.tp, S.cfg.n_embd)

    def _gather(self, out: np.ndarray) -> np.ndarray:
        """out (B,T,C) = the allgathered shards in tp_buf."""
        S = self.S
        out.reshape(S.B, S.tp, S.T // S.tp, -1)[...] = self._blocks().transpose(1, 0, 2, 3)
        return out

    def _gathered(self, name: str) -> np.ndarray:
        """The allgathered (B,T,C) in a shared scratch: "input" for a column-parallel
        matmul's input, "dout" for a row-parallel matmul's output gradient. Neither outlives
        the piece after the gather (a layer saves only its shards)."""
        S = self.S
        return self._gather(self.scratch(name, S.B, S.T, S.cfg.n_embd))

    def _scatter(self, full: np.ndarray) -> None:
        """tp_buf blocks = full (B,T,C) cut into sequence shards, for a reduce-scatter."""
        S = self.S
        self._blocks()[...] = full.reshape(S.B, S.tp, S.T // S.tp, -1).transpose(1, 0, 2, 3)

    def _share(self, shard: np.ndarray) -> None:
        """This rank's shard into its block of tp_buf, for an allgather."""
        self._blocks()[self.r] = shard

    # ------------------------------------------------------------------------------------
    # forward

    def _fwd_ln1(self, st, ch: Chunk, mb: int, l: int) -> None:
        """Layernorm on the shard (the shard is what backward keeps), for the allgather."""
        a, w = st.layers[l], self.w
        a.inp = self._layer_input(st, ch, mb, l)
        self.k.layernorm_forward(
            a.ln1, a.ln1_mean, a.ln1_rstd, a.inp, w[f"h.{l}.ln_1.weight"], w[f"h.{l}.ln_1.bias"]
        )
        self._share(a.ln1)

    def _fwd_ln2(self, st, ch: Chunk, mb: int, l: int) -> None:
        """Residual and ln2 on the shard, for the allgather."""
        self._finish_attn(st, l)
        self._share(st.layers[l].ln2)

    # ------------------------------------------------------------------------------------
    # backward

    def _bwd_head_in(self, st, ch: Chunk, mb: int) -> None:
        """ln_f's output shard again, for the LM head's weight gradient (allgather)."""
        self._share(st.lnf)

    def _bwd_start(self, st, ch: Chunk, mb: int) -> None:
        """Not the head chunk: the received gradient, for the allgather (dense MLP) or the
        MoE combine (which needs only the shard)."""
        self._share(self._dres_top(st, ch, mb))

    def _bwd_lnf(self, st, ch: Chunk, mb: int) -> None:
        """Head chunk: ln_f backward on the shard, likewise."""
        self._share(self._dres_top(st, ch, mb))

    def _bwd_fcproj(self, st, ch: Chunk, mb: int, l: int) -> None:
        """fcproj and GELU backward on the allgathered output gradient; then ln2's shard for
        the allgather fc's weight gradient needs."""
        self._mlp_out_backward(st, l, self._gathered("dout"))
        self._share(st.layers[l].ln2)

    def _sp_bwd_mlp(self, st, ch: Chunk, mb: int, l: int) -> None:
        """fc backward with the re-gathered ln2: partial dln2, cut for the reduce-scatter."""
        out = self._partial_out()
        self._mlp_in_backward(st, l, self._gathered("input"), out)
        self._scatter(out)

    def _bwd_ln2(self, st, ch: Chunk, mb: int, l: int) -> None:
        """ln2 backward on the shard (dln2 reduced in tp_buf), dres for the allgather."""
        self._finish_ln2(st, l)
        self._share(st.dres)

    def _bwd_proj(self, st, ch: Chunk, mb: int, l: int) -> None:
        """proj and attention backward on the allgathered output gradient; then ln1's shard
        for the allgather qkv's weight gradient needs."""
        self._attn_out_backward(st, l, self._gathered("dout"))
        self._share(st.layers[l].ln1)

    def _sp_bwd_attn(self, st, ch: Chunk, mb: int, l: int) -> None:
        """qkv backward with the re-gathered ln1: partial dln1, cut for the reduce-scatter."""
        out = self._partial_out()
        self._attn_in_backward(st, l, self._gathered("input"), out)
        self._scatter(out)

    def _bwd_ln1(self, st, ch: Chunk, mb: int, l: int) -> None:
        """ln1 backward on the shard; dres into tp_buf for the next allgather (a lower
        layer, or the embedding), or out as the stage's input gradient."""
        self._finish_ln1(st, l)
        if l != ch.layers[0] or ch.embed:
            self._share(st.dres)
        else:
            self._send_grad(st, ch, mb)

    def _bwd_embed(self, st, ch: Chunk, mb: int) -> None:
        """The embedding backward on the allgathered gradient."""
        self._embed_backward(st, ch, mb, self._gathered("dout"))
