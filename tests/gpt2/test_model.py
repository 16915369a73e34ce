"""StageModel: whole-model gradients against finite differences, pipeline splits against the
single model, float32 against float64, init loss, and AdamW training on a fixed batch."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gradcheck import check

from proxies.transformer.config import GPT2Config
from proxies.transformer.stage_model import StageModel

CFG = GPT2Config("t", 2, 16, 2, vocab_size=32, max_seq_len=8)
B, T = 2, 5


def batch(seed: int = 0, V: int = CFG.vocab_size):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))


def run(stages: list[StageModel], x, y, mb: int = 0, loss_scale: float = 1.0) -> float:
    """Forward through the stages, then backward, handing activations and gradients on."""
    for s in stages[:-1]:
        x = s.forward(mb, x)
    loss = stages[-1].forward(mb, x, y, loss_scale)
    d = None
    for s in reversed(stages):
        d = s.backward(mb, d)
    return loss


def test_layout():
    m = StageModel(CFG, range(2), True, True, B, T)
    assert m.num_params == m.params.size == CFG.num_params
    assert m.layout[0][0] == "wte" and m.wte_slice == slice(0, CFG.vocab_size * CFG.n_embd)
    offset = 0
    for name, shape, o in m.layout:
        assert o == offset, name
        assert np.shares_memory(m.views[name], m.params) and m.views[name].shape == shape
        assert np.shares_memory(m.grad_views[name], m.grads)
        offset += math.prod(shape)
    assert len([n for n, _, _ in m.layout if n.startswith("h.1.")]) == 12
    middle = StageModel(CFG, range(1, 2), False, False, B, T)
    assert middle.num_params == CFG.layer_params and middle.wte_slice is None


def test_gradients_match_finite_differences():
    m = StageModel(CFG, range(2), True, True, B, T, dtype=np.float64)
    # move away from the init (uniform attention, unit layernorms) so every path carries signal
    m.params += 0.2 * np.random.default_rng(1).standard_normal(m.params.size)
    x, y = batch()
    run([m], x, y)
    rng, eps = np.random.default_rng(2), 1e-5
    for name, _, _ in m.layout:
        p, g = m.views[name].reshape(-1), m.grad_views[name].reshape(-1)
        for i in rng.choice(p.size, size=min(4, p.size), replace=False):
            old = p[i]
            p[i] = old + eps
            fp = m.forward(0, x, y)
            m.free(0)
            p[i] = old - eps
            fm = m.forward(0, x, y)
            m.free(0)
            p[i] = old
            check(f"{name}[{i}]", g[i], (fp - fm) / (2 * eps), atol=1e-8, rtol=1e-5)


def test_wte_gradient_at_used_tokens():
    # the sampled entries above may miss the rows the encoder touches: check those too
    m = StageModel(CFG, range(2), True, True, B, T, dtype=np.float64)
    x, y = batch()
    run([m], x, y)
    wte, dwte, eps = m.views["wte"], m.grad_views["wte"], 1e-5
    for tok in np.unique(x)[:4]:
        old = wte[tok, 3]
        wte[tok, 3] = old + eps
        fp = m.forward(0, x, y)
        m.free(0)
        wte[tok, 3] = old - eps
        fm = m.forward(0, x, y)
        m.free(0)
        wte[tok, 3] = old
        check(f"wte[{tok}, 3]", dwte[tok, 3], (fp - fm) / (2 * eps), atol=1e-8, rtol=1e-5)


@pytest.mark.parametrize(
    "split",
    [
        [(range(0, 1), True, False), (range(1, 2), False, True)],
        [(range(0, 0), True, False), (range(0, 2), False, False), (range(2, 2), False, True)],
    ],
    ids=["2 stages", "embeddings, layers, head"],
)
def test_pipeline_split_equals_single_model(split):
    full = StageModel(CFG, range(2), True, True, B, T, dtype=np.float64)
    stages = [StageModel(CFG, r, f, la, B, T, dtype=np.float64) for r, f, la in split]
    for s in stages:
        for name, _, _ in s.layout:
            check(f"init {name}", s.views[name], full.views[name], atol=0, rtol=0)
    x, y = batch()
    check("loss", run(stages, x, y), run([full], x, y), atol=1e-14)
    # the tied wte: the first stage's embedding gradient plus the last stage's head gradient
    stages[-1].grads[stages[-1].wte_slice] += stages[0].grads[stages[0].wte_slice]
    for s in stages:
        for name, _, _ in s.layout:
            if name != "wte" or s is stages[-1]:
                check(f"grad {name}", s.grad_views[name], full.grad_views[name], atol=1e-14)
    check("flops", sum(s.flops_forward() for s in stages), full.flops_forward(), atol=0)


def test_microbatches_in_flight():
    # two micro-batches forwarded before either backward (as in GPipe / 1F1B), backward in
    # reverse order, twice (reusing pooled buffers): the same as one at a time
    x0, y0 = batch(0)
    x1, y1 = batch(1)
    ref = StageModel(CFG, range(2), True, True, B, T, dtype=np.float64)
    losses = [run([ref], x0, y0), run([ref], x1, y1)]
    m = StageModel(CFG, range(2), True, True, B, T, dtype=np.float64)
    for _ in range(2):
        m.zero_grad()
        got = [m.forward(0, x0, y0), m.forward(1, x1, y1)]
        assert m.backward(1) is None and m.backward(0) is None
        check("losses", got, losses, atol=1e-14)
        check("grads", m.grads, ref.grads, atol=1e-14)
    with pytest.raises(ValueError, match="in flight"):
        m.forward(0, x0, y0)
        m.forward(0, x0, y0)


def test_loss_scale():
    x, y = batch()
    a = StageModel(CFG, range(2), True, True, B, T, dtype=np.float64)
    b = StageModel(CFG, range(2), True, True, B, T, dtype=np.float64)
    check("loss", run([a], x, y, loss_scale=0.25), run([b], x, y), atol=0)
    check("grads", a.grads, 0.25 * b.grads, atol=1e-15)


def test_float32_matches_float64():
    x, y = batch()
    m32 = StageModel(CFG, range(2), True, True, B, T, dtype=np.float32)
    m64 = StageModel(CFG, range(2), True, True, B, T, dtype=np.float64)
    assert m32.params.dtype == np.float32 and m32.grads.dtype == np.float32
    check("params", m32.params, m64.params, atol=0, rtol=1e-7)
    l32, l64 = run([m32], x, y), run([m64], x, y)
    assert isinstance(l32, float)
    check("loss", l32, l64, atol=0, rtol=1e-5)
    check("grads", m32.grads, m64.grads, atol=1e-6, rtol=1e-3)


def test_init_loss_is_log_vocab():
    x, y = batch()
    loss = run([StageModel(CFG, range(2), True, True, B, T)], x, y)
    assert abs(loss - math.log(CFG.vocab_size)) < 0.1, loss


def test_adamw_decreases_loss():
    x, y = batch()
    m = StageModel(CFG, range(2), True, True, B, T)
    losses = []
    for _ in range(8):
        m.zero_grad()
        losses.append(run([m], x, y))
        m.step(lr=1e-2)
    assert m.t == 8
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses


def test_bad_input():
    m = StageModel(CFG, range(2), True, True, B, T)
    x, y = batch()
    with pytest.raises(ValueError, match="tokens"):
        m.forward(0, x[:, :3], y)
    with pytest.raises(ValueError, match="targets"):
        m.forward(1, x)
    with pytest.raises(ValueError, match="max_seq_len"):
        StageModel(CFG, range(2), True, True, B, CFG.max_seq_len + 1)
    with pytest.raises(ValueError, match="layers"):
        StageModel(CFG, range(1, 3), False, True, B, T)
