"""--fsdp (transformer/fsdp.py) in one process: the proxy's own FSDP plans executed with
emulated collectives (tests/gpt3/test_model.py's emulate) train exactly as the one-process
model at dp 2 and 4, tp 2 x dp 2 and with hybrid sharding; a wrong all-gather spoils the
loss; each piece runs with its units gathered; the traffic of one iteration is 3 x the
(padded) parameters; the memory estimate is the runtime's allocation; bad combinations are
usage errors. Under MPI: test_fsdp_mpi.py."""

from __future__ import annotations

import numpy as np
import pytest
from gpt3.test_model import TINY, emulate, reference, small_vocab  # noqa: F401 (autouse)

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
    [(2, ()), (4, ()), (4, ("--tp", "2")), (4, ("--fsdp-shard-size", "2"))],
    ids=["dp2", "dp4", "tp2xdp2", "hsdp2x2"],
)
def test_fsdp_trains_as_one_process(world, extra):
    dp = world // (2 if "--tp" in extra else 1)
    got, rts = run(world, *extra)
    want, _ = reference(2, 2 * dp)
    assert got == pytest.approx(want, rel=1e-5)
    shard = 2 if "--fsdp-shard-size" in extra else dp
    assert all(rt.fsdp is not None and rt.fsdp.n == shard for rt in rts)


def test_a_wrong_gather_spoils_the_loss(monkeypatch):
    """The runtime's parameters come from the gathers only: rank 1's shard copied in as
    zeros changes the loss; between uses the model's parameters are NaN."""
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
    assert np.isnan(rts[0].model.params).all()  # every unit freed after its last use


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
        extras = tuple(k for k in ("wte", "extras") if k in keys)
        for op in job.plan(rank).ops:
            if isinstance(op, Compute) and op.name.startswith("fsdp_unshard:"):
                key = op.name.split(":")[1]
                assert any(w.endswith(f":{key}") for w in waited), (rank, key)
                live.add(key)
            elif isinstance(op, Compute) and op.name.startswith("fsdp_reshard:"):
                live.remove(op.name.split(":")[1])
            elif isinstance(op, Compute) and op.name != "optimizer":
                need = set(fsdp._units_of(op.name, ch, extras))
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


def test_memory_estimate_is_the_runtime_allocation():
    """The estimate's parameters and optimizer are the shards (1/n) and two gather slots;
    its parameter, gradient, optimizer and unshard-target parts add up to what the
    runtime's StageShard and ShardedParams allocate."""
    _, rts = run(2)
    rt = rts[0]
    est = estimate(rt.S, 0, 0, "real", rt.plan)
    lay = rt.layout
    units = [u for u, _, _ in fsdp.shard_units(lay)]
    shards = sum(u.shard(2) for u in units)
    big = max(u.padded(2) for u in units)
    assert est["parameters"] == 4 * (shards + 2 * big)
    assert est["optimizer"] == 2 * 4 * shards
    assert shards * 2 - lay.dense_size < 2 * len(units)  # half of the parameters, padded
    held = rt.model.params.nbytes + rt.model.grads.nbytes + rt.fsdp.nbytes
    parts = ("parameters", "gradients", "optimizer", "unshard_target")
    assert held == sum(est[p] for p in parts)


BAD = [
    (gpt3, ["--fsdp-shard-size", "2"], 4, "--fsdp-shard-size 2 needs --fsdp"),
    (gpt3, ["--fsdp"], 1, "--fsdp shards over the data-parallel group, and its degree is 1"),
    (gpt3, ["--fsdp", "--fsdp-shard-size", "3"], 8, "must be at least 2 and divide"),
    (gpt3, ["--fsdp", "--tp", "2", "--sequence-parallel"], 4, "with --sequence-parallel"),
    (gpt3, ["--fsdp", "--moe-experts", "2"], 2, "with --moe-experts"),
    (gpt3, ["--fsdp", "--cp", "2"], 4, "with --cp > 1"),
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
    leaves zeros (finite), not the NaN of a freed unit."""
    _, rts = run(2)
    fs = rts[0].fsdp
    u, lo, hi = fs.table[0]
    fs.compute(f"fsdp_unshard:{u.key}", 0)
    assert not rts[0].model.params[lo:hi].any()
    fs.compute(f"fsdp_reshard:{u.key}", 0)
    assert np.isnan(rts[0].model.params[lo:hi]).all()


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
