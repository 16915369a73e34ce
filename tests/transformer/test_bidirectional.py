"""Attention without the causal mask (causal=False, BERT's encoder): the reference kernel
against the plain definition and finite differences, the fast kernel against the reference,
and every output depending on every position."""

from __future__ import annotations

import math

import numpy as np
from gradcheck import check, numgrad, rand

from proxies.transformer import fast as F
from proxies.transformer import kernels as K

B, T, C, NH = 2, 5, 8, 2


def full_attention(inp: np.ndarray, NH: int) -> np.ndarray:
    """Loops over batch, head and query: every query against all T keys."""
    B, T, C3 = inp.shape
    C = C3 // 3
    hs = C // NH
    out = np.zeros((B, T, C))
    for b in range(B):
        for h in range(NH):
            q, k, v = (inp[b, :, i * C + h * hs : i * C + (h + 1) * hs] for i in range(3))
            for t in range(T):
                s = k @ q[t] / math.sqrt(hs)
                p = np.exp(s - s.max())
                out[b, t, h * hs : (h + 1) * hs] = (p / p.sum()) @ v
    return out


def test_reference_bidirectional_against_definition_and_finite_differences():
    inp, dout = rand(B, T, 3 * C, seed=1), rand(B, T, C, seed=2)
    out, att = np.empty((B, T, C)), np.empty((B, NH, T, T))

    def loss():
        K.attention_forward(out, att, inp, NH, causal=False)
        return (out * dout).sum()

    loss()
    check("attention out", out, full_attention(inp, NH))
    assert (att > 0).all(), "a key is masked"
    dinp = np.ones_like(inp)
    K.attention_backward(dinp, dout, inp, att, NH)
    check("attention dinp", dinp, 1 + numgrad(loss, inp))


def test_fast_bidirectional_equals_reference(monkeypatch):
    monkeypatch.setenv("PROXIES_KERNEL_THREADS", "2")
    monkeypatch.setattr(F, "BLOCK", 96)  # several blocks of score rows
    Bf, Tf, Cf, NHf = 3, 16, 32, 4
    g = np.random.default_rng(7)
    qkv = g.standard_normal((Bf, Tf, 3 * Cf)).astype(np.float32)
    d = g.standard_normal((Bf, Tf, Cf)).astype(np.float32)
    outs, atts, dq = [], [], []
    for M in (K, F):
        o, a = np.empty((Bf, Tf, Cf), np.float32), np.empty((Bf, NHf, Tf, Tf), np.float32)
        M.attention_forward(o, a, qkv, NHf, causal=False)
        dd = np.zeros((Bf, Tf, 3 * Cf), np.float32)
        M.attention_backward(dd, d, qkv, a, NHf, fresh=True)
        outs.append(o), atts.append(a), dq.append(dd)
    for name, (a, b) in {"out": outs, "att": atts, "dinp": dq}.items():
        err = np.max(np.abs(b - a)) / np.max(np.abs(a))
        assert err <= 1e-5, f"{name}: {err:.3g}"
    causal = np.empty_like(outs[0])
    F.attention_forward(causal, atts[1].copy(), qkv, NHf)  # the default stays causal
    assert not np.allclose(causal, outs[1])


def test_every_output_sees_every_position():
    inp = rand(B, T, 3 * C, seed=1)
    out0, out1, att = np.empty((B, T, C)), np.empty((B, T, C)), np.empty((B, NH, T, T))
    K.attention_forward(out0, att, inp, NH, causal=False)
    changed = inp.copy()
    changed[:, T - 1, C : 3 * C] += 1.0  # the last position's key and value only
    K.attention_forward(out1, att, changed, NH, causal=False)
    assert np.abs(out1 - out0).min() > 0  # the first query sees the last key too
