"""Post-LN layers (BERT's, Vaswani et al. 2017): LayerNorm after each residual add, none
before attention or the MLP and no final one. Mixed into BERT's shard (encoder.py) ahead of
StageShard; with cfg.norm "pre" every method here defers to StageShard's pre-LN one.

Layer l, input x (B,T,C), tensors named as the pre-LN layer's (ln_1 now follows attention,
ln_2 the MLP):

    res2 = x + proj(attention(qkv(x)))      h1 = ln_1(res2)
    res3 = h1 + fcproj(gelu(fc(h1)))        out = ln_2(res3)

The same pieces between the same tensor-parallel collectives as pre-LN (model.py): the
forward allreduces the partial proj / fcproj outputs; the layernorms then run on the reduced
sums, where pre-LN runs them before the matmuls. Backward, per piece: bwd_mlp turns
dL/d out into dL/d res3 (ln_2's backward), then fcproj and fc (partial dL/d h1 for the
allreduce); bwd_attn adds the residual's share, ln_1's backward gives dL/d res2, then proj,
attention and qkv (partial dL/d x); the next piece adds the residual's share to that. Saved
state reuses LayerActs' fields: ln1 holds h1, ln2 the layer's output; res2 and res3 the sums
before the layernorms. No sequence parallelism (BERT's shard refuses it).
"""

from __future__ import annotations

import numpy as np

from proxies.transformer.setup import Chunk
from proxies.transformer.state import ChunkActs


class PostNormPieces:
    """Post-LN versions of StageShard's layer pieces (see the module docstring)."""

    @property
    def post(self) -> bool:
        return getattr(self.S.cfg, "norm", "pre") == "post"

    # ------------------------------------------------------------------------------------
    # forward

    def _fwd_attn(self, st: ChunkActs, ch: Chunk, mb: int, l: int) -> None:
        """qkv straight from the layer input, attention, partial proj into tp_buf."""
        if not self.post:
            return super()._fwd_attn(st, ch, mb, l)
        a, w, p, k = st.layers[l], self.w, f"h.{l}.attn.", self.k
        a.inp = self._layer_input(st, ch, mb, l)
        k.matmul_forward(a.qkv, a.inp, w[p + "c_attn.weight"], w[p + "c_attn.bias"])
        k.attention_forward(a.atty, a.att, a.qkv, self.NHl, causal=self.S.cfg.causal)
        k.matmul_forward(self._full(), a.atty, w[p + "c_proj.weight"], None)

    def _fwd_mlp(self, st: ChunkActs, ch: Chunk, mb: int, l: int) -> None:
        """res2 = x + reduced proj + bias, h1 = ln_1(res2); fc, GELU, partial fcproj."""
        if not self.post:
            return super()._fwd_mlp(st, ch, mb, l)
        a, w, p, k = st.layers[l], self.w, f"h.{l}.", self.k
        np.add(a.inp, self._full(), out=a.res2)
        a.res2 += w[p + "attn.c_proj.bias"]
        k.layernorm_forward(
            a.ln1, a.ln1_mean, a.ln1_rstd, a.res2, w[p + "ln_1.weight"], w[p + "ln_1.bias"]
        )
        k.matmul_forward(a.fch, a.ln1, w[p + "mlp.c_fc.weight"], w[p + "mlp.c_fc.bias"])
        k.gelu_forward(a.fch_gelu, a.fch)
        k.matmul_forward(self._full(), a.fch_gelu, w[p + "mlp.c_proj.weight"], None)

    def _finish_mlp(self, st: ChunkActs, l: int) -> np.ndarray:
        """res3 = h1 + reduced fcproj + bias; the layer's output ln_2(res3)."""
        if not self.post:
            return super()._finish_mlp(st, l)
        a, w, p = st.layers[l], self.w, f"h.{l}."
        np.add(a.ln1, self._full(), out=a.res3)
        a.res3 += w[p + "mlp.c_proj.bias"]
        self.k.layernorm_forward(
            a.ln2, a.ln2_mean, a.ln2_rstd, a.res3, w[p + "ln_2.weight"], w[p + "ln_2.bias"]
        )
        return a.ln2

    # ------------------------------------------------------------------------------------
    # backward

    def _bwd_mlp(self, st: ChunkActs, ch: Chunk, mb: int, l: int) -> None:
        """dres: dL/d out -> dL/d res3 (ln_2), then fcproj, GELU, fc: partial dL/d h1."""
        if not self.post:
            return super()._bwd_mlp(st, ch, mb, l)
        a = st.layers[l]
        self._layer_dres(st, ch, mb, l)
        self._norm_backward(st.dres, a.res3, f"h.{l}.ln_2.", a.ln2_mean, a.ln2_rstd)
        self._mlp_out_backward(st, l, st.dres)
        self._mlp_in_backward(st, l, a.ln1, self._full())

    def _bwd_attn(self, st: ChunkActs, ch: Chunk, mb: int, l: int) -> None:
        """dres += reduced dL/d h1 (fc's input), -> dL/d res2 (ln_1), then proj, attention,
        qkv: partial dL/d x into tp_buf."""
        if not self.post:
            return super()._bwd_attn(st, ch, mb, l)
        a = st.layers[l]
        st.dres += self._full()
        self._norm_backward(st.dres, a.res2, f"h.{l}.ln_1.", a.ln1_mean, a.ln1_rstd)
        self._attn_out_backward(st, l, st.dres)
        self._attn_in_backward(st, l, a.inp, self._full())

    def _finish_ln1(self, st: ChunkActs, l: int) -> None:
        """dL/d x of layer l: the residual's share (dres) plus qkv's input gradient."""
        if not self.post:
            return super()._finish_ln1(st, l)
        st.dres += self._full()

    def _norm_backward(
        self, d: np.ndarray, x: np.ndarray, prefix: str, mean: np.ndarray, rstd: np.ndarray
    ) -> None:
        """d := the gradient w.r.t. x of a layernorm whose output gradient is d (through a
        scratch: the kernel adds into its input gradient)."""
        out = self.scratch("dnorm", *d.shape)
        out.fill(0)
        w, g = self.w, self.g
        self.k.layernorm_backward(
            out, g[prefix + "weight"], g[prefix + "bias"], d, x, w[prefix + "weight"],
            mean, rstd, self._fresh(prefix + "weight"),
        )  # fmt: skip
        d[...] = out
