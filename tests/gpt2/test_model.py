"""GPT-2 stages on StageShard (model.gpt2_stage, whole.py): the flat layout is
config.stage_layout's tensor for tensor, whole-model gradients against finite differences,
pipeline splits against the single model, float32 against float64, the kept probabilities
against recomputed logits, init loss, and AdamW training on a fixed batch."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gradcheck import check

from proxies.transformer import fast
from proxies.transformer.config import GPT2Config, backward_pieces, layout_size, stage_layout
from proxies.transformer.model import StageShard, full_model, gpt2_stage

CFG = GPT2Config("t", 2, 16, 2, vocab_size=32, max_seq_len=8)
B, T = 2, 5


def batch(seed: int = 0, V: int = CFG.vocab_size):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))


def whole(dtype=np.float64, **kw) -> StageShard:
    return full_model(CFG, B, T, dtype=dtype, **kw)


def run(stages: list[StageShard], x, y, mb: int = 0, loss_scale: float = 1.0) -> float:
    """Forward through the stages, then backward, handing activations and gradients on as
    the pipeline's messages."""
    h = None
    for s in stages:
        s.batch, s.loss_scale = (lambda _: (x, y)), loss_scale
        if h is not None:
            s.message("act_in", mb, 0)[...] = h
        loss = s.forward(mb)
        h = None if loss is not None else s.io[("act_out", mb, 0)]
    d = None
    for s in reversed(stages):
        if d is not None:
            s.message("grad_out", mb, 0)[...] = d
        s.backward(mb)
        d = None if s.chunks[0].embed else s.message("grad_in", mb, 0)
    return loss


def loss_only(m: StageShard, x, y) -> float:
    m.batch = lambda _: (x, y)
    loss = m.forward(0)
    m.free(0)
    return loss


STAGES = {  # (layers, first, last) of a 3-layer model
    "whole": (range(3), True, True),
    "first": (range(0, 2), True, False),
    "middle": (range(1, 3), False, False),
    "last": (range(2, 3), False, True),
}


@pytest.mark.parametrize("stage", STAGES)
def test_layout_is_stage_layout(stage):
    """Every tensor at config.stage_layout's offset (GPT-2's goldens name its buckets), the
    views into the flat arrays, GPT-2's backward pieces."""
    layers, first, last = STAGES[stage]
    cfg = CFG.with_layers(3)
    m = gpt2_stage(cfg, layers, first, last, B, T)
    want = stage_layout(cfg, layers, first, last)
    assert [(n, tuple(s), o) for n, s, o in m.layout.dense] == want
    assert m.params.size == m.grads.size == layout_size(want)
    for name, shape, _ in want:
        assert m.w[name].shape == shape and np.shares_memory(m.w[name], m.params)
        assert np.shares_memory(m.g[name], m.grads)
    assert m.pieces() == tuple(name for name, _ in backward_pieces(cfg, layers, first, last))
    if first and last:
        assert m.params.size == cfg.num_params


def test_gradients_match_finite_differences():
    m = whole()
    # move away from the init (uniform attention, unit layernorms) so every path carries signal
    m.params += 0.2 * np.random.default_rng(1).standard_normal(m.params.size)
    x, y = batch()
    run([m], x, y)
    rng, eps = np.random.default_rng(2), 1e-5
    for name, _, _ in m.layout.dense:
        p, g = m.w[name].reshape(-1), m.g[name].reshape(-1)
        for i in rng.choice(p.size, size=min(4, p.size), replace=False):
            old = p[i]
            p[i] = old + eps
            fp = loss_only(m, x, y)
            p[i] = old - eps
            fm = loss_only(m, x, y)
            p[i] = old
            check(f"{name}[{i}]", g[i], (fp - fm) / (2 * eps), atol=1e-8, rtol=1e-5)


def test_wte_gradient_at_used_tokens():
    # the sampled entries above may miss the rows the embedding touches: check those too
    m = whole()
    x, y = batch()
    run([m], x, y)
    wte, dwte, eps = m.w["wte"], m.g["wte"], 1e-5
    for tok in np.unique(x)[:4]:
        old = wte[tok, 3]
        wte[tok, 3] = old + eps
        fp = loss_only(m, x, y)
        wte[tok, 3] = old - eps
        fm = loss_only(m, x, y)
        wte[tok, 3] = old
        check(f"wte[{tok}, 3]", dwte[tok, 3], (fp - fm) / (2 * eps), atol=1e-8, rtol=1e-5)


def test_pipeline_split_equals_single_model():
    full = whole()
    split = [(range(0, 1), True, False), (range(1, 2), False, True)]
    stages = [gpt2_stage(CFG, r, f, la, B, T, dtype=np.float64) for r, f, la in split]
    for s in stages:
        for name, _, _ in s.layout.dense:
            check(f"init {name}", s.w[name], full.w[name], atol=0, rtol=0)
    x, y = batch()
    check("loss", run(stages, x, y), run([full], x, y), atol=1e-14)
    # the tied wte: the first stage's embedding gradient plus the last stage's head gradient
    stages[-1].g["wte"] += stages[0].g["wte"]
    for s in stages:
        for name, _, _ in s.layout.dense:
            if name != "wte" or s is stages[-1]:
                check(f"grad {name}", s.g[name], full.g[name], atol=1e-14)


def test_microbatches_in_flight():
    # two micro-batches forwarded before either backward (as in GPipe / 1F1B), backward in
    # reverse order, twice (reusing pooled state, gradients written afresh): the same as one
    # at a time
    x0, y0 = batch(0)
    x1, y1 = batch(1)
    ref = whole()
    losses = [run([ref], x0, y0), run([ref], x1, y1)]
    m = whole()
    m.batch = lambda mb: (x0, y0) if mb == 0 else (x1, y1)
    for _ in range(2):
        m.zero_grad()
        got = [m.forward(0), m.forward(1)]
        m.backward(1)
        m.backward(0)
        check("losses", got, losses, atol=1e-14)
        check("grads", m.grads, ref.grads, atol=1e-14)
    assert not m.saved


def test_loss_scale():
    x, y = batch()
    a, b = whole(), whole()
    check("loss", run([a], x, y, loss_scale=0.25), run([b], x, y), atol=0)
    check("grads", a.grads, 0.25 * b.grads, atol=1e-15)


def test_kept_probabilities_equal_recomputed_logits(monkeypatch):
    """The head keeps its exponentiated logits from the forward when they fit
    fast.DLOGITS_BUDGET (no second logits matmul); without, the backward recomputes them."""
    x, y = batch()
    kept = whole()
    monkeypatch.setattr(fast, "DLOGITS_BUDGET", 0)
    recomputed = whole()
    assert kept.keeps_logits and not recomputed.keeps_logits
    check("loss", run([kept], x, y), run([recomputed], x, y), atol=1e-14)
    check("grads", kept.grads, recomputed.grads, atol=1e-14)


def test_float32_matches_float64():
    x, y = batch()
    m32, m64 = whole(np.float32), whole(np.float64)
    assert m32.params.dtype == np.float32 and m32.grads.dtype == np.float32
    check("params", m32.params, m64.params, atol=0, rtol=1e-7)
    l32, l64 = run([m32], x, y), run([m64], x, y)
    assert isinstance(l32, float)
    check("loss", l32, l64, atol=0, rtol=1e-5)
    check("grads", m32.grads, m64.grads, atol=1e-6, rtol=1e-3)


def test_init_loss_is_log_vocab():
    x, y = batch()
    loss = run([whole(np.float32)], x, y)
    assert abs(loss - math.log(CFG.vocab_size)) < 0.1, loss


def test_adamw_decreases_loss():
    x, y = batch()
    m = whole(np.float32)
    losses = []
    for _ in range(8):
        losses.append(run([m], x, y))
        m.step(lr=1e-2)
    assert m.t == 8
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses


def test_zero1_step_is_the_full_step_on_its_part():
    """ZeRO-1: AdamW on a block of the flat buffer equals the full step there, and leaves
    the rest alone."""
    x, y = batch()
    a, b = whole(), whole()
    run([a], x, y)
    run([b], x, y)
    part = slice(100, 700)
    before = b.params.copy()
    a.step(1e-2, 0.1)
    b.step(1e-2, 0.1, part)
    assert b.m.size == 600
    check("part", b.params[part], a.params[part], atol=0, rtol=0)
    assert np.array_equal(b.params[: part.start], before[: part.start])
    assert np.array_equal(b.params[part.stop :], before[part.stop :])


def test_bad_input():
    with pytest.raises(ValueError, match="max_seq_len"):
        full_model(CFG, B, CFG.max_seq_len + 1)
    with pytest.raises(ValueError, match="layers"):
        gpt2_stage(CFG, range(1, 3), False, True, B, T)
