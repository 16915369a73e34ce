"""GPT-2 kernels: every backward against centered finite differences in float64.

Each forward is reduced to a scalar with a fake loss (out * dout).sum() for a fixed random
dout; the backward kernels accumulate, so gradient buffers start at 1 and we check 1 + grad.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from gradcheck import check, numgrad, rand

from proxies.transformer import kernels as K

B, T, C, NH, V = 2, 5, 8, 2, 11


def ones_like(x: np.ndarray) -> np.ndarray:
    return np.ones_like(x)


def test_encoder():
    inp = np.array([[1, 3, 3, 0, 10], [3, 1, 7, 7, 7]])  # repeated tokens must add up
    wte, wpe = rand(V, C, seed=1), rand(7, C, seed=2)
    dout = rand(B, T, C, seed=3)
    out = np.empty((B, T, C))

    def loss():
        K.encoder_forward(out, inp, wte, wpe)
        return (out * dout).sum()

    loss()
    check("encoder out", out, wte[inp] + wpe[:T])
    dwte, dwpe = ones_like(wte), ones_like(wpe)
    K.encoder_backward(dwte, dwpe, dout, inp)
    check("dwte", dwte, 1 + numgrad(loss, wte))
    check("dwpe", dwpe, 1 + numgrad(loss, wpe))


def test_layernorm():
    inp, w, b = rand(B, T, C, seed=1), 1 + rand(C, seed=2, scale=0.3), rand(C, seed=3)
    dout = rand(B, T, C, seed=4)
    out, mean, rstd = np.empty((B, T, C)), np.empty((B, T)), np.empty((B, T))

    def loss():
        K.layernorm_forward(out, mean, rstd, inp, w, b)
        return (out * dout).sum()

    loss()
    want = (inp - inp.mean(-1, keepdims=True)) / np.sqrt(inp.var(-1, keepdims=True) + 1e-5)
    check("layernorm out", out, want * w + b)
    dinp, dw, db = ones_like(inp), ones_like(w), ones_like(b)
    K.layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd)
    check("ln dinp", dinp, 1 + numgrad(loss, inp))
    check("ln dweight", dw, 1 + numgrad(loss, w))
    check("ln dbias", db, 1 + numgrad(loss, b))


@pytest.mark.parametrize("with_bias", [True, False])
def test_matmul(with_bias):
    OC = 12
    inp, w = rand(B, T, C, seed=1), rand(OC, C, seed=2)
    bias = rand(OC, seed=3) if with_bias else None
    dout = rand(B, T, OC, seed=4)
    out = np.empty((B, T, OC))

    def loss():
        K.matmul_forward(out, inp, w, bias)
        return (out * dout).sum()

    loss()
    check("matmul out", out, inp @ w.T + (bias if with_bias else 0))
    dinp, dw = ones_like(inp), ones_like(w)
    db = ones_like(bias) if with_bias else None
    K.matmul_backward(dinp, dw, db, dout, inp, w)
    check("matmul dinp", dinp, 1 + numgrad(loss, inp))
    check("matmul dweight", dw, 1 + numgrad(loss, w))
    if with_bias:
        check("matmul dbias", db, 1 + numgrad(loss, bias))


def attention_reference(inp: np.ndarray, NH: int) -> np.ndarray:
    """Loops over batch, head and query position: the plain definition."""
    B, T, C3 = inp.shape
    C = C3 // 3
    hs = C // NH
    out = np.zeros((B, T, C))
    for b in range(B):
        for h in range(NH):
            q, k, v = (inp[b, :, i * C + h * hs : i * C + (h + 1) * hs] for i in range(3))
            for t in range(T):
                s = k[: t + 1] @ q[t] / math.sqrt(hs)
                p = np.exp(s - s.max())
                out[b, t, h * hs : (h + 1) * hs] = (p / p.sum()) @ v[: t + 1]
    return out


def test_attention():
    inp, dout = rand(B, T, 3 * C, seed=1), rand(B, T, C, seed=2)
    out, att = np.empty((B, T, C)), np.empty((B, NH, T, T))

    def loss():
        K.attention_forward(out, att, inp, NH)
        return (out * dout).sum()

    loss()
    check("attention out", out, attention_reference(inp, NH))
    check("att rows sum to 1", att.sum(-1), np.ones((B, NH, T)))
    assert not att[..., np.triu(np.ones((T, T), bool), 1)].any(), "att attends to the future"
    dinp = ones_like(inp)
    K.attention_backward(dinp, dout, inp, att, NH)
    check("attention dinp", dinp, 1 + numgrad(loss, inp))


def test_attention_is_causal():
    inp = rand(B, T, 3 * C, seed=1)
    out0, out1, att = np.empty((B, T, C)), np.empty((B, T, C)), np.empty((B, NH, T, T))
    K.attention_forward(out0, att, inp, NH)
    for t in range(T):
        changed = inp.copy()
        changed[:, t] += 1.0  # q, k and v of position t
        K.attention_forward(out1, att, changed, NH)
        check(f"outputs before {t}", out1[:, :t], out0[:, :t], atol=0, rtol=0)
        assert np.abs(out1[:, t:] - out0[:, t:]).min() > 0


def test_residual():
    a, b, dout = rand(B, T, C, seed=1), rand(B, T, C, seed=2), rand(B, T, C, seed=3)
    out = np.empty((B, T, C))

    def loss():
        K.residual_forward(out, a, b)
        return (out * dout).sum()

    loss()
    check("residual out", out, a + b)
    da, db = ones_like(a), ones_like(b)
    K.residual_backward(da, db, dout)
    check("residual da", da, 1 + numgrad(loss, a))
    check("residual db", db, 1 + numgrad(loss, b))


def test_gelu():
    inp, dout = rand(B, T, 4 * C, seed=1, scale=2.0), rand(B, T, 4 * C, seed=2)
    out = np.empty_like(inp)

    def loss():
        K.gelu_forward(out, inp)
        return (out * dout).sum()

    loss()
    want = 0.5 * inp * (1 + np.tanh(math.sqrt(2 / math.pi) * (inp + 0.044715 * inp**3)))
    check("gelu out", out, want)
    dinp = ones_like(inp)
    K.gelu_backward(dinp, inp, dout)
    check("gelu dinp", dinp, 1 + numgrad(loss, inp))


def classifier_reference(inp, wte, targets) -> float:
    logits = inp.reshape(-1, wte.shape[1]) @ wte.T
    logp = logits - logits.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    return -logp[np.arange(logits.shape[0]), targets.reshape(-1)].mean()


def test_classifier():
    inp, wte = rand(B, T, C, seed=1), rand(V, C, seed=2)
    targets = np.random.default_rng(3).integers(0, V, (B, T))
    lse, dloss = np.empty((B, T)), 0.7

    def loss():
        return dloss * K.classifier_forward(lse, inp, wte, targets)

    check("classifier loss", loss() / dloss, classifier_reference(inp, wte, targets))
    check("lse", lse, np.log(np.exp(inp @ wte.T).sum(-1)))
    dinp, dwte = ones_like(inp), ones_like(wte)
    K.classifier_backward(dinp, dwte, inp, wte, targets, lse, dloss)
    check("classifier dinp", dinp, 1 + numgrad(loss, inp))
    check("classifier dwte", dwte, 1 + numgrad(loss, wte))


def test_classifier_chunked_equals_unchunked():
    inp, wte = rand(B, T, C, seed=1), rand(V, C, seed=2)
    targets = np.random.default_rng(3).integers(0, V, (B, T))
    results = []
    # rows per chunk: all B*T = 10 (one chunk), 3 (four chunks, the last short), 1, 1
    for chunk in (K.CLASSIFIER_CHUNK, 3 * V, V, 1):
        lse = np.empty((B, T))
        loss = K.classifier_forward(lse, inp, wte, targets, chunk=chunk)
        dinp, dwte = np.zeros_like(inp), np.zeros_like(wte)
        K.classifier_backward(dinp, dwte, inp, wte, targets, lse, 1.0, chunk=chunk)
        results.append((loss, lse, dinp, dwte))
    for chunk, got in zip((3 * V, V, 1), results[1:], strict=True):
        for name, g, w in zip(("loss", "lse", "dinp", "dwte"), got, results[0], strict=True):
            check(f"chunk {chunk} {name}", g, w, atol=1e-13, rtol=1e-12)


def test_classifier_float32():
    inp, wte = rand(B, T, C, seed=1), rand(V, C, seed=2)
    targets = np.random.default_rng(3).integers(0, V, (B, T))
    lse = np.empty((B, T), np.float32)
    loss32 = K.classifier_forward(lse, inp.astype(np.float32), wte.astype(np.float32), targets)
    check("float32 loss", loss32, classifier_reference(inp, wte, targets), atol=1e-5)


def test_adamw():
    n, lr, b1, b2, eps = 50, 1e-2, 0.9, 0.999, 1e-8
    for wd in (0.0, 0.1):
        p, m, v = rand(n, seed=1), np.zeros(n), np.zeros(n)
        rp, rm, rv = p.copy(), m.copy(), v.copy()
        for t in range(1, 4):
            g = rand(n, seed=10 + t)
            K.adamw_update(p, g, m, v, t, lr, weight_decay=wd)
            rm = b1 * rm + (1 - b1) * g
            rv = b2 * rv + (1 - b2) * g * g
            mhat, vhat = rm / (1 - b1**t), rv / (1 - b2**t)
            rp = rp - lr * (mhat / (np.sqrt(vhat) + eps) + wd * rp)
            check(f"adamw wd={wd} step {t} m", m, rm, atol=1e-15)
            check(f"adamw wd={wd} step {t} v", v, rv, atol=1e-15)
            check(f"adamw wd={wd} step {t} params", p, rp, atol=1e-14)


def test_classifier_saved_dlogits():
    """The forward's kept dlogits give the recomputing backward's gradients."""
    inp, wte = rand(B, T, C, seed=1), rand(V, C, seed=2)
    targets = np.random.default_rng(3).integers(0, V, (B, T))
    lse, dl = np.empty((B, T)), np.empty((B * T, V))
    want = K.classifier_forward(lse, inp, wte, targets)
    check("loss with dlogits", K.classifier_forward(lse, inp, wte, targets, dl, 0.7), want)
    dinp, dwte = ones_like(inp), ones_like(wte)
    K.classifier_backward_saved(dinp, dwte, inp, wte, dl)
    rinp, rwte = ones_like(inp), ones_like(wte)
    K.classifier_backward(rinp, rwte, inp, wte, targets, lse, 0.7)
    check("saved dinp", dinp, rinp)
    check("saved dwte", dwte, rwte)


@pytest.mark.parametrize("mod", ["kernels", "fast"])
def test_fresh_writes_equal_zero_then_add(mod):
    """fresh=True (dinp_fresh=True) writes what accumulating into zeros gives, whatever the
    buffer held: both kernel modules, the same calls (no NaN survives)."""
    from proxies.transformer import fast

    M = {"kernels": K, "fast": fast}[mod]
    x, dout = rand(B, T, C, seed=1), rand(B, T, C, seed=2)
    w, b = 1 + rand(C, seed=3, scale=0.3), rand(C, seed=4)
    mean, rstd = np.empty((B, T)), np.empty((B, T))
    M.layernorm_forward(np.empty((B, T, C)), mean, rstd, x, w, b)
    W = rand(3 * C, C, seed=5)
    qkv, att = rand(B, T, 3 * C, seed=6), np.empty((B, NH, T, T))
    M.attention_forward(np.empty((B, T, C)), att, qkv, NH)
    tokens = np.random.default_rng(7).integers(0, V, (B, T))
    targets = np.random.default_rng(8).integers(0, V, (B, T))
    wte, lse = rand(V, C, seed=9), np.empty((B, T))
    M.classifier_forward(lse, x, wte, targets)
    calls = {  # name: (fn(outs, fresh), shapes of the written outputs)
        "layernorm": (
            lambda o, f: M.layernorm_backward(np.zeros((B, T, C)), *o, dout, x, w, mean, rstd, f),
            [(C,), (C,)],
        ),
        "matmul": (
            lambda o, f: M.matmul_backward(*o, rand(B, T, 3 * C, seed=10), x, W, f, f),
            [(B, T, C), (3 * C, C), (3 * C,)],
        ),
        "gelu": (lambda o, f: M.gelu_backward(*o, x, dout, fresh=f), [(B, T, C)]),
        "attention": (
            lambda o, f: M.attention_backward(*o, dout, qkv, att, NH, fresh=f),
            [(B, T, 3 * C)],
        ),
        "encoder": (
            lambda o, f: M.encoder_backward(*o, dout, tokens, fresh=f),
            [(V, C), (T + 2, C)],
        ),
        "classifier": (
            lambda o, f: M.classifier_backward(
                *o, x, wte, targets, lse, 0.5, dinp_fresh=f, fresh=f
            ),
            [(B, T, C), (V, C)],
        ),
    }
    for name, (fn, shapes) in calls.items():
        want = [np.zeros(s) for s in shapes]
        fn(want, False)
        got = [np.full(s, np.nan) for s in shapes]
        fn(got, True)
        for i, (g, wv) in enumerate(zip(got, want, strict=True)):
            check(f"{name} fresh output {i}", g, wv, atol=1e-12, rtol=1e-10)
