"""LLaMA's kernels against centered finite differences in float64 (tests/gradcheck.py), and
their forwards against plain definitions. Backward kernels accumulate: buffers start at 1."""

from __future__ import annotations

import math

import numpy as np
from gradcheck import check, numgrad, rand

from proxies.transformer import kernels as K
from proxies.transformer import llama_kernels as LK

B, T, C, NH, KVH = 2, 5, 8, 4, 2
hs = C // NH
W = (NH + 2 * KVH) * hs


def test_rmsnorm():
    inp, w, dout = rand(B, T, C, seed=1), 1 + rand(C, seed=2, scale=0.3), rand(B, T, C, seed=3)
    out, rstd = np.empty((B, T, C)), np.empty((B, T))

    def loss():
        LK.rmsnorm_forward(out, rstd, inp, w)
        return (out * dout).sum()

    loss()
    check("rmsnorm out", out, inp / np.sqrt((inp**2).mean(-1, keepdims=True) + 1e-5) * w)
    dinp, dw = np.ones_like(inp), np.ones_like(w)
    LK.rmsnorm_backward(dinp, dw, dout, inp, w, rstd)
    check("rmsnorm dinp", dinp, 1 + numgrad(loss, inp))
    check("rmsnorm dweight", dw, 1 + numgrad(loss, w))
    LK.rmsnorm_backward(dinp, dw, dout, inp, w, rstd, fresh=True)
    check("rmsnorm dweight fresh", dw, numgrad(loss, w))


def test_rope():
    pos = np.array([0, 3, 4, 9, 17])  # a cp rank's true positions, not 0..T-1
    cos, sin = LK.rope_tables(pos, hs, 500000.0)
    x, dout = rand(B, T, NH, hs, seed=1), rand(B, T, NH, hs, seed=2)
    # the definition: pair (2i, 2i+1) as a complex number times exp(i pos theta^(-2i/hs))
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(
        1j * pos[:, None] * 500000.0 ** (-np.arange(0, hs, 2) / hs)
    )[None, :, None, :]
    y = x.copy()
    LK.rope_forward(y, cos, sin)
    check("rope real", y[..., 0::2], z.real)
    check("rope imag", y[..., 1::2], z.imag)

    def loss():
        t = x.copy()
        LK.rope_forward(t, cos, sin)
        return (t * dout).sum()

    d = dout.copy()
    LK.rope_backward(d, cos, sin)
    check("rope dx", d, numgrad(loss, x))


def test_rope_position_zero_is_identity():
    cos, sin = LK.rope_tables(np.zeros(T), hs, 1e6)
    x = rand(B, T, NH, hs, seed=3)
    y = x.copy()
    LK.rope_forward(y, cos, sin)
    check("rope at 0", y, x, atol=0, rtol=0)


def test_swiglu():
    F = 6
    inp, dout = rand(B, T, 2 * F, seed=1), rand(B, T, F, seed=2)
    out = np.empty((B, T, F))

    def loss():
        LK.swiglu_forward(out, inp)
        return (out * dout).sum()

    loss()
    g, u = inp[..., :F], inp[..., F:]
    check("swiglu out", out, g / (1 + np.exp(-g)) * u)
    dinp = np.ones_like(inp)
    LK.swiglu_backward(dinp, inp, dout)
    check("swiglu dinp", dinp, 1 + numgrad(loss, inp))


def gqa_reference(inp: np.ndarray) -> np.ndarray:
    """Loops: query head h attends with kv head h // (NH / KVH)."""
    out = np.zeros((B, T, NH * hs))
    G = NH // KVH
    for b in range(B):
        for h in range(NH):
            q = inp[b, :, h * hs : (h + 1) * hs]
            kh = h // G
            k = inp[b, :, (NH + kh) * hs : (NH + kh + 1) * hs]
            v = inp[b, :, (NH + KVH + kh) * hs : (NH + KVH + kh + 1) * hs]
            for t in range(T):
                s = k[: t + 1] @ q[t] / math.sqrt(hs)
                p = np.exp(s - s.max())
                out[b, t, h * hs : (h + 1) * hs] = (p / p.sum()) @ v[: t + 1]
    return out


def test_gqa_attention():
    inp, dout = rand(B, T, W, seed=1), rand(B, T, NH * hs, seed=2)
    out, att = np.empty((B, T, NH * hs)), np.empty((B, NH, T, T))

    def loss():
        LK.gqa_forward(out, att, inp, NH, KVH)
        return (out * dout).sum()

    loss()
    check("gqa out", out, gqa_reference(inp))
    dinp = np.ones_like(inp)
    LK.gqa_backward(dinp, dout, inp, att, NH, KVH)
    check("gqa dinp", dinp, 1 + numgrad(loss, inp))


def test_gqa_with_as_many_kv_heads_is_gpt_attention():
    """KVH = NH: the GPT kernel's attention, to the last bit of its layout."""
    inp, dout = rand(B, T, 3 * C, seed=4), rand(B, T, C, seed=5)
    out, att, out2, att2 = (np.empty(s) for s in ((B, T, C), (B, NH, T, T)) * 2)
    LK.gqa_forward(out, att, inp, NH, NH)
    K.attention_forward(out2, att2, inp, NH)
    check("gqa = mha", out, out2)
    d1, d2 = np.zeros_like(inp), np.zeros_like(inp)
    LK.gqa_backward(d1, dout, inp, att, NH, NH)
    K.attention_backward(d2, dout, inp, att2, NH)
    check("gqa = mha backward", d1, d2)
