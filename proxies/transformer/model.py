"""One rank's tensor-parallel shard of its pipeline chunks: parameters, and forward/backward
cut into the pieces that sit between Megatron's tensor-parallel collectives.

Letters as in config.py (B, T, C, NH, V, Vp, N = B*T, tp, ep, E, k, F); r is this rank's
tensor-parallel rank, Ts = T / tp the sequence shard under sequence parallelism.

Megatron's tensor parallelism (Shoeybi et al. 2019), per layer:
- qkv (column-parallel): rank r holds the q, k and v rows of heads r*NH/tp .. (r+1)*NH/tp - 1,
  so attention runs on local heads only; proj (row-parallel) holds the matching C/tp columns
  and produces a partial sum, which an allreduce of B*T*C over the TP group completes;
  proj's bias is replicated and added once, after the allreduce;
- the MLP likewise: fc column-parallel (4C/tp rows), fcproj row-parallel + allreduce;
- backward mirrors it: the input gradient of a column-parallel matmul is partial, and an
  allreduce completes it before the layernorm backward. Two allreduces forward, two backward;
- sequence parallelism (Korthikanti et al. 2022) keeps layernorm, residual and dropout on a
  sequence shard (B,Ts,C): each forward allreduce becomes an allgather (before qkv / fc) and
  a reduce-scatter (after proj / fcproj); backward gathers qkv's and fc's inputs again for
  their weight gradients (sp.py); the gradients of the replicated layernorm weights,
  row-parallel biases and MoE router are then partial and summed over TP at the end;
- the vocabulary is split over TP: the embedding looks up its Vp/tp rows (zeros for tokens
  outside them) and an allreduce sums the parts; the LM head (tied to wte) computes logits for
  its slice and the cross-entropy combines per-token (max, sum-exp, target logit) of every
  slice (one allgather; Megatron allreduces the max, then the sum-exp and target logit).

The runtime runs a piece, the engine runs the plan's collective on `tp_buf` (or `ce_buf`,
`moe_buf`, `moe_all`), and the next piece reads the result: the model itself never calls MPI.

Weights are initialised exactly as proxies.gpt2 (per global tensor, seed) in full and then
sliced, so every tp gives the unsharded model's loss. Padded vocabulary rows are zero and are
left out of the softmax (Megatron keeps them as logits), so the loss does not depend on tp.

Speed (as GPT-2's model): the first write of a gradient in an iteration assigns instead of
adding (`_fresh`), so there is no zeroing pass over the gradients; the LM head keeps its
slice's exponentiated logits from the forward when they fit fast.DLOGITS_BUDGET (one matmul
fewer in backward); weight gradients accumulate through the kernels' row blocks (no V x C
temporary for the tied LM head), the embedding's by scattering rows. The kernels are a
module (fast, or the reference kernels: same names and signatures).
"""

from __future__ import annotations

import math
from dataclasses import replace
from types import ModuleType

import numpy as np

from proxies.core import pages
from proxies.transformer import fast
from proxies.transformer.config import GPT2Config, normal
from proxies.transformer.cpshard import PIECES as CP_PIECES
from proxies.transformer.cpshard import ContextParallelPieces
from proxies.transformer.head import HeadPieces
from proxies.transformer.layout import Layout, init_layer
from proxies.transformer.moe import MoEPieces
from proxies.transformer.setup import GPT2_ORDER, Chunk, Setup
from proxies.transformer.sp import SequenceParallelPieces
from proxies.transformer.state import ChunkActs, LayerActs
from proxies.transformer.whole import WholeStage


class StageShard(ContextParallelPieces, HeadPieces, MoEPieces, SequenceParallelPieces, WholeStage):
    """The real compute of one rank: its chunks' layers, TP rank r's shard of each tensor.

    compute(name, mb, chunk) runs one piece ("fwd_attn:5", "bwd_head" ...); pieces of one
    (micro-batch, chunk) run in plan order, with the plan's collectives between them.
    GPT-2's whole-stage forward / backward / backward_piece (whole.py) run them back to back.
    """

    def __init__(
        self,
        S: Setup,
        stage: int,
        tp_rank: int = 0,
        ep_rank: int = 0,
        seed: int = 0,
        dtype=np.float32,
        kernels: ModuleType = fast,
        cp_rank: int = 0,
    ) -> None:
        if S.layers_only:
            raise ValueError("real compute needs the embedding and LM head (not layers_only)")
        self.dtype = np.dtype(dtype)
        self.NHl = S.cfg.n_head // S.tp  # local heads
        self.cp_init(S, cp_rank)
        if S.cp > 1:  # every piece but attention's core on this rank's T/cp tokens (cpshard.py)
            S = replace(S, T=S.Tc, cp=1)
        self.S, self.stage, self.r, self.dtype = S, stage, tp_rank, np.dtype(dtype)
        self.k = kernels
        self.layout = Layout(S, stage)
        self.chunks = {ch.index: ch for ch in self.layout.chunks}
        cfg, C, tp = S.cfg, S.cfg.n_embd, S.tp
        self.Vl = S.vocab // tp  # vocabulary rows held
        self.lo = tp_rank * self.Vl  # first vocabulary row held
        self.valid = max(0, min(self.Vl, cfg.vocab_size - self.lo))  # rows that are not padding
        # The head keeps its slice's (N, Vl) probabilities for the backward when they fit
        # (as GPT-2's classifier keeps dlogits): no second logits matmul.
        head = any(ch.head for ch in self.chunks.values())
        self.keeps_logits = head and S.N * self.Vl * self.dtype.itemsize <= fast.DLOGITS_BUDGET
        if S.fsdp:  # FSDP gives a freed unit's pages back to the OS (transformer/fsdp.py)
            from proxies.core.fsdp import anonymous

            self.params = anonymous(self.layout.dense_size, self.dtype)
            self.grads = anonymous(self.layout.dense_size, self.dtype)
        else:
            self.params = np.zeros(self.layout.dense_size, dtype=self.dtype)
            self.grads = pages.zeros_like(self.params)  # allreduced
        self.eparams = np.zeros(self.layout.expert_size, dtype=self.dtype)
        self.egrads = pages.zeros_like(self.eparams)
        self.w = self._views(self.params, self.eparams)
        self.g = self._views(self.grads, self.egrads)
        moe = S.moe
        self.experts = range(0)
        if moe:
            El = moe.local_experts
            self.experts = range(ep_rank * El, (ep_rank + 1) * El)
            self.cap = moe.capacity(S.Ns)
        self._init_params(seed)
        # Buffers the plan's collectives run on (see the module docstring).
        self.tp_buf = pages.zeros(S.N * C, self.dtype)
        self.ce_buf = pages.zeros(tp * 3 * S.N, self.dtype)
        # MoE: moe_buf (E, cap, C) is this rank's dispatch (all-to-all over ep); with
        # sequence parallelism it is block r of moe_all, which gathers every TP rank's for
        # the experts (moe.py). Without, moe_all is moe_buf.
        sources = tp if S.sp else 1
        self.moe_all = pages.zeros(sources * moe.experts * self.cap * C if moe else 0, self.dtype)
        self.moe_buf = self.moe_all.reshape(sources, -1)[tp_rank if S.sp else 0]
        self.dscore_buf = pages.zeros(S.Ns * moe.top_k if moe else 0, self.dtype)
        self.sp_buf = pages.zeros(self.layout.sp_size if S.sp else 0, self.dtype)
        self.io: dict[tuple[str, int, int], np.ndarray] = {}  # pipeline messages
        self.saved: dict[tuple[int, int], ChunkActs] = {}  # (mb, chunk) in flight
        self._pool: dict[int, list[ChunkActs]] = {c: [] for c in self.chunks}
        self._written: set[str] = set()  # gradients written this iteration (see _fresh)
        self._scratch: dict[str, np.ndarray] = {}
        self.batch = None  # set by the runtime: mb -> (tokens, targets), both (B,T)
        self.loss_scale = 1.0
        self.m = self.v = self.em = self.ev = None  # AdamW moments
        self.t = 0

    def _views(self, dense: np.ndarray, expert: np.ndarray) -> dict[str, np.ndarray]:
        out = {n: dense[o : o + math.prod(s)].reshape(s) for n, s, o in self.layout.dense}
        out |= {n: expert[o : o + math.prod(s)].reshape(s) for n, s, o in self.layout.expert}
        return out

    def _init_params(self, seed: int) -> None:
        S, w, C = self.S, self.w, self.S.cfg.n_embd
        if "wte" in w:  # full (V, C) as gpt2 draws it, then this rank's rows
            rng = np.random.default_rng([seed, 0, 0])
            if self.lo == 0 and self.valid == S.cfg.vocab_size:  # all of it: in place
                normal(w["wte"][: self.valid], rng, 0.02)
            else:
                full = np.zeros((S.cfg.vocab_size, C), dtype=self.dtype)
                normal(full, rng, 0.02)
                w["wte"][: self.valid] = full[self.lo : self.lo + self.valid]
        if "wpe" in w:
            normal(w["wpe"], np.random.default_rng([seed, 0, 1]), 0.02)
        if "ln_f.weight" in w:
            w["ln_f.weight"].fill(1.0)
        for ch in self.chunks.values():
            for l in ch.layers:
                for n, t in init_layer(S, l, seed, S.tp, self.r, self.experts).items():
                    w[f"h.{l}.{n}"][...] = t

    # ------------------------------------------------------------------------------------
    # buffers

    def _fresh(self, name: str) -> bool:
        """True the first time in an iteration a backward writes `name`'s gradient (and its
        bias's, written with it): the kernel then assigns instead of adding, so no pass
        zeroes the gradients. Order-free: pipelines interleave micro-batches and chunks,
        and a stage holding both embedding and head writes wte twice."""
        if name in self._written:
            return False
        self._written.add(name)
        return True

    def scratch(self, name: str, *shape: int) -> np.ndarray:
        buf = self._scratch.get(name)
        if buf is None or buf.shape != shape:
            buf = self._scratch[name] = np.empty(shape, dtype=self.dtype)
        return buf

    def message(self, name: str, mb: int, chunk: int) -> np.ndarray:
        """A pipeline message buffer (B,Ts,C): act_in, act_out, grad_out, grad_in."""
        key = (name, mb, chunk)
        buf = self.io.get(key)
        if buf is None:
            S = self.S
            buf = self.io[key] = pages.zeros((S.B, S.Ts, S.cfg.n_embd), self.dtype)
        return buf

    def _full(self) -> np.ndarray:
        """tp_buf as (B,T,C): the allreduce layout."""
        S = self.S
        return self.tp_buf.reshape(S.B, S.T, S.cfg.n_embd)

    def _partial_out(self) -> np.ndarray:
        """Where a row-parallel matmul writes its partial (B,T,C): straight into tp_buf for
        an allreduce, a scratch to be cut into shards for a reduce-scatter."""
        S = self.S
        if S.sp:
            return self.scratch("partial", S.B, S.T, S.cfg.n_embd)
        return self._full()

    def _reduced_block(self) -> np.ndarray:
        """After an allreduce (B,T,C) / a reduce-scatter (B,Ts,C): this rank's reduced part."""
        return self._blocks()[self.r] if self.S.sp else self._full()

    # ------------------------------------------------------------------------------------
    # saved state of one (micro-batch, chunk)

    def _state(self, mb: int, c: int) -> ChunkActs:
        key = (mb, c)
        st = self.saved.get(key)
        if st is None:
            st = self.saved[key] = self._pool[c].pop() if self._pool[c] else self._alloc(c)
            st.at = None
        return st

    def _alloc(self, c: int) -> ChunkActs:
        S, ch = self.S, self.chunks[c]
        B, T, Ts, C, tp = S.B, S.T, S.Ts, S.cfg.n_embd, S.tp

        def e(*shape: int) -> np.ndarray:
            return np.empty(shape, dtype=self.dtype)

        st = ChunkActs(x0=e(B, Ts, C), dres=e(B, Ts, C), layers={})
        for l in ch.layers:
            a = LayerActs(
                ln1=e(B, Ts, C),
                ln1_mean=e(B, Ts),
                ln1_rstd=e(B, Ts),
                qkv=e(B, T, 3 * C // tp),
                att=e(B, self.NHl, T, T) if self.cp is None else e(0),
                atty=e(B, T, C // tp),
                res2=e(B, Ts, C),
                ln2=e(B, Ts, C),
                ln2_mean=e(B, Ts),
                ln2_rstd=e(B, Ts),
                res3=e(B, Ts, C),
            )
            if not S.moe:
                a.fch, a.fch_gelu = e(B, T, 4 * C // tp), e(B, T, 4 * C // tp)
            if self.cp is not None:
                self._cp_alloc(a)
            st.layers[l] = a
        if ch.head:
            st.lnf, st.lnf_mean, st.lnf_rstd, st.lse = e(B, Ts, C), e(B, Ts), e(B, Ts), e(B, T)
            if self.keeps_logits:
                st.probs, st.mx = e(S.N, self.valid), e(S.N)
        return st

    def _free(self, mb: int, c: int) -> None:
        self._pool[c].append(self.saved.pop((mb, c)))

    # ------------------------------------------------------------------------------------
    # dispatch

    def compute(self, name: str, mb: int, chunk: int) -> float | None:
        """Run one piece; returns the micro-batch's mean loss from "fwd_loss", else None."""
        kind, _, layer = name.partition(":")
        fn = getattr(self, "_sp_" + kind, None) if self.S.sp else None
        fn = fn or getattr(self, "_" + kind, None)
        if fn is None or not kind.startswith(("fwd_", "bwd_")):
            if self.cp is None or kind.rstrip("0123456789") not in CP_PIECES:
                raise ValueError(f"unknown compute op {name!r}")
        ch = self.chunks[chunk]
        if self.cp is not None and layer:
            if self.S.sp and kind == "bwd_attn":
                return self._cp_sp_bwd_attn(self._state(mb, chunk), ch, mb, int(layer))
            if self._cp_piece(kind, self._state(mb, chunk), ch, mb, int(layer)):
                return None
        return (
            fn(self._state(mb, chunk), ch, mb, int(layer))
            if layer
            else fn(self._state(mb, chunk), ch, mb)
        )

    # ------------------------------------------------------------------------------------
    # forward

    def _chunk_input(self, st: ChunkActs, ch: Chunk, mb: int) -> np.ndarray:
        """x0 (B,Ts,C): the embedding (after its allreduce, plus wpe) or the received input."""
        S = self.S
        if ch.embed:
            # wpe at each token's position: with cp, the split's (cpshard.py)
            pos = self.pos if self.cp is not None else slice(0, S.T)
            if S.sp:  # Megatron: allreduce, add wpe, keep this rank's sequence shard
                lo = self.r * S.Ts
                wpe = self.w["wpe"][pos][lo : lo + S.Ts]
                np.add(self._full()[:, lo : lo + S.Ts], wpe, out=st.x0)
            else:
                np.add(self._full(), self.w["wpe"][pos], out=st.x0)
        else:
            st.x0[...] = self.message("act_in", mb, ch.index)
        return st.x0

    def _layer_input(self, st: ChunkActs, ch: Chunk, mb: int, l: int) -> np.ndarray:
        """Input of layer l: the chunk input, or layer l-1's output (finishing its MLP)."""
        if l == ch.layers[0]:
            return self._chunk_input(st, ch, mb)
        return self._finish_mlp(st, l - 1)

    def _finish_mlp(self, st: ChunkActs, l: int) -> np.ndarray:
        """res3 = res2 + (reduced MLP output) + fcproj bias: layer l's output."""
        a = st.layers[l]
        np.add(a.res2, self._reduced_block(), out=a.res3)
        if not self.S.moe:
            a.res3 += self.w[f"h.{l}.mlp.c_proj.bias"]
        return a.res3

    def _fwd_attn(self, st: ChunkActs, ch: Chunk, mb: int, l: int) -> None:
        """ln1 (unless sequence parallel did it), qkv for local heads, attention, partial proj."""
        a, w, p = st.layers[l], self.w, f"h.{l}."
        if self.S.sp:  # gathered for the matmul, not kept: backward gathers it again
            ln1 = self._gathered("input")
        else:
            a.inp = self._layer_input(st, ch, mb, l)
            ln1 = a.ln1
            self.k.layernorm_forward(
                ln1, a.ln1_mean, a.ln1_rstd, a.inp, w[p + "ln_1.weight"], w[p + "ln_1.bias"]
            )
        self.k.matmul_forward(a.qkv, ln1, w[p + "attn.c_attn.weight"], w[p + "attn.c_attn.bias"])
        self.k.attention_forward(a.atty, a.att, a.qkv, self.NHl, causal=self.S.cfg.causal)
        out = self._partial_out()
        self.k.matmul_forward(out, a.atty, w[p + "attn.c_proj.weight"], None)
        if self.S.sp:
            self._scatter(out)

    def _finish_attn(self, st: ChunkActs, l: int) -> None:
        """res2 = inp + (reduced attention output) + proj bias, then ln2."""
        a, w, p = st.layers[l], self.w, f"h.{l}."
        np.add(a.inp, self._reduced_block(), out=a.res2)
        a.res2 += w[p + "attn.c_proj.bias"]
        self.k.layernorm_forward(
            a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, w[p + "ln_2.weight"], w[p + "ln_2.bias"]
        )

    def _fwd_mlp(self, st: ChunkActs, ch: Chunk, mb: int, l: int) -> None:
        """fc (local 4C/tp rows), GELU, partial fcproj."""
        a, w, p = st.layers[l], self.w, f"h.{l}.mlp."
        if self.S.sp:
            ln2 = self._gathered("input")
        else:
            self._finish_attn(st, l)
            ln2 = a.ln2
        self.k.matmul_forward(a.fch, ln2, w[p + "c_fc.weight"], w[p + "c_fc.bias"])
        self.k.gelu_forward(a.fch_gelu, a.fch)
        out = self._partial_out()
        self.k.matmul_forward(out, a.fch_gelu, w[p + "c_proj.weight"], None)
        if self.S.sp:
            self._scatter(out)

    def _fwd_out(self, st: ChunkActs, ch: Chunk, mb: int) -> None:
        """The chunk's output, to be sent to the next stage (valid until its backward)."""
        self.io[("act_out", mb, ch.index)] = self._finish_mlp(st, ch.layers[-1])

    def _dres_top(self, st: ChunkActs, ch: Chunk, mb: int) -> np.ndarray:
        """Gradient w.r.t. the chunk's output (B,Ts,C): from ln_f's backward on the head
        chunk (after the allreduce / reduce-scatter of dlnf), else the received gradient."""
        if ch.head:
            st.dres.fill(0)  # layernorm_backward adds dinp: the residual stream starts here
            w, g = self.w, self.g
            x = st.layers[ch.layers[-1]].res3
            self.k.layernorm_backward(
                st.dres,
                g["ln_f.weight"],
                g["ln_f.bias"],
                self._reduced_block(),
                x,
                w["ln_f.weight"],
                st.lnf_mean,
                st.lnf_rstd,
                self._fresh("ln_f.weight"),
            )
        else:
            st.dres[...] = self.message("grad_out", mb, ch.index)
        return st.dres

    def _finish_ln1(self, st: ChunkActs, l: int) -> None:
        """dres += ln1 backward of layer l (dln1 reduced in tp_buf): dres becomes dL/d inp."""
        a, w, g, p = st.layers[l], self.w, self.g, f"h.{l}.ln_1."
        self.k.layernorm_backward(
            st.dres,
            g[p + "weight"],
            g[p + "bias"],
            self._reduced_block(),
            a.inp,
            w[p + "weight"],
            a.ln1_mean,
            a.ln1_rstd,
            self._fresh(p + "weight"),
        )

    def _layer_dres(self, st: ChunkActs, ch: Chunk, mb: int, l: int) -> np.ndarray:
        """dL/d(layer l's output): the chunk's top gradient, or layer l+1's ln1 backward."""
        self._bwd_settle(st, ch, mb, l + 1)
        return st.dres

    def _bwd_settle(self, st: ChunkActs, ch: Chunk, mb: int, l: int) -> None:
        """Make st.dres dL/d(input of layer l) (l = the top layer + 1: the chunk's output
        gradient): the layernorm backward (ln_1 of layer l, or ln_f) a piece leaves to the
        next one, because its partial input gradient is reduced over TP between them. Also
        a piece of its own, run straight after, where no collective sits between and a
        piece's gradients must be final when it ends (GPT-2's whole-stage pieces, whole.py).
        Runs once: the next piece then finds it done."""
        if st.at == l:
            return
        if l == ch.layers[-1] + 1:
            self._dres_top(st, ch, mb)
        else:
            self._finish_ln1(st, l)
        st.at = l

    def _bwd_mlp(self, st: ChunkActs, ch: Chunk, mb: int, l: int) -> None:
        """fcproj, GELU and fc backward: partial dln2 into tp_buf for the allreduce."""
        self._layer_dres(st, ch, mb, l)
        self._mlp_out_backward(st, l, st.dres)
        self._mlp_in_backward(st, l, st.layers[l].ln2, self._full())

    def _mlp_out_backward(self, st: ChunkActs, l: int, dout: np.ndarray) -> None:
        """fcproj (row-parallel) and GELU backward: dfch in a scratch for fc's backward.
        dout is the (B,T,C) output gradient; the bias is added after the reduction, so its
        gradient is dres (the shard under sequence parallelism: summed over TP later)."""
        S, C = self.S, self.S.cfg.n_embd
        a, w, g, p = st.layers[l], self.w, self.g, f"h.{l}.mlp."
        self._bias_backward(p + "c_proj.bias", st.dres)
        dgelu = self.scratch("dfch_gelu", S.B, S.T, 4 * C // S.tp)
        dfch = self.scratch("dfch", S.B, S.T, 4 * C // S.tp)
        wn = p + "c_proj.weight"
        self.k.matmul_backward(dgelu, g[wn], None, dout, a.fch_gelu, w[wn], True, self._fresh(wn))
        self.k.gelu_backward(dfch, a.fch, dgelu, fresh=True)

    def _mlp_in_backward(self, st: ChunkActs, l: int, ln2: np.ndarray, out: np.ndarray) -> None:
        """fc (column-parallel) backward from the scratch dfch: weight gradient with its
        input ln2 (B,T,C), the partial input gradient into out."""
        S, w, g, p = self.S, self.w, self.g, f"h.{l}.mlp."
        dfch = self.scratch("dfch", S.B, S.T, 4 * S.cfg.n_embd // S.tp)
        wn = p + "c_fc.weight"
        self.k.matmul_backward(
            out, g[wn], g[p + "c_fc.bias"], dfch, ln2, w[wn], True, self._fresh(wn)
        )

    def _finish_ln2(self, st: ChunkActs, l: int) -> None:
        """dres += ln2 backward (dln2 reduced in tp_buf): dres becomes dL/d res2."""
        a, w, g, p = st.layers[l], self.w, self.g, f"h.{l}.ln_2."
        self.k.layernorm_backward(
            st.dres,
            g[p + "weight"],
            g[p + "bias"],
            self._reduced_block(),
            a.res2,
            w[p + "weight"],
            a.ln2_mean,
            a.ln2_rstd,
            self._fresh(p + "weight"),
        )

    def _bwd_attn(self, st: ChunkActs, ch: Chunk, mb: int, l: int) -> None:
        """proj, attention and qkv backward: partial dln1 into tp_buf for the allreduce."""
        self._finish_ln2(st, l)
        self._attn_out_backward(st, l, st.dres)
        self._attn_in_backward(st, l, st.layers[l].ln1, self._full())

    def _attn_out_backward(self, st: ChunkActs, l: int, dout: np.ndarray) -> None:
        """proj (row-parallel) and attention backward: dqkv in a scratch for qkv's."""
        S, C = self.S, self.S.cfg.n_embd
        a, w, g, p = st.layers[l], self.w, self.g, f"h.{l}.attn."
        self._bias_backward(p + "c_proj.bias", st.dres)
        datty = self.scratch("datty", S.B, S.T, C // S.tp)
        dqkv = self.scratch("dqkv", S.B, S.T, 3 * C // S.tp)
        wn = p + "c_proj.weight"
        self.k.matmul_backward(datty, g[wn], None, dout, a.atty, w[wn], True, self._fresh(wn))
        self.k.attention_backward(dqkv, datty, a.qkv, a.att, self.NHl, fresh=True)

    def _attn_in_backward(self, st: ChunkActs, l: int, ln1: np.ndarray, out: np.ndarray) -> None:
        """qkv (column-parallel) backward from the scratch dqkv: weight gradient with its
        input ln1 (B,T,C), the partial input gradient into out."""
        S, w, g, p = self.S, self.w, self.g, f"h.{l}.attn."
        dqkv = self.scratch("dqkv", S.B, S.T, 3 * S.cfg.n_embd // S.tp)
        wn = p + "c_attn.weight"
        self.k.matmul_backward(
            out, g[wn], g[p + "c_attn.bias"], dqkv, ln1, w[wn], True, self._fresh(wn)
        )

    def _bias_backward(self, name: str, dres: np.ndarray) -> None:
        """A row-parallel bias (added after the reduction): its gradient is dres (B,Ts,C)
        summed over tokens (under sequence parallelism the shard's part: summed over TP
        later, sp_pack)."""
        d, g = dres.reshape(-1, dres.shape[-1]), self.g[name]
        if self._fresh(name):
            np.sum(d, axis=0, out=g)
        else:
            g += d.sum(axis=0)

    def _send_grad(self, st: ChunkActs, ch: Chunk, mb: int) -> None:
        self.message("grad_in", mb, ch.index)[...] = st.dres
        self._free(mb, ch.index)

    def _bwd_end(self, st: ChunkActs, ch: Chunk, mb: int) -> None:
        """ln1 backward of the chunk's bottom layer, then the embedding backward or the
        input gradient for the previous stage."""
        self._bwd_settle(st, ch, mb, ch.layers[0])
        if ch.embed:
            self._embed_backward(st, ch, mb, st.dres)
        else:
            self._send_grad(st, ch, mb)

    def sp_pack(self) -> None:
        """Gather the sequence-partial gradients (layernorms, row-parallel biases) into
        sp_buf for their allreduce over TP (Megatron's _allreduce_layernorm_grads)."""
        i = 0
        for lo, hi in self.layout.sp_ranges:
            self.sp_buf[i : i + hi - lo] = self.grads[lo:hi]
            i += hi - lo

    def sp_unpack(self) -> None:
        i = 0
        for lo, hi in self.layout.sp_ranges:
            self.grads[lo:hi] = self.sp_buf[i : i + hi - lo]
            i += hi - lo

    def step(self, lr: float, weight_decay: float = 0.0, part: slice | None = None) -> None:
        """AdamW over both flat arrays, or (ZeRO-1) over `part` of the dense one only, the
        moments that part's size; the next iteration's backward writes the gradients afresh
        (no zeroing pass)."""
        part = part or slice(0, self.params.size)
        if part.stop - part.start < self.params.size and self.eparams.size:
            raise ValueError("a partial (ZeRO-1) step of expert parameters is not supported")
        if self.m is None:
            n = part.stop - part.start
            self.m, self.v = np.zeros(n, self.dtype), np.zeros(n, self.dtype)
            self.em, self.ev = np.zeros_like(self.eparams), np.zeros_like(self.eparams)
        self.t += 1
        adamw = self.k.adamw_update
        p, g = self.params[part], self.grads[part]
        adamw(p, g, self.m, self.v, self.t, lr, weight_decay=weight_decay)
        if self.eparams.size:
            adamw(
                self.eparams, self.egrads, self.em, self.ev, self.t, lr, weight_decay=weight_decay
            )
        self.zero_grad()

    def zero_grad(self) -> None:
        """Gradients to zero without a pass over them: the next backward writes each one
        instead of adding to it (they read as stale values until then)."""
        self._written.clear()


# ----------------------------------------------------------------------------------------
# GPT-2 stages at tp = 1


def gpt2_stage(
    cfg: GPT2Config,
    layers: range,
    first: bool,
    last: bool,
    B: int,
    T: int,
    seed: int = 0,
    dtype=np.float32,
    kernels: ModuleType = fast,
) -> StageShard:
    """A GPT-2 pipeline stage as the gpt2 proxy builds it (tp = 1, the true vocabulary,
    config.stage_layout's offsets): `layers`, plus the embedding if `first`, ln_f and the
    tied LM head if `last`. Drive it with forward / backward (whole.py), self.batch and the
    act_in / grad_out messages."""
    if B <= 0 or not 0 < T <= cfg.max_seq_len:
        raise ValueError(
            f"need B > 0 and 0 < T <= max_seq_len = {cfg.max_seq_len}, got B={B} T={T}"
        )
    if not len(layers) or layers[0] < 0 or layers[-1] >= cfg.n_layer:
        raise ValueError(f"layers {layers} not a nonempty range within 0..{cfg.n_layer - 1}")
    none = range(layers.stop, layers.stop)
    split = ((none,) if not first else ()) + (layers,) + ((none,) if not last else ())
    S = Setup(
        cfg, B, T, 1, tp=1, pp=len(split), dp=1, v=1, sp=False, vocab=cfg.vocab_size,
        split=split, param_order=GPT2_ORDER, seed=seed,
    )  # fmt: skip
    return StageShard(S, 0 if first else 1, seed=seed, dtype=dtype, kernels=kernels)


def full_model(
    cfg: GPT2Config, B: int, T: int, seed: int = 0, dtype=np.float32, kernels: ModuleType = fast
) -> StageShard:
    """The whole GPT-2 model in one process (tp = pp = 1): every layer, embedding and head."""
    return gpt2_stage(cfg, range(cfg.n_layer), True, True, B, T, seed, dtype, kernels)
