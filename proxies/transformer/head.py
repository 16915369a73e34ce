"""The vocabulary-parallel ends of StageShard (model.py): the token and position embedding,
the final layernorm, the LM head tied to wte and the cross-entropy, forward and backward.

The vocabulary is split over TP: the embedding looks up its Vp/tp rows (zeros for tokens
outside them) and an allreduce sums the parts; the LM head computes logits for its slice and
the cross-entropy combines per-token (max, sum-exp, target logit) of every slice (one
allgather, `ce_buf`). Letters as in model.py.
"""

from __future__ import annotations

import numpy as np

from proxies.transformer import fast
from proxies.transformer.kernels import CLASSIFIER_CHUNK
from proxies.transformer.setup import Chunk
from proxies.transformer.state import ChunkActs


class HeadPieces:
    """Mixed into StageShard: uses its parameters, gradients, buffers and kernels (self.k)."""

    HEAD = "wte"  # the LM head's weight: the tied embedding (LLaMA's shard: "lm_head")

    def _fwd_embed(self, st: ChunkActs, ch: Chunk, mb: int) -> None:
        """Partial token embedding from this rank's vocabulary rows, for the allreduce."""
        tokens, _ = self.batch(mb)
        st.tokens = tokens
        out = self._full()
        local = tokens - self.lo
        if self.S.tp == 1:
            np.take(self.w["wte"], local, axis=0, out=out)
        else:
            mask = (local >= 0) & (local < self.valid)
            out.fill(0)
            out[mask] = self.w["wte"][local[mask]]

    def _fwd_lnf(self, st: ChunkActs, ch: Chunk, mb: int) -> None:
        """Final layernorm (on the sequence shard under sequence parallelism)."""
        x = self._finish_mlp(st, ch.layers[-1])
        self.k.layernorm_forward(
            st.lnf, st.lnf_mean, st.lnf_rstd, x, self.w["ln_f.weight"], self.w["ln_f.bias"]
        )
        if self.S.sp:
            self._share(st.lnf)

    def _fwd_head(self, st: ChunkActs, ch: Chunk, mb: int) -> None:
        """Logits of this rank's vocabulary slice; per token (max, sum-exp, target logit) into
        this rank's block of ce_buf for the allgather."""
        S = self.S
        if S.sp:
            x = self._gathered("input")
        else:
            self._fwd_lnf(st, ch, mb)
            x = st.lnf
        _, st.targets = self.batch(mb)
        x = x.reshape(-1, S.cfg.n_embd)
        t = st.targets.reshape(-1) - self.lo
        stats = self.ce_buf.reshape(S.tp, 3, S.N)[self.r]
        mx, se, tl = stats
        tl.fill(0)
        W = self.w[self.HEAD][: self.valid]
        for i, n, logits in self._logit_chunks(x, W, st.probs):

            def stats_of(lo: int, hi: int, i: int = i, logits: np.ndarray = logits) -> None:
                z, a, b = logits[lo:hi], i + lo, i + hi
                tt = t[a:b]
                mine = (tt >= 0) & (tt < self.valid)
                tl[a:b][mine] = z[np.arange(hi - lo)[mine], tt[mine]]
                m = z.max(axis=1) if self.valid else np.full(hi - lo, -np.inf, self.dtype)
                mx[a:b] = m
                z -= m[:, None]
                np.exp(z, out=z)  # kept in st.probs when it fits
                se[a:b] = z.sum(axis=1)

            self._rows(stats_of, n)
        if st.mx is not None:
            st.mx[...] = mx

    def _rows(self, fn, n: int) -> None:
        """fn(lo, hi) over blocks of n logit rows, on the kernels' worker threads (rows are
        independent: the same result however they are cut)."""
        fast.blocked(fn, n, max(1, fast.BLOCK // max(1, self.valid) * 4), 1)

    def _logit_chunks(self, x: np.ndarray, W: np.ndarray, into: np.ndarray | None = None):
        """(first row, rows, logits (rows, V held)) over row chunks of x (bounded memory);
        into (N, V held) given: all rows at once, there (one matmul at the full GEMM rate)."""
        N, Vv = x.shape[0], max(1, W.shape[0])
        if into is not None:
            np.matmul(x, W.T, out=into)
            yield 0, N, into
            return
        R = max(1, min(N, CLASSIFIER_CHUNK // Vv))
        buf = self.scratch("logits", R, W.shape[0])
        for i in range(0, N, R):
            n = min(R, N - i)
            np.matmul(x[i : i + n], W.T, out=buf[:n])
            yield i, n, buf[:n]

    def _fwd_loss(self, st: ChunkActs, ch: Chunk, mb: int) -> float:
        """Cross-entropy from every slice's statistics: lse = M + log sum_r s_r e^(m_r - M)."""
        S = self.S
        stats = self.ce_buf.reshape(S.tp, 3, S.N).astype(np.float64)
        mx, se, tl = stats[:, 0], stats[:, 1], stats[:, 2]
        M = mx.max(axis=0)
        lse = M + np.log((se * np.exp(mx - M)).sum(axis=0))
        st.lse.reshape(-1)[...] = lse
        st.loss_scale = self.loss_scale
        return float((lse - tl.sum(axis=0)).mean())

    # ------------------------------------------------------------------------------------
    # backward

    def _bwd_head(self, st: ChunkActs, ch: Chunk, mb: int) -> None:
        """dlogits = (softmax - onehot) * scale / N on this slice; partial dx into tp_buf;
        wte gradient of this slice (the tied LM head). Sequence parallel: with ln_f's output
        gathered again (sp.py), cut for the reduce-scatter."""
        S, C = self.S, self.S.cfg.n_embd
        x = (self._gathered("input") if S.sp else st.lnf).reshape(-1, C)
        t = st.targets.reshape(-1) - self.lo
        lse = st.lse.reshape(-1)
        out = self._partial_out().reshape(-1, C)
        W, dW = self.w[self.HEAD][: self.valid], self.g[self.HEAD][: self.valid]
        scale = float(st.loss_scale) / S.N
        fresh = self._fresh(self.HEAD)
        if fresh:  # padding rows get no gradient
            self.g[self.HEAD][self.valid :] = 0
        kept = st.probs is not None
        # softmax = exp(logits - mx) * exp(mx - lse): from the kept probabilities, no matmul
        chunks = [(0, S.N, st.probs)] if kept else self._logit_chunks(x, W)
        for i, n, dlogits in chunks:

            def dlogits_of(lo: int, hi: int, i: int = i, dlogits: np.ndarray = dlogits) -> None:
                z, a, b = dlogits[lo:hi], i + lo, i + hi
                if kept:
                    z *= (np.exp(st.mx[a:b] - lse[a:b]) * scale)[:, None]  # mx -inf: none held
                else:
                    z -= lse[a:b, None]
                    np.exp(z, out=z)
                    z *= scale
                tt = t[a:b]
                mine = (tt >= 0) & (tt < self.valid)
                z[np.arange(hi - lo)[mine], tt[mine]] -= scale

            self._rows(dlogits_of, n)
            # out rows written, dW (V held, C) through the kernels' row blocks
            self.k.matmul_backward(
                out[i : i + n], dW, None, dlogits, x[i : i + n], W, True, fresh and i == 0
            )
        if S.sp:
            self._scatter(out.reshape(S.B, S.T, C))

    def _embed_backward(self, st: ChunkActs, ch: Chunk, mb: int, d: np.ndarray) -> None:
        """wpe and this rank's wte rows from d (B,T,C): rows scattered, no V x C temporary."""
        g, fresh_wte, fresh_wpe = self.g, self._fresh("wte"), self._fresh("wpe")
        if self.S.tp == 1:  # every token is this rank's: GPT-2's encoder backward
            self.k.encoder_backward(g["wte"], g["wpe"], d, st.tokens, fresh_wpe, fresh_wte)
        else:
            C, T = self.S.cfg.n_embd, self.S.T
            if fresh_wpe:
                g["wpe"][T:] = 0
                np.sum(d, axis=0, out=g["wpe"][:T])
            else:
                g["wpe"][:T] += d.sum(axis=0)
            if fresh_wte:
                g["wte"].fill(0)
            local = st.tokens.reshape(-1) - self.lo
            mask = (local >= 0) & (local < self.valid)
            np.add.at(g["wte"], local[mask], d.reshape(-1, C)[mask])
        self._free(mb, ch.index)

    # ------------------------------------------------------------------------------------
    # after the pipeline
