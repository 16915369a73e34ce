"""--fsdp (transformer/fsdp.py) in one process: the proxy's own FSDP plans executed with
emulated collectives (tests/gpt3/test_model.py's emulate) train exactly as the one-process
model at dp 2 and 4, tp 2 x dp 2 and with hybrid sharding; a wrong all-gather spoils the
loss, and so does a missing one; each piece runs with its units gathered; the units give
their pages back; the traffic of one iteration is 3 x the (padded) parameters; the memory
estimate by hand; bad combinations are usage errors. Under MPI: test_fsdp_mpi.py."""

from __future__ import annotations

import numpy as np
import pytest
from core.test_fsdp import resident
from gpt3.test_model import TINY, emulate, reference, small_vocab  # noqa: F401 (autouse)

from proxies.core import fsdp as fsdp_core
from proxies.core.cli import UsageError
from proxies.core.plan import Collective, Compute, Wait
from proxies.gpt2 import proxy as gpt2
from proxies.gpt3 import proxy as gpt3
from proxies.transformer import fsdp
from proxies.transformer.layout import Layout
from proxies.transformer.memory import estimate


def run(world: int, *extra: str, layers: str = "2", m: int = 2):
    return emulate([layers, "1", "--micro-batches", str(m), "--fsdp", *TINY, *extra], world)


@pytest.mark.parametrize(
    "world,extra",
    [(2, ()), (3, ()), (4, ()), (4, ("--tp", "2")), (4, ("--fsdp-shard-size", "2"))],
    ids=["dp2", "dp3-padded", "dp4", "tp2xdp2", "hsdp2x2"],
)
def test_fsdp_trains_as_one_process(world, extra):
    dp = world // (2 if "--tp" in extra else 1)
    got, rts = run(world, *extra)
    want, _ = reference(2, 2 * dp)
    assert got == pytest.approx(want, rel=1e-5)
    shard = 2 if "--fsdp-shard-size" in extra else dp
    assert all(rt.fsdp is not None and rt.fsdp.n == shard for rt in rts)
    # dp 3: the layers (49,984 elements) are padded, gathered into slots and copied out
    assert all(rts[0].fsdp.inplace) == (dp != 3) and bool(rts[0].fsdp.slots) == (dp == 3)


def freed(a: np.ndarray) -> bool:
    """Every element reads as a given-back unit does: zero (its whole pages) or NaN."""
    return bool(((a == 0) | np.isnan(a)).all())


def test_a_wrong_gather_spoils_the_loss(monkeypatch):
    """The runtime's parameters come from the gathers only: rank 1's shard copied in as
    zeros changes the loss; between uses the model's parameters are given back (zeros, NaN
    on the partial pages at the units' ends)."""
    want, _ = reference(2, 4)
    real = fsdp.ShardedParams.buffer

    def scaled(self, name, i):
        buf = real(self, name, i)
        if name.startswith("fsdp_ag") and self.r == 1:
            self._block(buf, i)[...] = 0
        return buf

    monkeypatch.setattr(fsdp.ShardedParams, "buffer", scaled)
    got, rts = run(2)
    assert got[0] != pytest.approx(want[0], rel=1e-5)
    params = rts[0].model.params
    assert freed(params)  # every unit freed after its last use
    for *_, hi in rts[0].fsdp.table:  # the array starts on a page
        assert np.isnan(params[hi - 1]) or hi * 4 % fsdp_core.PAGE == 0


def test_a_missing_gather_spoils_the_loss(monkeypatch):
    """h.0's gathers land elsewhere (as if never issued): its pieces read the given-back
    range, and the loss is not the model's. Without the change the same run matches."""
    want, _ = reference(2, 4)
    real = fsdp.ShardedParams.buffer

    def lost(self, name, i):
        buf = real(self, name, i)
        if name.startswith("fsdp_ag") and self.table[i][0].key == "h.0":
            self.landed.discard(i)
            self.slot_of.pop(i, None)
            self._free(i)
            return buf.copy()
        return buf

    got, _ = run(2)
    assert got == pytest.approx(want, rel=1e-5)
    monkeypatch.setattr(fsdp.ShardedParams, "buffer", lost)
    got, _ = run(2)
    assert not got[0] == pytest.approx(want[0], rel=1e-5)


@pytest.mark.parametrize("m", [1, 2])
def test_units_give_their_pages_back(m):
    """After an iteration the flat parameter and gradient arrays hold no unit's pages: at
    most the two partial pages at each unit's ends stay resident."""
    _, rts = run(2, layers="4", m=m)
    for rt in rts:
        edges = 2 * len(rt.fsdp.table) * fsdp_core.PAGE
        assert rt.model.params.nbytes > 10 * edges
        assert resident(rt.model.params) <= edges
        assert resident(rt.model.grads) <= edges
        assert freed(rt.model.params)


@pytest.mark.parametrize("stages", ["1", "2"])
def test_every_piece_runs_with_its_units_gathered(stages):
    """Walking each rank's plan: a piece naming a unit runs between that unit's unshard and
    reshard, and every unshard follows the Wait of the unit's gather."""
    world = 4 if stages == "2" else 2
    job = gpt3.make_job(gpt3.parser().parse_args(["2", stages, "--fsdp", *TINY]), world)
    S = job.setup
    for rank in range(world):
        live: set[str] = set()
        waited: set[str] = set()
        stage = job.grid.coords(rank)["pp"]
        ch = S.chunks(stage)[0]
        keys = {u.key for u, _, _ in fsdp.shard_units(Layout(S, stage))}
        sides = fsdp.unit_sides(S, keys)
        for op in job.plan(rank).ops:
            if isinstance(op, Compute) and op.name.startswith("fsdp_unshard:"):
                key = op.name.split(":")[1]
                assert any(w.endswith(f":{key}") for w in waited), (rank, key)
                live.add(key)
            elif isinstance(op, Compute) and op.name.startswith("fsdp_reshard:"):
                live.remove(op.name.split(":")[1])
            elif isinstance(op, Compute) and op.name != "optimizer":
                need = set(fsdp._units_of(op.name, ch, sides))
                assert need <= live, (rank, op.name, need - live)
            elif isinstance(op, Wait) and op.req.startswith("fsdp_ag:"):
                waited.add(op.req)
        assert not live


def traffic(plan) -> dict[str, int]:
    out: dict[str, int] = {}
    for op in plan.ops:
        if isinstance(op, Collective):
            out[op.category] = out.get(op.category, 0) + op.count
    return out


@pytest.mark.parametrize("extra", [[], ["--fsdp-shard-size", "2"]])
def test_one_iteration_sends_three_times_the_parameters(extra):
    """m = 1: every unit all-gathered twice (forward, backward) and reduce-scattered once,
    its padded size each time (on the wire each is (n-1)/n of it); HSDP adds the shards'
    allreduce over the replicas."""
    argv = ["2", "1", "--fsdp", "--micro-batches", "1", *TINY, *extra]
    job = gpt3.make_job(gpt3.parser().parse_args(argv), 4)
    S = job.setup
    lay = Layout(S, 0)
    n = S.fsdp
    padded = sum(-(-(hi - lo) // n) * n for _, lo, hi in fsdp.shard_units(lay))
    assert lay.dense_size <= padded < lay.dense_size + 4 * n  # 4 units: at most n-1 each
    got = traffic(job.plan(0))
    assert got["fsdp_allgather"] == 2 * padded
    assert got["fsdp_reduce_scatter"] == padded
    if extra:
        assert n == 2 and got["hsdp_allreduce"] == padded // n
    else:
        assert n == 4 and "hsdp_allreduce" not in got


@pytest.mark.parametrize("m", [1, 2])
def test_memory_estimate_by_hand(m):
    """4 layers at dp 2, hand arithmetic: parameters are the shards (1/2, no unit padded)
    and, gathered at once, the embedding's units (held for a whole pass: the stage's
    embedding and head read them) and three layers (the one in use, the one prefetched,
    the one the model finishes in the next piece); gradients with one micro-batch the
    embedding's and four layers' (two being written, two reduced in place whose blocks are
    saved when their slots are reused), with two every unit's (no_sync); AdamW's moments
    of the shards. The runtime allocates the shards, reduced shards and moments, no slot."""
    _, rts = run(2, layers="4", m=m)
    rt = rts[0]
    est = estimate(rt.S, 0, 0, "real", rt.plan)
    size = {u.key: u.size for u, _, _ in fsdp.shard_units(rt.layout)}
    assert all(v % 2 == 0 for v in size.values())  # no padding: gathered in place
    shards = sum(size.values()) // 2
    embedding, layer = size["wte"] + size["extras"], size["h.0"]
    assert est["parameters"] == 4 * (shards + embedding + 3 * layer)
    assert est["gradients"] == 4 * (shards + embedding + 4 * layer)  # 4 layers: all of them
    assert est["optimizer"] == 2 * 4 * shards
    assert rt.fsdp.nbytes == 4 * 4 * shards and not rt.fsdp.slots and not rt.fsdp.rs_slots


def test_memory_estimate_of_a_deep_stage():
    """8 layers, one micro-batch: still three layers gathered and four layers' unsharded
    gradients at once (not eight); with two micro-batches all eight."""
    argv = ["8", "1", "--fsdp", "--dry-run", *TINY]
    for m, layers in ((1, 4), (2, 8)):
        job = gpt3.make_job(gpt3.parser().parse_args([*argv, "--micro-batches", str(m)]), 2)
        est = estimate(job.setup, 0, 0, "real", job.plan(0))
        size = {u.key: u.size for u, _, _ in fsdp.shard_units(Layout(job.setup, 0))}
        shards, embedding = sum(size.values()) // 2, size["wte"] + size["extras"]
        assert est["parameters"] == 4 * (shards + embedding + 3 * size["h.0"])
        assert est["gradients"] == 4 * (shards + embedding + layers * size["h.0"])


def test_memory_estimate_with_padded_units():
    """dp 3: no unit divides by 3, every one goes through the two gather slots and the two
    reduce-scatter slots (of the largest, wte); a unit's unsharded gradients are given back
    at its reduce-scatter's start, so two layers' at once (the one completing, the next
    being written) besides the embedding's."""
    _, rts = run(3, layers="4", m=1)
    rt = rts[0]
    est = estimate(rt.S, 0, 0, "real", rt.plan)
    units = {u.key: u for u, _, _ in fsdp.shard_units(rt.layout)}
    P = {k: u.padded(3) for k, u in units.items()}
    assert all(P[k] != u.size for k, u in units.items())
    shards = sum(P.values()) // 3
    slot = P["wte"]
    assert est["parameters"] == 4 * (shards + P["wte"] + P["extras"] + 3 * P["h.0"] + 2 * slot)
    grads = units["wte"].size + units["extras"].size + 2 * units["h.0"].size
    assert est["gradients"] == 4 * (grads + shards + 2 * slot)
    assert rt.fsdp.nbytes == 4 * (4 * shards + 4 * slot)


BAD = [
    (gpt3, ["--fsdp-shard-size", "2"], 4, "--fsdp-shard-size 2 needs --fsdp"),
    (gpt3, ["--fsdp"], 1, "--fsdp shards over the data-parallel group, and its degree is 1"),
    (gpt3, ["--fsdp", "--fsdp-shard-size", "3"], 8, "must be at least 2 and divide"),
    (gpt3, ["--fsdp", "--moe-experts", "2"], 2, "with --moe-experts"),
    (gpt3, ["--fsdp", "--cp", "2", "--fsdp-shard-size", "3"], 4, "divide the dp x cp ranks 4"),
    (gpt3, ["--fsdp", "--bucket-mb", "1"], 2, "with --bucket-mb"),
    (gpt2, ["--fsdp", "--zero", "1"], 2, "with --zero 1"),
    (gpt2, ["--fsdp", "--grad-sync", "fused"], 2, "with --grad-sync"),
    (gpt2, ["--fsdp", "--model", "dnn-cpp-proxies"], 2, "with --schedule cpp"),
]


@pytest.mark.parametrize("mod,extra,world,words", BAD, ids=[b[3][:30] for b in BAD])
def test_bad_combinations_are_usage_errors(mod, extra, world, words):
    base = ["2", "1"] + (["--model", "gpt3-tiny"] if mod is gpt3 else [])
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace("+", r"\+")):
        mod.make_job(mod.parser().parse_args([*base, *extra, "--dry-run"]), world)


def test_virtual_stages_refused():
    argv = ["4", "2", "--model", "gpt3-tiny", "--fsdp", "--virtual-stages", "2"]
    with pytest.raises(UsageError, match="--virtual-stages 2"):
        gpt3.make_job(gpt3.parser().parse_args(argv), 4)


def test_replay_calibration_unshards_without_a_gather():
    """--compute replay times the compute ops alone: an unshard with no gather before it
    leaves zeros (finite), not the NaN of a freed unit's ends."""
    _, rts = run(2)
    fs = rts[0].fsdp
    u, lo, hi = fs.table[0]
    fs.compute(f"fsdp_unshard:{u.key}", 0)
    assert not rts[0].model.params[lo:hi].any()
    fs.compute(f"fsdp_reshard:{u.key}", 0)
    assert freed(rts[0].model.params[lo:hi]) and np.isnan(rts[0].model.params[hi - 1])


def test_175b_at_1024_ranks_dry_run_is_valid(capsys):
    """tp 8 x 16 stages x dp 8: planned, validated (matching, no deadlock) in one process;
    each stage sends 2 x 16 all-gathers and one reduce-scatter of every unit."""
    argv = ["96", "16", "--tp", "8", "--micro-batches", "16", "--fsdp"]
    assert gpt3.main([*argv, "--dry-run", "--world-size", "1024"]) == 0
    assert "plan valid" in capsys.readouterr().out
    job = gpt3.make_job(gpt3.parser().parse_args(argv), 1024)
    rank = next(r for r in range(1024) if job.grid.coords(r)["pp"] == 5)
    got = traffic(job.plan(rank))  # a middle stage: 6 layers, no embedding or head
    layer = fsdp.shard_units(Layout(job.setup, 5))[0][0].padded(8)
    assert got["fsdp_allgather"] == 2 * 16 * 6 * layer and got["fsdp_reduce_scatter"] == 6 * layer
