"""GPT-3's tensor-parallel shards (no MPI): the proxy's own plans executed in one process,
every collective emulated with NumPy, against the unsharded GPT-2 model (same init, same
data): losses and gradients agree for tp = 1, 2, 4, with and without sequence parallelism;
MoE layouts (tp, ep, dp) agree with one process, and MoE gradients with finite differences.

gpt3-tiny runs here with a 1,000-token vocabulary instead of GPT-2's 50,257 (the `small_vocab`
fixture): at d_model 64 the tied LM head is 94% of the arithmetic with the real vocabulary,
and these tests check the sharding, not the vocabulary's size. 1,000 keeps what the real one
exercises: Megatron's padding (to 1,024 for tp 1, 2, 4), a last vocabulary shard with fewer
valid rows than the others (1000 - 3 * 256 = 232 of 256 at tp 4), the kept-probabilities
head (N * V / tp fits DLOGITS_BUDGET either way), and the same 1e-5 tolerances."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import lockstep
import numpy as np
import pytest
from lockstep import emulate_collective
from one_process import train

from proxies.core.plan import Collective
from proxies.gpt3.proxy import make_job, parser
from proxies.transformer.layout import Layout, shard
from proxies.transformer.model import StageShard
from proxies.transformer.plan import Piece, Pieces
from proxies.transformer.setup import PRESETS, GPT3Config, MoESpec, Setup, padded_vocab

T = 32
TINY = ["--model", "gpt3-tiny", "--seq-len", str(T), "--compute", "real", "--lr", "1e-3"]
VOCAB = 1000


@pytest.fixture(scope="module", autouse=True)
def small_vocab() -> Iterator[None]:
    """gpt3-tiny with VOCAB tokens for every test of this module (the module docstring says
    why that proves the same), for the sharded runs and the one-process reference alike."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(
            PRESETS, "gpt3-tiny", dataclasses.replace(PRESETS["gpt3-tiny"], vocab_size=VOCAB)
        )
        yield


def emulate(argv: list[str], world: int, iters: int = 2, stop_at_optimizer: bool = False):
    """gpt3's plans in lockstep in this process (lockstep.run): (losses, runtimes)."""
    return lockstep.run(make_job, parser, argv, world, iters, stop_at_optimizer)


def reference(L: int, m: int, iters: int = 2, lr: float = 1e-3, stop_at_optimizer=False):
    """The unsharded GPT-2 model (one process) on the same samples: m micro-batches per
    iteration."""
    cfg = PRESETS["gpt3-tiny"].with_layers(L).to_gpt2()
    return train(cfg, T, m, iters, lr, stop_at_optimizer)


@pytest.fixture(scope="module")
def ref():
    return reference(4, 4)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["", "sp"])
def test_sharded_training_equals_unsharded(ref, tp, sp):
    extra = ["--sequence-parallel"] if sp else []
    got, rts = emulate(["4", "1", "--micro-batches", "4", "--tp", str(tp), *TINY, *extra], tp)
    # the small vocabulary still pads, and leaves the last shard short (module docstring)
    assert rts[0].S.vocab == 1024 and rts[-1].model.valid == VOCAB - (tp - 1) * 1024 // tp
    assert got == pytest.approx(ref[0], rel=1e-5)
    assert got[1] < got[0]


def test_data_parallel_and_tensor_parallel_equal_unsharded():
    want, _ = reference(4, 8)
    got, _ = emulate(["4", "1", "--micro-batches", "4", "--tp", "2", *TINY], 4)
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("tp,sp", [(2, False), (4, True)])
def test_gradient_shards_equal_unsharded_gradients(tp, sp):
    _, model = reference(4, 4, stop_at_optimizer=True)
    extra = ["--sequence-parallel"] if sp else []
    argv = ["4", "1", "--micro-batches", "4", "--tp", str(tp), *TINY, *extra]
    _, rts = emulate(argv, tp, stop_at_optimizer=True)
    want = model.g
    for r, rt in enumerate(rts):
        shard_model = rt.model
        got = shard_model.g
        scale = max(float(np.abs(model.grads).max()), 1e-12)
        for name, _, _ in shard_model.layout.dense:
            if name == "wte":
                w = want["wte"][shard_model.lo : shard_model.lo + shard_model.valid]
                g = got["wte"][: shard_model.valid]
            elif name.startswith("h."):
                w = shard(name, want[name], tp, r)
                g = got[name]
            else:
                w, g = want[name], got[name]
            np.testing.assert_allclose(g, w, rtol=1e-3, atol=2e-5 * scale, err_msg=name)


MOE = ["2", "1", *TINY, "--moe-experts", "4", "--capacity-factor", "1.0"]


def test_moe_layouts_train_like_one_process():
    want, _ = emulate([*MOE, "--micro-batches", "4"], 1)
    for world, extra in [
        (2, ["--tp", "2", "--micro-batches", "4"]),  # experts sharded over TP
        (4, ["--tp", "2", "--micro-batches", "2"]),  # tp 2 x ep 2: 2 experts per rank
        (4, ["--micro-batches", "1", "--ep", "2"]),  # ep 2 x expert-data 2
    ]:
        got, rts = emulate([*MOE, *extra], world)
        assert got == pytest.approx(want, rel=1e-5), extra


def test_moe_gradients_match_finite_differences():
    cfg = GPT3Config("t", 2, 16, 2, vocab_size=40, max_seq_len=8)
    S = Setup(
        cfg,
        2,
        6,
        1,
        1,
        1,
        1,
        1,
        False,
        padded_vocab(40, 1, 8),
        (range(2),),
        moe=MoESpec(4, 2, 1.0, 24, 1),  # capacity 6 of 24 choices: some drop,
    )
    model = StageShard(S, 0, dtype=np.float64)
    rng = np.random.default_rng(3)
    model.params += 0.2 * rng.standard_normal(model.params.size) * (model.params != 0)
    model.eparams += 0.3 * rng.standard_normal(model.eparams.size)
    tokens, targets = rng.integers(0, 40, (2, 6)), rng.integers(0, 40, (2, 6))
    model.batch = lambda mb: (tokens, targets)
    tmpl, ch = Pieces(S), S.chunks(0)[0]

    def forward() -> float:
        pieces = [it.name for it in tmpl.forward(ch) if isinstance(it, Piece)]
        return [model.compute(name, 0, 0) for name in pieces][-1]  # fwd_loss is last

    forward()
    for it in tmpl.backward(ch):
        if isinstance(it, Piece):
            model.compute(it.name, 0, 0)
    lay = Layout(S, 0)
    picks = [
        ("dense", o + i) for n, s, o in lay.dense for i in (0, 7) if "gate" in n or "c_attn" in n
    ]
    picks += [("expert", o + i) for n, s, o in lay.expert for i in (0, 5, 33)]
    eps = 1e-6
    for which, i in picks:
        p, g = (model.params, model.grads) if which == "dense" else (model.eparams, model.egrads)
        old = p[i]
        p[i] = old + eps
        up = forward()
        p[i] = old - eps
        down = forward()
        p[i] = old
        fd = (up - down) / (2 * eps)
        assert abs(g[i] - fd) <= 1e-6 + 1e-4 * abs(fd), (which, i, g[i], fd)


# Sequence parallelism with MoE. Capacity factor E / k = 2 makes every expert's capacity
# ceil(2 * 2 * Ns / 4) = Ns, all of a rank's tokens: nothing drops, so routing each sequence
# shard apart (Megatron's drop-and-pad counts the rank's own tokens) is the same function as
# routing the whole sequence, and every layout must give the one-process losses.
MOE_DROPLESS = ["2", "1", *TINY, "--moe-experts", "4", "--capacity-factor", "2.0"]
SP = ["--sequence-parallel"]


@pytest.mark.parametrize(
    "world,extra",
    [
        (2, ["--tp", "2", "--micro-batches", "4"]),  # experts TP-sharded, tokens gathered
        (4, ["--tp", "4", "--micro-batches", "4"]),
        (4, ["--tp", "2", "--micro-batches", "2", "--ep", "1"]),  # expert-data parallel 2
        (4, ["--tp", "2", "--micro-batches", "2", "--ep", "2"]),  # A2A(ep) + AG/RS(tp)
    ],
    ids=["tp2", "tp4", "tp2-edp2", "tp2-ep2"],
)
def test_moe_sequence_parallel_trains_like_one_process(world, extra):
    want, _ = emulate([*MOE_DROPLESS, "--micro-batches", "4"], 1)
    got, rts = emulate([*MOE_DROPLESS, *extra, *SP], world)
    assert rts[0].S.sp and rts[0].model.moe_all.size == rts[0].S.tp * rts[0].model.moe_buf.size
    assert got == pytest.approx(want, rel=1e-5)
    assert got[1] < got[0]


def test_sequence_parallel_saves_only_sequence_shards():
    # Megatron keeps the sequence shard of a column-parallel input and gathers it again in
    # backward: no saved (B, T, C) tensor per layer, only (B, T/tp, C) ones.
    argv = ["2", "1", "--micro-batches", "1", "--tp", "2", *TINY, *SP]
    for extra in ([], ["--moe-experts", "4"]):
        job = make_job(parser().parse_args([*argv, *extra]), 2)
        model = job.runtime(0, None, None, "real").model
        st = model._state(0, 0)
        C = model.S.cfg.n_embd
        for a in st.layers.values():
            shapes = {k: v.shape for k, v in vars(a).items() if isinstance(v, np.ndarray)}
            assert all(s != (1, T, C) for s in shapes.values()), shapes
            assert shapes["ln1"] == shapes["ln2"] == (1, T // 2, C)
        assert st.lnf.shape == (1, T // 2, C) and not hasattr(st, "lnf_full")


def _lockstep(S: Setup, models: list, items: list) -> float | None:
    """Run template items on the TP ranks of one stage (ep = dp = 1), collectives emulated."""
    loss = None
    for it in items:
        if isinstance(it, Piece):
            for m in models:
                out = m.compute(it.name, 0, 0)
            loss = out if out is not None else loss
        else:
            kind, group, buf, count = it.kind, it.group, it.buf, it.count
            assert group == "tp", it
            names = {"tp": "tp_buf", "ce": "ce_buf", "moe_tp": "moe_all", "sp_grads": "sp_buf"}
            emulate_collective(
                Collective(kind, group, buf, count), [getattr(m, names[buf]) for m in models]
            )
    return loss


def test_moe_sequence_parallel_gradients_match_finite_differences():
    # tp 2, sequence parallel, capacity 3 of each shard's 12 choices: tokens drop per shard.
    cfg = GPT3Config("t", 2, 16, 2, vocab_size=40, max_seq_len=8)
    S = Setup(
        cfg, 2, 6, 1, 2, 1, 1, 1, True, padded_vocab(40, 2, 8), (range(2),),
        moe=MoESpec(4, 2, 1.0, 24, 1),
    )  # fmt: skip
    assert S.Ns == 6 and S.moe.capacity(S.Ns) == 3
    models = [StageShard(S, 0, r, dtype=np.float64) for r in range(2)]
    rng = np.random.default_rng(5)
    dense = 0.2 * rng.standard_normal(models[0].params.size) * (models[0].params != 0)
    for m in models:  # replicated tensors stay equal on both ranks, shards differ
        m.params += dense
        m.eparams += 0.3 * rng.standard_normal(m.eparams.size)
    tokens, targets = rng.integers(0, 40, (2, 6)), rng.integers(0, 40, (2, 6))
    for m in models:
        m.batch = lambda mb: (tokens, targets)
    tmpl, ch = Pieces(S), S.chunks(0)[0]

    def forward() -> float:
        return _lockstep(S, models, tmpl.forward(ch))

    forward()
    _lockstep(S, models, tmpl.backward(ch))
    lay = Layout(S, 0)
    eps = 1e-6
    # replicated tensors (the router, layernorms): gradient = sum over the shards' partials
    for n, _, o in lay.dense:
        if not ("gate" in n or "ln_2" in n or "c_attn" in n):
            continue
        for i in (0, 5):
            sharded = "c_attn" in n  # column-parallel: each rank its own rows
            ranks = [[0], [1]] if sharded else [[0, 1]]
            for group in ranks:
                want = sum(models[r].grads[o + i] for r in group)
                fd = _fd(forward, [models[r].params for r in group], o + i, eps)
                assert abs(want - fd) <= 1e-6 + 1e-4 * abs(fd), (n, i, group, want, fd)
    for n, _, o in lay.expert:  # TP-sharded experts: each rank its slice
        for r in (0, 1):
            for i in (0, 7, 40):
                fd = _fd(forward, [models[r].eparams], o + i, eps)
                got = models[r].egrads[o + i]
                assert abs(got - fd) <= 1e-6 + 1e-4 * abs(fd), (n, r, i, got, fd)


def _fd(f, arrays: list[np.ndarray], i: int, eps: float) -> float:
    """Central difference of f in element i of every array at once (a replicated tensor)."""
    old = arrays[0][i]
    for a in arrays:
        a[i] = old + eps
    up = f()
    for a in arrays:
        a[i] = old - eps
    down = f()
    for a in arrays:
        a[i] = old
    return (up - down) / (2 * eps)


@pytest.mark.parametrize(
    "argv,world",
    [
        (["4", "1", "--micro-batches", "2", *TINY], 1),
        (["4", "1", "--micro-batches", "2", "--tp", "2", *TINY, *SP], 2),
        ([*MOE, "--micro-batches", "2", "--tp", "2"], 2),
    ],
    ids=["tp1", "tp2-sp", "moe-tp2"],
)
def test_gradients_are_written_afresh_each_iteration(monkeypatch, argv, world):
    """No zeroing pass: after the optimizer step every gradient is junk (NaN here), and the
    next iteration's backward must write each one before anything adds to it."""
    want, _ = emulate(argv, world, iters=3)
    step = StageShard.step

    def poisoned(self, *args, **kwargs):
        step(self, *args, **kwargs)
        self.grads.fill(np.nan)
        self.egrads.fill(np.nan)

    monkeypatch.setattr(StageShard, "step", poisoned)
    got, _ = emulate(argv, world, iters=3)
    assert got == pytest.approx(want, rel=1e-6)
    assert np.isfinite(got).all()
