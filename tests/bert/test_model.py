"""BERT's encoder (transformer/encoder.py): parameter counts against the published figures,
the masking, the forward against a plain NumPy BERT, the backward against finite
differences, and tensor parallelism (emulated in one process) against one rank."""

from __future__ import annotations

import dataclasses
import math

import lockstep
import numpy as np
import pytest
from gradcheck import numgrad

from proxies.bert.proxy import make_job, parser
from proxies.transformer import fast, head
from proxies.transformer.encoder import (
    BERT_ORDER,
    MASK_ID,
    PRESETS,
    BertConfig,
    BertShard,
    mask_tokens,
    token_types,
)
from proxies.transformer.layout import Layout
from proxies.transformer.setup import Setup

SMALL = BertConfig("t", 2, 16, 2, vocab_size=40, max_seq_len=12)
B, T = 2, 10


@pytest.fixture(params=["post", "pre"])
def cfg(request) -> BertConfig:
    return dataclasses.replace(SMALL, norm=request.param)


def test_parameter_counts_match_the_published_ones():
    # HF BertModel (embeddings, layers, pooler): bert-base-uncased and bert-large-uncased
    assert PRESETS["bert-base"].bert_model_params == 109_482_240
    assert PRESETS["bert-large"].bert_model_params == 335_141_888
    base = PRESETS["bert-base"]
    C, V = 768, 30522
    # the proxy: no pooler; the MLM head (tied decoder); pre-LN's final LayerNorm
    want = 109_482_240 - (C * C + C) + (C * C + C) + 2 * C + V
    assert base.norm == "post" and base.num_params == want == 109_515_834 - 2 * C
    assert dataclasses.replace(base, norm="pre").num_params == want + 2 * C
    assert PRESETS["bert-large"].layer_params == 12_596_224  # the C++ proxy's per layer


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_a_stage_holds_exactly_the_model(norm):
    cfg = dataclasses.replace(PRESETS["bert-tiny"], norm=norm)
    S = setup(cfg, 1, 8, tp=1, vocab=30592)
    lay = Layout(S, 0)
    pad = 30592 - cfg.vocab_size  # padded rows of wte and of the output bias
    assert lay.dense_size == cfg.num_params + pad * (cfg.n_embd + 1)
    names = [n for n, _, _ in lay.dense]
    lnf = ["ln_f.weight", "ln_f.bias"] if norm == "pre" else []
    assert names[: 6 + len(lnf)] == ["wte", "wpe", "tte", "ln_e.weight", "ln_e.bias", *lnf,
                                     "mlm.dense.weight"]  # fmt: skip


def test_masking_is_bert_s():
    rng = np.random.default_rng(0)
    tokens = rng.integers(200, 1000, (64, 40)).astype(np.int32)
    inp, tgt = mask_tokens(tokens, 3, 100, 1000)
    masked = tgt >= 0
    assert (masked.sum(axis=1) == 6).all()  # round(0.15 * 40) per sample
    assert (tgt[masked] == tokens[masked]).all() and (inp[~masked] == tokens[~masked]).all()
    share = np.array([(inp[masked] == MASK_ID).mean(), (inp[masked] == tokens[masked]).mean()])
    assert abs(share[0] - 0.8) < 0.08 and abs(share[1] - 0.1) < 0.06
    # a sample's masking depends only on (seed, its index): any batch cut agrees
    inp2, tgt2 = mask_tokens(tokens[5:9], 3, 105, 1000)
    assert (inp2 == inp[5:9]).all() and (tgt2 == tgt[5:9]).all()


def setup(cfg: BertConfig, B: int, T: int, tp: int = 1, vocab: int | None = None) -> Setup:
    return Setup(
        cfg, B, T, 1, tp, 1, 1, 1, False, vocab or cfg.vocab_size, (range(cfg.n_layer),),
        param_order=BERT_ORDER,
    )  # fmt: skip


def small_model(cfg: BertConfig) -> tuple[BertShard, np.ndarray, np.ndarray]:
    m = BertShard(setup(cfg, B, T), 0, seed=1, dtype=np.float64)
    rng = np.random.default_rng(5)
    for name in ("ln_e.bias", "mlm.bias", "mlm.ln.bias", "mlm.dense.bias"):  # not all zero
        m.w[name][...] = rng.standard_normal(m.w[name].shape) * 0.1
    tokens = rng.integers(0, SMALL.vocab_size, (B, T))
    x, y = mask_tokens(tokens, 0, 0, SMALL.vocab_size)
    m.batch = lambda mb: (x, y)
    return m, x, y


def ln(x, w, b):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * w + b


def gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def plain_bert_loss(w: dict, x: np.ndarray, y: np.ndarray, cfg: BertConfig) -> float:
    """BERT written out: embeddings + LayerNorm, layers with full attention (post-LN, or
    pre-LN and ln_f), the MLM transform, the tied decoder plus bias, cross-entropy on the
    masked tokens."""
    C, NH, (Bx, Tx) = cfg.n_embd, cfg.n_head, x.shape
    post = cfg.norm == "post"
    h = w["wte"][x] + w["wpe"][:Tx] + w["tte"][token_types(Tx)]
    h = ln(h, w["ln_e.weight"], w["ln_e.bias"])
    for l in range(cfg.n_layer):
        p = lambda n, l=l: w[f"h.{l}.{n}"]  # noqa: E731
        a = h if post else ln(h, p("ln_1.weight"), p("ln_1.bias"))
        q, k, v = np.split(a @ p("attn.c_attn.weight").T + p("attn.c_attn.bias"), 3, axis=-1)
        heads = lambda t: t.reshape(Bx, Tx, NH, C // NH).transpose(0, 2, 1, 3)  # noqa: E731
        s = heads(q) @ heads(k).swapaxes(-1, -2) / math.sqrt(C // NH)  # no mask
        s = np.exp(s - s.max(-1, keepdims=True))
        o = ((s / s.sum(-1, keepdims=True)) @ heads(v)).transpose(0, 2, 1, 3).reshape(Bx, Tx, C)
        h = h + o @ p("attn.c_proj.weight").T + p("attn.c_proj.bias")
        if post:
            h = ln(h, p("ln_1.weight"), p("ln_1.bias"))
        a = h if post else ln(h, p("ln_2.weight"), p("ln_2.bias"))
        a = gelu(a @ p("mlp.c_fc.weight").T + p("mlp.c_fc.bias"))
        h = h + a @ p("mlp.c_proj.weight").T + p("mlp.c_proj.bias")
        if post:
            h = ln(h, p("ln_2.weight"), p("ln_2.bias"))
    if not post:
        h = ln(h, w["ln_f.weight"], w["ln_f.bias"])
    h = ln(gelu(h @ w["mlm.dense.weight"].T + w["mlm.dense.bias"]), w["mlm.ln.weight"],
           w["mlm.ln.bias"])  # fmt: skip
    z = h @ w["wte"].T + w["mlm.bias"]
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    m = y >= 0
    return float(
        (lse[m] - np.take_along_axis(z, np.maximum(y, 0)[..., None], -1)[..., 0][m]).mean()
    )


def test_forward_is_a_plain_bert(cfg):
    m, x, y = small_model(cfg)
    assert m.forward(0) == pytest.approx(plain_bert_loss(m.w, x, y, cfg), rel=1e-12)
    assert ("ln_f.weight" in m.w) == (cfg.norm == "pre")


def test_backward_against_finite_differences(cfg):
    m, _, _ = small_model(cfg)
    m.forward(0)
    m.backward(0)
    grads = {n: g.copy() for n, g in m.g.items()}
    rng = np.random.default_rng(2)
    for name, w in m.w.items():  # every tensor, a few entries each
        picks = rng.choice(w.size, size=min(3, w.size), replace=False)
        flat = w.reshape(-1)
        for i in picks:
            probe = np.zeros(1)

            def f(i=i, flat=flat, probe=probe):
                flat[i] = probe[0]
                return m.forward(0)

            probe[0] = flat[i]
            want = numgrad(f, probe)[0]
            flat[i] = probe[0]
            got = grads[name].reshape(-1)[i]
            assert got == pytest.approx(want, rel=1e-5, abs=1e-8), (name, i)
    m.free(0)


def test_loss_ignores_the_unmasked_targets_and_sees_every_position():
    m, x, y = small_model(SMALL)
    base = m.forward(0)
    m.free(0)
    x2 = x.copy()
    last_unmasked = np.flatnonzero(y[0] < 0)[-1]
    first_masked = np.flatnonzero(y[0] >= 0)[0]
    assert first_masked < last_unmasked  # a later token changes an earlier prediction
    x2[0, last_unmasked] = (x2[0, last_unmasked] + 1) % SMALL.vocab_size
    m.batch = lambda mb: (x2, y)
    assert m.forward(0) != base  # bidirectional: a causal model would not see it


def emulate(argv: list[str], world: int, iters: int = 2) -> list[float]:
    """bert's plans in lockstep in this process (lockstep.run): the losses."""
    return lockstep.run(make_job, parser, argv, world, iters)[0]


TINY = ["2", "1", "--model", "bert-tiny", "--seq-len", "16", "--micro-batch", "2", "--lr", "1e-3"]


@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize(
    "extra, world", [(["--tp", "2"], 2), (["--tp", "4"], 4), ([], 2)], ids=["tp2", "tp4", "dp2"]
)
def test_parallel_trains_like_one_rank(extra, world, norm):
    dp = world if not extra else 1
    want = emulate([*TINY, "--norm", norm, "--micro-batches", str(2 * dp)], 1)
    got = emulate([*TINY, "--norm", norm, "--micro-batches", "2", *extra], world)
    assert got == pytest.approx(want, rel=1e-5)
    assert want[1] < want[0]  # it trains


def test_head_without_kept_logits_gives_the_same_gradients(monkeypatch, cfg):
    """Over budget the head recomputes its logits (bias included) in row chunks."""
    m, _, _ = small_model(cfg)
    assert m.keeps_logits
    loss = m.forward(0)
    m.backward(0)
    want = m.grads.copy()
    monkeypatch.setattr(fast, "DLOGITS_BUDGET", 0)
    monkeypatch.setattr(head, "CLASSIFIER_CHUNK", 3 * SMALL.vocab_size)  # 3-row chunks
    m2, _, _ = small_model(cfg)
    assert not m2.keeps_logits
    assert m2.forward(0) == pytest.approx(loss, rel=1e-12)
    m2.backward(0)
    np.testing.assert_allclose(m2.grads, want, rtol=1e-10, atol=1e-14)
