"""LLaMA's real compute without MPI: the one-process model against an independent NumPy
forward and finite differences (float64), then the proxy's own plans run in lockstep in
this process (every collective emulated) against the one-process losses: tp 2 with and
without sequence parallelism, dp x tp, Mixtral's experts over tp and ep."""

from __future__ import annotations

import lockstep
import numpy as np
import pytest

from proxies.llama.proxy import make_job, parser
from proxies.transformer.data import Synthetic, batch
from proxies.transformer.layout import shard
from proxies.transformer.llama_model import LlamaShard

T = 16
TINY = ["--model", "llama-tiny", "--seq-len", str(T), "--compute", "real", "--lr", "1e-3"]
MIXTRAL = ["--model", "mixtral-tiny", "--seq-len", str(T), "--compute", "real", "--lr", "1e-3"]


def emulate(argv: list[str], world: int, iters: int = 2, stop_at_optimizer: bool = False):
    """llama's plans in lockstep in this process (lockstep.run): (losses, runtimes)."""
    return lockstep.run(make_job, parser, argv, world, iters, stop_at_optimizer)


def one_process(L: int, m: int, model: list[str] = TINY, **kw):
    return emulate([str(L), "1", "--micro-batches", str(m), *model], 1, **kw)


# ----------------------------------------------------------------------------------------
# the one-process model is LLaMA


def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w


def rotate(x: np.ndarray, theta: float) -> np.ndarray:
    """x (T, heads, hs): Meta's rotary embedding as complex pairs."""
    Tn, _, hs = x.shape
    z = x[..., 0::2] + 1j * x[..., 1::2]
    z = z * np.exp(1j * np.arange(Tn)[:, None, None] * theta ** (-np.arange(0, hs, 2) / hs))
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def numpy_loss(model: LlamaShard, tokens: np.ndarray, targets: np.ndarray) -> float:
    """The LLaMA forward written plainly (k, v heads repeated), from the shard's weights."""
    cfg, w = model.S.cfg, model.w
    C, NH, KVH = cfg.n_embd, cfg.n_head, cfg.kv_heads
    hs, F = C // NH, cfg.ffn_dim
    x = w["wte"][tokens[0]].astype(np.float64)  # (T, C), one sample
    Tn = x.shape[0]
    for l in range(cfg.n_layer):
        p = f"h.{l}."
        h = rms(x, w[p + "ln_1.weight"])
        qkv = h @ w[p + "attn.c_attn.weight"].T
        q = rotate(qkv[:, :C].reshape(Tn, NH, hs), cfg.rope_theta)
        k = rotate(qkv[:, C : C + KVH * hs].reshape(Tn, KVH, hs), cfg.rope_theta)
        v = qkv[:, C + KVH * hs :].reshape(Tn, KVH, hs)
        k, v = np.repeat(k, NH // KVH, axis=1), np.repeat(v, NH // KVH, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hs)
        s[:, np.triu(np.ones((Tn, Tn), bool), 1)] = -np.inf
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        y = np.einsum("hts,shd->thd", a, v).reshape(Tn, C)
        x = x + y @ w[p + "attn.c_proj.weight"].T
        gu = rms(x, w[p + "ln_2.weight"]) @ w[p + "mlp.c_fc.weight"].T
        g, u = gu[:, :F], gu[:, F:]
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.c_proj.weight"].T
    logits = rms(x, w["ln_f.weight"]) @ w["lm_head"][: cfg.vocab_size].T
    mx = logits.max(-1, keepdims=True)
    lse = mx[:, 0] + np.log(np.exp(logits - mx).sum(-1))
    return float((lse - logits[np.arange(Tn), targets[0]]).mean())


def float64_model(L: int = 2) -> tuple[LlamaShard, np.ndarray, np.ndarray]:
    job = make_job(parser().parse_args([str(L), "1", "--micro-batches", "1", *TINY]), 1)
    model = LlamaShard(job.setup, 0, dtype=np.float64)
    x, y = batch(Synthetic(0, job.setup.cfg.vocab_size, T), 0, 1)
    model.batch = lambda _: (x, y)
    return model, x, y


def test_one_process_forward_is_llama():
    model, x, y = float64_model()
    loss = model.forward(0)
    model.free(0)
    assert loss == pytest.approx(numpy_loss(model, x, y), rel=1e-12)


def test_one_process_gradients_match_finite_differences():
    model, _, _ = float64_model()
    model.forward(0)
    model.backward(0)
    grads = {n: model.g[n].copy() for n, _, _ in model.layout.dense}
    rng = np.random.default_rng(0)

    def loss() -> float:
        out = model.forward(0)
        model.free(0)
        return out

    eps = 1e-6
    for name in ("wte", "h.0.ln_1.weight", "h.0.attn.c_attn.weight", "h.1.attn.c_proj.weight",
                 "h.0.ln_2.weight", "h.1.mlp.c_fc.weight", "h.0.mlp.c_proj.weight",
                 "ln_f.weight", "lm_head"):  # fmt: skip
        w, g = model.w[name].reshape(-1), grads[name].reshape(-1)
        # entries with a gradient (wte: rows of tokens in the sample)
        idx = rng.choice(np.flatnonzero(g), 4, replace=False)
        for i in idx:
            old = w[i]
            w[i] = old + eps
            up = loss()
            w[i] = old - eps
            down = loss()
            w[i] = old
            assert g[i] == pytest.approx((up - down) / (2 * eps), rel=1e-5, abs=1e-9), name


# ----------------------------------------------------------------------------------------
# sharded plans, one process


@pytest.fixture(scope="module")
def ref():
    return one_process(4, 4)


@pytest.mark.parametrize("sp", [False, True], ids=["", "sp"])
def test_tp2_trains_like_one_process(ref, sp):
    extra = ["--sequence-parallel"] if sp else []
    got, _ = emulate(["4", "1", "--micro-batches", "4", "--tp", "2", *TINY, *extra], 2)
    assert got == pytest.approx(ref[0], rel=1e-5)
    assert got[1] < got[0]


def test_dp2_tp2_trains_like_one_process():
    want, _ = one_process(4, 8)
    got, _ = emulate(["4", "1", "--micro-batches", "4", "--tp", "2", *TINY], 4)
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("sp", [False, True], ids=["", "sp"])
def test_tp2_gradient_shards_equal_one_process(sp):
    _, (one,) = one_process(4, 4, stop_at_optimizer=True)
    extra = ["--sequence-parallel"] if sp else []
    argv = ["4", "1", "--micro-batches", "4", "--tp", "2", *TINY, *extra]
    _, rts = emulate(argv, 2, stop_at_optimizer=True)
    want = one.model
    parts = {"attn.c_attn.weight": (64, 32, 32), "mlp.c_fc.weight": (160, 160)}
    scale = float(np.abs(want.grads).max())
    for r, rt in enumerate(rts):
        got = rt.model
        for name, _, _ in got.layout.dense:
            if name in ("wte", "lm_head"):
                w = want.g[name][got.lo : got.lo + got.valid]
                g = got.g[name][: got.valid]
            elif name.startswith("h."):
                w = shard(name, want.g[name], 2, r, parts.get(name.split(".", 2)[2]))
                g = got.g[name]
            else:
                w, g = want.g[name], got.g[name]
            np.testing.assert_allclose(g, w, rtol=1e-3, atol=2e-5 * scale, err_msg=name)


@pytest.mark.parametrize(
    "world,extra",
    [
        (2, ["--tp", "2", "--micro-batches", "4"]),  # SwiGLU experts sharded over tp
        (4, ["--tp", "2", "--micro-batches", "2"]),  # tp 2 x ep 2: 2 experts per rank
        (2, ["--micro-batches", "2", "--ep", "2"]),  # ep 2
        (4, ["--tp", "2", "--micro-batches", "2", "--sequence-parallel"]),
    ],
    ids=["tp2", "tp2-ep2", "ep2", "tp2-ep2-sp"],
)
def test_mixtral_experts_train_like_one_process(world, extra):
    # capacity factor 4: no token dropped, so routing does not depend on the split
    moe = ["--capacity-factor", "4"]
    want, _ = emulate(["2", "1", "--micro-batches", "4", *MIXTRAL, *moe], 1)
    got, rts = emulate(["2", "1", *MIXTRAL, *moe, *extra], world)
    assert rts[0].S.moe.experts == 4 and rts[0].S.moe.top_k == 2
    assert got == pytest.approx(want, rel=1e-5)
    assert got[1] < got[0]
