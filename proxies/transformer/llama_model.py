"""The LLaMA layer on the one tensor-parallel StageShard (model.py): the same pieces, the
same collectives, the same Megatron sharding, with LLaMA's parts swapped in.

The choice: not a second model, but the shard parameterised where LLaMA differs.
- Kernels: `LlamaKernels` wraps the shard's kernels (fast or reference) and answers the
  calls the shard makes with LLaMA's: layernorm_* (bias None) is RMSNorm, gelu_* is
  SwiGLU (fc's output is [gate | up], 2F/tp wide; the activation F/tp), attention_* is
  RoPE (at the shard's tokens' true positions) then grouped-query attention on the local
  NH/tp query and KVH/tp key/value heads (the backward sums the query heads' gradients into
  their shared kv head, then rotates dq and dk back).
- Tensors (layout.py, transformer/llama.py): no biases (a missing bias reads as None, which
  the matmul kernels take as "no bias"), no wpe, its own lm_head beside wte (head.py's HEAD).
- The few methods that add a bias or wpe directly are overridden here.

Weights are drawn per global tensor (as GPT's: N(0, 0.02), the output projections 0.02 /
sqrt(2L), norms 1) and sliced, so every tp gives the unsharded model's loss.
"""

from __future__ import annotations

import math
from types import ModuleType

import numpy as np

from proxies.transformer import llama_kernels as lk
from proxies.transformer.config import normal
from proxies.transformer.layout import shard
from proxies.transformer.model import StageShard
from proxies.transformer.setup import Chunk, Setup
from proxies.transformer.state import ChunkActs, LayerActs


class LlamaKernels:
    """The shard's kernels with LLaMA's norm, MLP activation and attention (module doc)."""

    def __init__(
        self, base: ModuleType, shard: LlamaShard, positions: np.ndarray, rotate: bool = True
    ) -> None:
        cfg = shard.S.cfg
        self.base, self.eps = base, cfg.norm_eps
        self.NHl, self.KVHl = shard.NHl, cfg.kv_heads // shard.S.tp
        self.hs = cfg.n_embd // cfg.n_head
        self.cos, self.sin = lk.rope_tables(positions, self.hs, cfg.rope_theta)
        # RoPE inside attention (cp 1); with cp the shard rotates right after the qkv
        # projection (before k travels) and attention sees rotated q, k
        self.rotate = rotate

    def __getattr__(self, name: str):
        return getattr(self.base, name)  # matmuls, classifier, AdamW: GPT's

    def layernorm_forward(self, out, mean, rstd, inp, weight, bias) -> None:
        lk.rmsnorm_forward(out, rstd, inp, weight, self.eps)

    def layernorm_backward(
        self, dinp, dweight, dbias, dout, inp, weight, mean, rstd, fresh=False
    ) -> None:
        lk.rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, fresh)

    def gelu_forward(self, out, inp) -> None:
        lk.swiglu_forward(out, inp)

    def gelu_backward(self, dinp, inp, dout, fresh: bool = False) -> None:
        lk.swiglu_backward(dinp, inp, dout, fresh)

    def _qk(self, qkv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Views (B,T,heads,hs) of q and k in a (B,T,(NHl + 2 KVHl) hs) array."""
        B, T, _ = qkv.shape
        hs, nq, nk = self.hs, self.NHl * self.hs, self.KVHl * self.hs
        return (
            qkv[..., :nq].reshape(B, T, self.NHl, hs),
            qkv[..., nq : nq + nk].reshape(B, T, self.KVHl, hs),
        )

    def attention_forward(self, out, att, qkv, NH: int, causal: bool = True) -> None:
        """RoPE on q and k in place (the saved qkv holds them rotated), then GQA (causal:
        LLaMA is a decoder; the keyword is the shared shard's call)."""
        assert causal, "LLaMA's attention is causal"
        if self.rotate:
            for x in self._qk(qkv):
                lk.rope_forward(x, self.cos, self.sin)
        lk.gqa_forward(out, att, qkv, NH, self._kvh(qkv, NH))

    def _kvh(self, qkv: np.ndarray, NH: int) -> int:
        """The kv heads of a qkv holding NH query heads (Ulysses: a head shard's)."""
        return (qkv.shape[-1] // self.hs - NH) // 2

    def attention_backward(self, dqkv, dout, qkv, att, NH: int, fresh: bool = False) -> None:
        if not fresh:  # the rotation applies to this call's part only
            part = np.zeros_like(dqkv)
            self.attention_backward(part, dout, qkv, att, NH, fresh=True)
            dqkv += part
            return
        lk.gqa_backward(dqkv, dout, qkv, att, NH, self._kvh(qkv, NH), fresh=True)
        if self.rotate:
            for x in self._qk(dqkv):
                lk.rope_backward(x, self.cos, self.sin)


class _Tensors(dict):
    """A shard's parameter (or gradient) views: a bias LLaMA does not have reads as None."""

    def __missing__(self, key: str):
        if key.endswith(".bias"):
            return None
        raise KeyError(key)


class LlamaShard(StageShard):
    """StageShard with the LLaMA layer (module docstring). Context parallelism, every
    family (cp_kernels' GQA; Ulysses moves each part's heads): RoPE applied to q and k right
    after the qkv projection at the rank's true positions, before they travel."""

    HEAD = "lm_head"

    def __init__(self, *args, **kwargs) -> None:  # StageShard's arguments
        super().__init__(*args, **kwargs)
        # RoPE at the tokens' true positions: a cp rank's own (cpshard.py), else 0..T-1
        pos = self.pos if self.cp is not None else np.arange(self.S.T)
        self.k = LlamaKernels(self.k, self, pos, rotate=self.cp is None)

    def _cp_rotate(self, qkv: np.ndarray) -> None:
        for x in self.k._qk(qkv):
            lk.rope_forward(x, self.k.cos, self.k.sin)

    def _cp_rotate_back(self, dqkv: np.ndarray) -> None:
        for x in self.k._qk(dqkv):
            lk.rope_backward(x, self.k.cos, self.k.sin)

    def _views(self, dense: np.ndarray, expert: np.ndarray) -> dict[str, np.ndarray]:
        return _Tensors(super()._views(dense, expert))

    # ------------------------------------------------------------------------------------
    # parameters

    def _init_params(self, seed: int) -> None:
        S, w, C = self.S, self.w, self.S.cfg.n_embd
        V = S.cfg.vocab_size
        for name, stream in (("wte", 0), ("lm_head", 2)):
            if name in w:  # full (V, C), then this rank's rows
                full = np.zeros((V, C), dtype=self.dtype)
                normal(full, np.random.default_rng([seed, 0, stream]), 0.02)
                w[name][: self.valid] = full[self.lo : self.lo + self.valid]
        if "ln_f.weight" in w:
            w["ln_f.weight"].fill(1.0)
        for ch in self.chunks.values():
            for l in ch.layers:
                for n, t in init_llama_layer(S, l, seed, self.r, self.experts).items():
                    w[f"h.{l}.{n}"][...] = t

    # ------------------------------------------------------------------------------------
    # saved state: GPT's, with GQA's qkv width and SwiGLU's [gate | up] and activation

    def _alloc(self, c: int) -> ChunkActs:
        S, ch = self.S, self.chunks[c]
        B, T, Ts, C, tp, cfg = S.B, S.T, S.Ts, S.cfg.n_embd, S.tp, S.cfg

        def e(*shape: int) -> np.ndarray:
            return np.empty(shape, dtype=self.dtype)

        st = ChunkActs(x0=e(B, Ts, C), dres=e(B, Ts, C), layers={})
        for l in ch.layers:
            a = LayerActs(
                ln1=e(B, Ts, C),
                ln1_mean=e(0),  # RMSNorm keeps rstd only
                ln1_rstd=e(B, Ts),
                qkv=e(B, T, cfg.qkv_rows // tp),
                att=e(B, self.NHl, T, T) if self.cp is None else e(0),
                atty=e(B, T, C // tp),
                res2=e(B, Ts, C),
                ln2=e(B, Ts, C),
                ln2_mean=e(0),
                ln2_rstd=e(B, Ts),
                res3=e(B, Ts, C),
            )
            if not S.moe:
                F = cfg.ffn_dim // tp
                a.fch, a.fch_gelu = e(B, T, 2 * F), e(B, T, F)
            if self.cp is not None:
                self._cp_alloc(a)
            st.layers[l] = a
        if ch.head:
            st.lnf, st.lnf_mean, st.lnf_rstd, st.lse = e(B, Ts, C), e(0), e(B, Ts), e(B, T)
            if self.keeps_logits:
                st.probs, st.mx = e(S.N, self.valid), e(S.N)
        return st

    # ------------------------------------------------------------------------------------
    # what adds a bias or wpe directly

    def _chunk_input(self, st: ChunkActs, ch: Chunk, mb: int) -> np.ndarray:
        """x0: the embedding (after its allreduce; no position embedding: RoPE is in the
        attention), or the received input."""
        S = self.S
        if ch.embed:
            lo = self.r * S.Ts if S.sp else 0
            st.x0[...] = self._full()[:, lo : lo + S.Ts]
        else:
            st.x0[...] = self.message("act_in", mb, ch.index)
        return st.x0

    def _finish_mlp(self, st: ChunkActs, l: int) -> np.ndarray:
        a = st.layers[l]
        np.add(a.res2, self._reduced_block(), out=a.res3)
        return a.res3

    def _finish_attn(self, st: ChunkActs, l: int) -> None:
        a, w = st.layers[l], self.w
        np.add(a.inp, self._reduced_block(), out=a.res2)
        self.k.layernorm_forward(a.ln2, None, a.ln2_rstd, a.res2, w[f"h.{l}.ln_2.weight"], None)

    def _bias_backward(self, name: str, dres: np.ndarray) -> None:
        """No biases: nothing to accumulate."""

    def _mlp_out_backward(self, st: ChunkActs, l: int, dout: np.ndarray) -> None:
        """w2 (row-parallel) and SwiGLU backward: d[gate | up] in the scratch dfch."""
        S = self.S
        a, w, g, p = st.layers[l], self.w, self.g, f"h.{l}.mlp."
        F = S.cfg.ffn_dim // S.tp
        dact = self.scratch("dfch_gelu", S.B, S.T, F)
        dfch = self.scratch("dfch", S.B, S.T, 2 * F)
        wn = p + "c_proj.weight"
        self.k.matmul_backward(dact, g[wn], None, dout, a.fch_gelu, w[wn], True, self._fresh(wn))
        self.k.gelu_backward(dfch, a.fch, dact, fresh=True)

    def _mlp_in_backward(self, st: ChunkActs, l: int, ln2: np.ndarray, out: np.ndarray) -> None:
        """[w1; w3] (column-parallel) backward: weight gradient, partial input gradient."""
        S, w, g, p = self.S, self.w, self.g, f"h.{l}.mlp."
        dfch = self.scratch("dfch", S.B, S.T, 2 * S.cfg.ffn_dim // S.tp)
        wn = p + "c_fc.weight"
        self.k.matmul_backward(out, g[wn], None, dfch, ln2, w[wn], True, self._fresh(wn))

    def _attn_out_backward(self, st: ChunkActs, l: int, dout: np.ndarray) -> None:
        """wo (row-parallel), attention and RoPE backward: dqkv in a scratch."""
        S, C = self.S, self.S.cfg.n_embd
        a, w, g, p = st.layers[l], self.w, self.g, f"h.{l}.attn."
        datty = self.scratch("datty", S.B, S.T, C // S.tp)
        dqkv = self.scratch("dqkv", S.B, S.T, S.cfg.qkv_rows // S.tp)
        wn = p + "c_proj.weight"
        self.k.matmul_backward(datty, g[wn], None, dout, a.atty, w[wn], True, self._fresh(wn))
        self.k.attention_backward(dqkv, datty, a.qkv, a.att, self.NHl, fresh=True)

    def _attn_in_backward(self, st: ChunkActs, l: int, ln1: np.ndarray, out: np.ndarray) -> None:
        S, w, g, p = self.S, self.w, self.g, f"h.{l}.attn."
        dqkv = self.scratch("dqkv", S.B, S.T, S.cfg.qkv_rows // S.tp)
        wn = p + "c_attn.weight"
        self.k.matmul_backward(out, g[wn], None, dqkv, ln1, w[wn], True, self._fresh(wn))

    def _embed_backward(self, st: ChunkActs, ch: Chunk, mb: int, d: np.ndarray) -> None:
        """This rank's wte rows from d (B,T,C), scattered (no position embedding)."""
        g, C = self.g, self.S.cfg.n_embd
        if self._fresh("wte"):
            g["wte"].fill(0)
        local = st.tokens.reshape(-1) - self.lo
        mask = (local >= 0) & (local < self.valid)
        np.add.at(g["wte"], local[mask], d.reshape(-1, C)[mask])
        self._free(mb, ch.index)


def init_llama_layer(S: Setup, l: int, seed: int, r: int, experts: range) -> dict:
    """Layer l's tensors drawn in full (the same stream for every tp), then rank r's shard:
    qkv's q, k and v blocks each split by heads, fc's gate and up blocks each split."""
    cfg, tp = S.cfg, S.tp
    C, F, L = cfg.n_embd, cfg.ffn_dim, cfg.n_layer
    proj_std = 0.02 / math.sqrt(2 * L)
    parts = {"attn.c_attn.weight": (C, cfg.kv_width, cfg.kv_width), "mlp.c_fc.weight": (F, F)}
    rng = np.random.default_rng([seed, 1, l])
    out = {}
    for n, shape in cfg.tensor_shapes().items():
        if S.moe and n.startswith("mlp."):
            continue
        t = np.zeros(shape)
        if n.startswith("ln_"):
            t.fill(1.0)
        else:
            normal(t, rng, proj_std if n.endswith("c_proj.weight") else 0.02)
        out[n] = shard(n, t, tp, r, parts.get(n))
    if S.moe:
        Fe = S.moe.ffn_hidden
        gate = np.zeros((S.moe.experts, C))
        normal(gate, np.random.default_rng([seed, 2, l]), 0.02)
        out["moe.gate.weight"] = gate
        for i, ex in enumerate(experts):
            rng = np.random.default_rng([seed, 3, l, ex])
            fc, proj = np.zeros((2 * Fe, C)), np.zeros((C, Fe))
            normal(fc, rng, 0.02)
            normal(proj, rng, proj_std)
            out[f"experts.{i}.c_fc.weight"] = shard("c_fc.weight", fc, tp, r, (Fe, Fe))
            out[f"experts.{i}.c_proj.weight"] = shard("c_proj.weight", proj, tp, r)
    return out
