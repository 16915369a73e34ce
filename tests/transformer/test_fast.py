"""The fast GPT-2 kernels (fast.py) against the reference ones (kernels.py) in float32.

The reference kernels are checked against finite differences (test_kernels.py); here
every fast kernel must agree with its reference to 1e-5 relative (of the largest value),
with blocks small enough that every kernel really runs in several blocks on two threads.
Layernorm is blocked row-wise without changing any per-row result: bit for bit.
AdamW keeps its moments scaled and folds its bias corrections into two scalars: equal
to the last bits.
"""

from __future__ import annotations

import numpy as np
import pytest

from proxies.transformer import fast as F
from proxies.transformer import kernels as K

B, T, C, NH, V = 3, 16, 32, 4, 101
RTOL = 1e-5


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setenv("PROXIES_KERNEL_THREADS", "2")
    monkeypatch.setattr(F, "BLOCK", 96)  # several blocks of a few rows each
    monkeypatch.setattr(F, "ADAMW_BLOCK", 96)
    monkeypatch.setattr(F, "DW_ELEMS", 3 * C)  # dW through 3-row temporaries


def r(*shape: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    x = np.random.default_rng([seed, *shape]).standard_normal(shape) * scale
    return x.astype(np.float32)


def close(name: str, got, want, exact: bool = False) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, name
    if exact:
        assert np.array_equal(got, want), f"{name}: not bit for bit"
        return
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)
    assert err <= RTOL, f"{name}: relative error {err:.3g} > {RTOL}"


def both(fn, *arrays):
    """Run fn(kernel module, *copies) for both modules; return their (possibly written) copies."""
    out = []
    for mod in (K, F):
        copies = [a.copy() for a in arrays]
        ret = fn(mod, *copies)
        out.append((ret, copies))
    return out


def test_gelu():
    x, d = r(B, T, 4 * C, seed=1), r(B, T, 4 * C, seed=2)
    x[0, 0, :4] = (-12.0, 12.0, 0.0, -0.0)  # tanh saturated both ways, and zero
    (_, a), (_, b) = both(lambda M, o, x: M.gelu_forward(o, x), np.empty_like(x), x)
    close("gelu", b[0], a[0])
    (_, a), (_, b) = both(lambda M, g, x, d: M.gelu_backward(g, x, d), r(*x.shape, seed=3), x, d)
    close("dgelu (added)", b[0], a[0])
    fresh = np.full_like(x, np.nan)
    F.gelu_backward(fresh, x, d, fresh=True)
    want = np.zeros_like(x)
    K.gelu_backward(want, x, d)
    close("dgelu (written)", fresh, want)


def test_layernorm():
    x, w, bias, d = r(B, T, C, seed=1), r(C, seed=2), r(C, seed=3), r(B, T, C, seed=4)
    mean, rstd = np.empty((B, T), np.float32), np.empty((B, T), np.float32)
    (_, a), (_, b) = both(
        lambda M, o, mu, rs: M.layernorm_forward(o, mu, rs, x, w, bias),
        np.empty_like(x),
        mean,
        rstd,
    )
    for name, got, want in zip(("out", "mean", "rstd"), b, a, strict=True):
        close(f"layernorm {name}", got, want, exact=True)
    mean, rstd = a[1], a[2]
    (_, a), (_, b) = both(
        lambda M, dx, dw, db: M.layernorm_backward(dx, dw, db, d, x, w, mean, rstd),
        r(B, T, C, seed=5),
        r(C, seed=6),
        r(C, seed=7),
    )
    close("layernorm dinp", b[0], a[0], exact=True)
    close("layernorm dweight", b[1], a[1])
    close("layernorm dbias", b[2], a[2])


@pytest.mark.parametrize("bias", [True, False])
def test_matmul_backward(bias):
    inp, w, d = r(B, T, C, seed=1), r(4 * C, C, seed=2), r(B, T, 4 * C, seed=3)
    (_, a), (_, b) = both(
        lambda M, dx, dw, db: M.matmul_backward(dx, dw, db if bias else None, d, inp, w),
        r(B, T, C, seed=4),
        r(4 * C, C, seed=5),
        r(4 * C, seed=6),
    )
    for name, got, want in zip(("dinp", "dweight", "dbias"), b, a, strict=True):
        close(f"matmul {name}", got, want)


def test_attention():
    qkv, d = r(B, T, 3 * C, seed=1), r(B, T, C, seed=2)
    att = np.empty((B, NH, T, T), np.float32)
    (_, a), (_, b) = both(
        lambda M, o, att: M.attention_forward(o, att, qkv, NH), np.empty((B, T, C), np.float32), att
    )
    close("attention out", b[0], a[0])
    close("attention att", b[1], a[1])
    (_, a), (_, b) = both(
        lambda M, dq: M.attention_backward(dq, d, qkv, a[1], NH), r(B, T, 3 * C, seed=3)
    )
    close("attention dinp", b[0], a[0])


@pytest.mark.parametrize("chunk", [V * 5, K.CLASSIFIER_CHUNK])  # 5-row chunks, or one chunk
def test_classifier(chunk):
    x, wte = r(B, T, C, seed=1), r(V, C, seed=2, scale=0.3)
    targets = np.random.default_rng(3).integers(0, V, (B, T))
    scale = 0.37
    lse_ref, lse = np.empty((B, T), np.float32), np.empty((B, T), np.float32)
    loss_ref = K.classifier_forward(lse_ref, x, wte, targets, chunk=chunk)
    loss = F.classifier_forward(lse, x, wte, targets, chunk=chunk)
    assert abs(loss - loss_ref) <= RTOL * abs(loss_ref)
    close("lse", lse, lse_ref)
    # recomputing backward
    (_, a), (_, b) = both(
        lambda M, dx, dw: M.classifier_backward(dx, dw, x, wte, targets, lse_ref, scale, chunk),
        r(B, T, C, seed=4),
        r(V, C, seed=5),
    )
    close("classifier dinp", b[0], a[0])
    close("classifier dwte", b[1], a[1])
    # dlogits left by the forward, then the saved backward
    dlogits = np.empty((B * T, V), np.float32)
    loss2 = F.classifier_forward(lse, x, wte, targets, dlogits, scale, chunk)
    assert abs(loss2 - loss_ref) <= RTOL * abs(loss_ref)  # one matmul, not chunks: rounding
    dx, dw = r(B, T, C, seed=4), r(V, C, seed=5)
    F.classifier_backward_saved(dx, dw, x, wte, dlogits)
    close("classifier dinp (saved dlogits)", dx, a[0])
    close("classifier dwte (saved dlogits)", dw, a[1])


def test_adamw():
    """fast keeps the moments scaled (m / (1-b1), v / (1-b2)): the same step from the same
    state, and the same state after it once unscaled."""
    n = 1000
    b1, b2 = 0.9, 0.999
    p, g, m, v = r(n, seed=1), r(n, seed=2), r(n, seed=3, scale=0.1), r(n, seed=4) ** 2
    for t in (1, 7):
        want = [a.copy() for a in (p, g, m, v)]
        K.adamw_update(*want, t, 1e-3, weight_decay=0.1)
        got = [p.copy(), g.copy(), m / np.float32(1 - b1), v / np.float32(1 - b2)]
        F.adamw_update(*got, t, 1e-3, weight_decay=0.1)
        got[2] *= np.float32(1 - b1)
        got[3] *= np.float32(1 - b2)
        for name, a, b in zip("pgmv", got, want, strict=True):
            close(f"adamw {name} (t={t})", a, b, exact=name == "g")


def test_parallel_covers_every_index_once(monkeypatch):
    seen = np.zeros(1000, int)

    def mark(lo, hi):
        seen[lo:hi] += 1

    F.blocked(mark, 1000, 7)
    assert (seen == 1).all()
    F.parallel(mark, 1000, grain=1)
    assert (seen == 2).all()
    F.parallel(mark, 0)  # nothing to do: still one call, on an empty range
    assert (seen == 2).all()


@pytest.mark.parametrize("first,last", [(True, True), (False, True), (True, False)])
def test_stage_shard_fast_equals_plain(first, last, monkeypatch):
    """Two iterations of two micro-batches forward and backward, then AdamW: a GPT-2 stage
    on fast kernels (probabilities kept by the forward, gradients written by the first
    backward after a step instead of zeroed and added to) against one on the reference
    kernels, which take the same calls. Before the second iteration both stages' gradients
    are NaN: every one of them must be written, none added to."""
    monkeypatch.setattr(F, "BLOCK", 1 << 12)  # still many blocks over the 3.4M parameters
    monkeypatch.setattr(F, "ADAMW_BLOCK", 1 << 12)
    monkeypatch.setattr(F, "DW_ELEMS", 1 << 16)  # and over wte's 50257 rows
    from proxies.transformer.config import PRESETS
    from proxies.transformer.model import gpt2_stage

    cfg = PRESETS["gpt2-tiny"].with_layers(3)
    Bm, Tm = 2, 24
    models = {
        k: gpt2_stage(cfg, range(3), first, last, Bm, Tm, seed=3, kernels=mod)
        for k, mod in (("plain", K), ("fast", F))
    }
    assert models["fast"].keeps_logits == last
    outs = {k: [] for k in models}
    for it in range(2):
        for k, model in models.items():
            rng = np.random.default_rng([7, it])
            got = outs[k]
            model.loss_scale = 0.5
            for mb in range(2):
                x = rng.integers(0, cfg.vocab_size, (Bm, Tm))
                if not first:
                    h = rng.standard_normal((Bm, Tm, cfg.n_embd)).astype(np.float32)
                    model.message("act_in", mb, 0)[...] = h
                y = rng.integers(0, cfg.vocab_size, (Bm, Tm))
                model.batch = lambda _, x=x, y=y: (x, y)
                out = model.forward(mb)
                got.append(np.copy(out if last else model.io[("act_out", mb, 0)]))
            for mb in range(2):
                dout = rng.standard_normal((Bm, Tm, cfg.n_embd)).astype(np.float32)
                if not last:
                    model.message("grad_out", mb, 0)[...] = dout
                model.backward(mb)
                got.append(np.zeros(1) if first else model.message("grad_in", mb, 0).copy())
            got.append(model.grads.copy())
        # AdamW turns rounding noise in a gradient that is 0 in exact arithmetic (the key
        # bias: softmax ignores a shift of the scores) into a full +-lr step, so both models
        # step from the same gradients (the optimizer is tested on its own above).
        models["fast"].grads[...] = models["plain"].grads
        for k, model in models.items():
            model.step(1e-3, 0.1)
            outs[k].append(model.params.copy())
        for model in models.values():  # no zeroing pass on either kernels: all written
            model.grads.fill(np.nan)
    for i, (a, b) in enumerate(zip(outs["plain"], outs["fast"], strict=True)):
        close(f"output {i}", np.asarray(b, np.float32), np.asarray(a, np.float32))
