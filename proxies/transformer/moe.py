"""Mixture-of-experts pieces of StageShard (model.py): every layer's MLP replaced by E
experts spread over the expert-parallel group, k experts per token (Megatron/GShard).

Letters as in config.py; a rank routes Ns tokens (N, or its sequence shard B*Ts under
sequence parallelism), cap = ceil(cf * k * Ns / E) slots per expert per source rank.

    forward:  gate (ln2, router, top-k, capacity)  -> moe_buf (E, cap, C)
              all-to-all over ep (block j: the experts of ep rank j)
              [SP: allgather over tp: moe_all (tp, ep, E/ep, cap, C)]
              experts (tokens from every source, (sources, E/ep, cap, C)) -> outputs in
              place, partial over TP (experts are TP-sharded like the dense MLP: fc
              column-parallel, fcproj row-parallel, no biases)
              [SP: reduce-scatter over tp: this rank's block complete]
              all-to-all back; combine: y[t] = sum of score * output over t's kept choices
              -> tp_buf: without SP partial over TP (allreduced by the plan); with SP the
              rank's shard, complete
    backward: combine (d outputs -> moe_buf; d score -> dscore_buf, partial over TP and
              allreduced without SP, complete with SP) -> all-to-all [-> allgather] ->
              experts [-> reduce-scatter] -> all-to-all -> gate (token gradients + the
              router's; without SP every TP rank routes the same tokens, so rank 0 alone
              adds the router's) -> tp_buf

The SP layout is Megatron-core's alltoall token dispatcher with drop-and-pad: the router
runs on the sequence shard, tokens go A2A(ep) then AG(tp) to the experts and come back
RS(tp) then A2A(ep); the router weight's gradient is partial per shard and summed over TP
with the layernorms' (sp_pack).

Scores are the softmax over the k chosen logits (Megatron's default); tokens past an
expert's capacity are dropped for that expert (top-1 choices claim slots first). There is no
load-balancing loss: the routing, and so the message sizes, do not depend on it.
"""

from __future__ import annotations

import numpy as np

from proxies.transformer.setup import Chunk


class MoEPieces:
    """Pieces fwd_gate, fwd_expert, fwd_combine, bwd_combine, bwd_expert, bwd_gate."""

    def _fwd_gate(self, st, ch: Chunk, mb: int, l: int) -> None:
        """Residual, ln2, top-k gate; the tokens each expert takes (at most `cap` per expert
        from this rank, top-1 choices first) into moe_buf (E, cap, C) for the dispatch."""
        moe, C = self.S.moe, self.S.cfg.n_embd
        a = st.layers[l]
        self._finish_attn(st, l)
        x = a.ln2.reshape(-1, C)
        logits = x @ self.w[f"h.{l}.moe.gate.weight"].T  # (N, E)
        topk = np.argsort(-logits, axis=1, kind="stable")[:, : moe.top_k]  # (N, k)
        z = np.take_along_axis(logits, topk, axis=1)
        z = np.exp(z - z.max(axis=1, keepdims=True))
        a.scores = z / z.sum(axis=1, keepdims=True)  # softmax over the k chosen (Megatron)
        a.topk = topk
        # capacity: slots in order of (choice j, token t)
        e_flat = topk.T.reshape(-1)  # index j*N + t
        order = np.argsort(e_flat, kind="stable")
        starts = np.searchsorted(e_flat[order], np.arange(moe.experts))
        slot = np.empty_like(e_flat)
        slot[order] = np.arange(e_flat.size) - starts[e_flat[order]]
        keep = slot < self.cap
        a.kept = np.flatnonzero(keep)  # indices j*Ns + t
        a.t_kept = a.kept % x.shape[0]
        a.e_kept, a.slot_kept = e_flat[keep], slot[keep]
        buf = self.moe_buf.reshape(moe.experts, self.cap, C)
        buf.fill(0)
        buf[a.e_kept, a.slot_kept] = x[a.t_kept]

    def _expert_tokens(self) -> np.ndarray:
        """moe_all as (sources, E/ep, cap, C): the slots every source rank (ep, and tp under
        sequence parallelism) filled for each local expert."""
        moe = self.S.moe
        return self.moe_all.reshape(-1, moe.local_experts, self.cap, self.S.cfg.n_embd)

    def _fwd_expert(self, st, ch: Chunk, mb: int, l: int) -> None:
        """Every local expert on the tokens every source rank sent it."""
        moe, C = self.S.moe, self.S.cfg.n_embd
        a, w = st.layers[l], self.w
        buf = self._expert_tokens()
        a.ex = []
        for e in range(moe.local_experts):
            p = f"h.{l}.experts.{e}."
            x = buf[:, e].reshape(-1, C).copy()
            # widths from the weights: F/tp, or SwiGLU's [gate; up] 2F/tp into F/tp (LLaMA)
            fch = np.empty((x.shape[0], w[p + "c_fc.weight"].shape[0]), dtype=self.dtype)
            self.k.matmul_forward(fch, x, w[p + "c_fc.weight"], None)
            gel = np.empty((x.shape[0], w[p + "c_proj.weight"].shape[1]), dtype=self.dtype)
            self.k.gelu_forward(gel, fch)
            out = np.empty_like(x)
            self.k.matmul_forward(out, gel, w[p + "c_proj.weight"], None)  # partial over TP
            buf[:, e] = out.reshape(-1, self.cap, C)
            a.ex.append((x, fch, gel))

    def _fwd_combine(self, st, ch: Chunk, mb: int, l: int) -> None:
        """y[t] = sum over t's kept choices of score * expert output: partial over TP, or
        with sequence parallelism complete (the reduce-scatter summed the outputs)."""
        moe, C = self.S.moe, self.S.cfg.n_embd
        a = st.layers[l]
        buf = self.moe_buf.reshape(moe.experts, self.cap, C)
        a.eo = buf[a.e_kept, a.slot_kept]  # (kept, C) copies
        s = a.scores.T.reshape(-1)[a.kept]
        y = self._reduced_block().reshape(-1, C)
        y.fill(0)
        np.add.at(y, a.t_kept, s[:, None] * a.eo)

    def _bwd_combine(self, st, ch: Chunk, mb: int, l: int) -> None:
        """Gradients of the expert outputs into moe_buf for the dispatch back, and
        d(score) = <dy, expert output> into dscore_buf: partial (summed over TP by the plan)
        unless sequence parallel, where dy is the shard sp.py's ln1 backward left in dres."""
        moe, C = self.S.moe, self.S.cfg.n_embd
        a = st.layers[l]
        dy = st.dres if self.S.sp else self._layer_dres(st, ch, mb, l)
        dy = dy.reshape(-1, C)
        s = a.scores.T.reshape(-1)[a.kept]
        buf = self.moe_buf.reshape(moe.experts, self.cap, C)
        buf.fill(0)
        buf[a.e_kept, a.slot_kept] = s[:, None] * dy[a.t_kept]
        self.dscore_buf.fill(0)
        self.dscore_buf[a.kept] = np.einsum("ic,ic->i", dy[a.t_kept], a.eo)

    def _bwd_expert(self, st, ch: Chunk, mb: int, l: int) -> None:
        """Every local expert's backward; input gradients (partial over TP) back in place."""
        C = self.S.cfg.n_embd
        a, w, g, k = st.layers[l], self.w, self.g, self.k
        buf = self._expert_tokens()
        for e, (x, fch, gel) in enumerate(a.ex):
            p = f"h.{l}.experts.{e}."
            dout = buf[:, e].reshape(-1, C).copy()
            dgel, dfch, dx = np.empty_like(gel), np.empty_like(fch), np.empty_like(x)
            wn = p + "c_proj.weight"
            k.matmul_backward(dgel, g[wn], None, dout, gel, w[wn], True, self._fresh(wn))
            k.gelu_backward(dfch, fch, dgel, fresh=True)
            wn = p + "c_fc.weight"
            k.matmul_backward(dx, g[wn], None, dfch, x, w[wn], True, self._fresh(wn))
            buf[:, e] = dx.reshape(-1, self.cap, C)  # partial over TP

    def _bwd_gate(self, st, ch: Chunk, mb: int, l: int) -> None:
        """Token gradients from the experts plus the router's: dln2 into tp_buf, partial for
        the allreduce (the router's added on TP rank 0 only: every rank routes the same
        tokens), or with sequence parallelism this rank's complete shard."""
        S, moe, C = self.S, self.S.moe, self.S.cfg.n_embd
        a = st.layers[l]
        buf = self.moe_buf.reshape(moe.experts, self.cap, C)
        dx = self._reduced_block().reshape(-1, C)
        dx.fill(0)
        np.add.at(dx, a.t_kept, buf[a.e_kept, a.slot_kept])
        Ns = dx.shape[0]
        ds = self.dscore_buf.reshape(moe.top_k, Ns).T  # (Ns, k), complete
        dz = a.scores * (ds - (a.scores * ds).sum(axis=1, keepdims=True))
        dlogits = np.zeros((Ns, moe.experts), dtype=self.dtype)
        np.put_along_axis(dlogits, a.topk, dz, axis=1)
        wn = f"h.{l}.moe.gate.weight"
        x = a.ln2.reshape(-1, C)
        if self._fresh(wn):
            np.matmul(dlogits.T, x, out=self.g[wn])
        else:
            self.g[wn] += dlogits.T @ x
        if S.sp or self.r == 0:
            dx += dlogits @ self.w[wn]
