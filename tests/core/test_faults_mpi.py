"""Faults on purpose in real runs (2 and 4 ranks, a few seconds each): a slowed stage's delay
becomes idle on the others, a straggler is named as the peer waited for, a slow link's holds
are fault_delay, jitter sleeps its seeded samples, a killed rank ends the job.

Timings are never compared with fixed numbers. What is asserted holds by construction: a
sleep never ends early (lower bounds), a rank slowed 4x computes more than twice as long as
its replica, categories add up, and the seconds waited for peers add up to idle.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from launch import mpirun

from proxies.core import exits, faults
from proxies.core.plan import Compute

pytestmark = pytest.mark.mpi  # every test here starts MPI

HIDDEN = "_hidden"
# test_breakdown's 4 identical stages (GPT-3 layers only), sleeps of FLOPs at 1 TFLOP/s.
GPT3 = ["4", "4", "--model", "gpt3-medium", "--layers-only", "--seq-len", "256"]
GPT3 += ["--micro-batches", "4", "--compute", "model", "--device-tflops", "1"]
SHORT = ["--iters", "2", "--warmup", "1", "--timeout", "60"]


def run(tmp_path, ranks: int, module: str, *args: str, name: str = "r") -> dict:
    out = tmp_path / f"{name}.json"
    r = mpirun(ranks, module, *args, *SHORT, "--quiet", "--json", str(out), timeout=120)
    assert r.returncode == exits.OK, r.stderr
    return json.loads(out.read_text())


def per_rank(result: dict, category: str) -> np.ndarray:
    return np.array(result["breakdown_per_rank_s"].get(category, [0.0] * result["world_size"]))


def assert_adds_up(result: dict) -> None:
    """Categories add up to the iteration, and what was waited for to idle, on every rank."""
    per = result["breakdown_per_rank_s"]
    sums = np.sum([v for c, v in per.items() if not c.endswith(HIDDEN)], axis=0)
    assert sums == pytest.approx([np.mean(result["iter_time_s"])] * len(sums), rel=0.01)
    waited = [sum(w.values()) for w in result["waited_for"]]
    assert waited == pytest.approx(per["idle"], rel=1e-6, abs=1e-9)


def model_compute(module, argv: list[str], world: int, rank: int, rate: float) -> list[float]:
    """The model-mode seconds of each compute op of `rank`, from the proxy's own plan."""
    args = module.parser().parse_args(argv)
    plan = module.make_job(args, world).plan(rank)
    return [op.model_seconds(rate) for op in plan.ops if isinstance(op, Compute)]


def test_slowed_stage_delay_is_idle_on_the_other_stages(tmp_path):
    from proxies.gpt3 import proxy as gpt3

    base = run(tmp_path, 4, "proxies.gpt3", *GPT3, name="base")
    slow = run(tmp_path, 4, "proxies.gpt3", *GPT3, "--slow-rank", "1:3", name="slow")
    assert slow["config"]["faults"]["slow_rank"] == {"1": 3.0}
    assert "faults" not in base["config"]
    for r in (base, slow):
        assert_adds_up(r)
    # The slowed stage slept 3x its modelled compute (a sleep never ends early); the others
    # computed what they did before.
    ops = model_compute(gpt3, GPT3, 4, 1, 1e12)
    added = per_rank(slow, "compute")[1] - per_rank(base, "compute")[1]
    assert per_rank(slow, "compute")[1] >= 3 * sum(ops)
    assert added > 1.5 * sum(ops)
    # Its delay is idle on every other stage (a 1F1B pipeline runs at its slowest stage).
    grew = per_rank(slow, "idle") - per_rank(base, "idle")
    for r in (0, 2, 3):
        assert grew[r] > 0.25 * added, (r, grew, added)
    assert grew[1] < min(grew[0], grew[2], grew[3])
    # Stage 0 talks only to stage 1 and finishes last: all its idle is waiting for rank 1.
    assert set(slow["waited_for"][0]) == {"1"}


@pytest.mark.parametrize(
    "compute",
    [
        ["--compute", "model", "--device-tflops", "0.1"],
        ["--compute", "replay"],
        ["--compute", "real"],
    ],
    ids=["model", "replay", "real"],
)
def test_a_straggler_is_the_peer_waited_for(tmp_path, compute):
    """Two data-parallel replicas: rank 1 computes 4x as long, rank 0 waits for it in the
    gradient allreduce, and its idle is attributed to rank 1."""
    args = ["1", "1", "2", "--seq-len", "16", *compute]
    if compute[1] == "model":
        args[0] = "4"
    result = run(tmp_path, 2, "proxies.gpt2", *args, "--slow-rank", "1:4")
    assert_adds_up(result)
    c = per_rank(result, "compute")
    assert c[1] > 2.5 * c[0]  # 4x the same kernels (or sleeps) as its replica
    idle = per_rank(result, "idle")
    assert idle[0] > 0.5 * (c[1] - c[0])
    assert result["waited_for"][0]["1"] == pytest.approx(idle[0], rel=1e-6)
    assert idle[1] < 0.1 * idle[0]
    if compute[1] == "real":  # a fault changes when, never what: the same losses
        clean = run(tmp_path, 2, "proxies.gpt2", *args, name="clean")
        assert result["loss"] == clean["loss"]


def test_slow_link_holds_are_fault_delay(tmp_path):
    args = ["4", "2", "4", "--compute", "none"]
    base = run(tmp_path, 2, "proxies.gpt2", *args, name="base")
    slow = run(tmp_path, 2, "proxies.gpt2", *args, "--slow-link", "0-1:200", name="slow")
    assert "fault_delay" not in base["breakdown_s"]
    assert_adds_up(slow)
    delay = per_rank(slow, "fault_delay")
    assert (delay > 0).all()  # both receive over the link: activations, then gradients
    # The hold is 199x the transfer, so it dwarfs the pipeline traffic itself.
    assert (delay > per_rank(slow, "pp")).all()


def test_jitter_sleeps_its_seeded_samples(tmp_path):
    from proxies.gpt2 import proxy as gpt2

    argv = ["4", "2", "4", "--compute", "model", "--device-tflops", "1"]
    result = run(tmp_path, 2, "proxies.gpt2", *argv, "--jitter", "exp:5ms", "--seed", "3")
    assert result["config"]["faults"]["jitter"] == "exp:5ms"
    assert_adds_up(result)
    jitter = faults.parse_jitter("exp:5ms")
    for rank in (0, 1):
        ops = model_compute(gpt2, argv, 2, rank, 1e12)
        # The run's timed iterations (1 and 2 after 1 warm-up) draw from (seed, rank, it).
        owed = []
        for it in (1, 2):
            rf = faults.Faults(jitter=jitter, seed=3).for_rank(rank)
            rf.start_iteration(it, kill=False)
            owed.append(sum(rf.seconds(s) for s in ops))
        assert np.mean(owed) > sum(ops) + 0.01  # the samples add something
        assert per_rank(result, "compute")[rank] >= np.mean(owed) * 0.999


@pytest.mark.parametrize("iteration", ["0", "2"])  # in warm-up, and the last timed one
def test_kill_rank_ends_the_job_with_its_line(iteration):
    timeout = 10
    t0 = time.monotonic()
    r = mpirun(
        2,
        "proxies.gpt2",
        *["4", "2", "--compute", "none", "--iters", "2", "--warmup", "1"],
        *["--timeout", str(timeout), "--kill-rank", f"1@{iteration}"],
        timeout=timeout + 5,
    )
    assert time.monotonic() - t0 < timeout + 5
    # The rank's own line, then its supervisor's diagnosis naming it, and the job's status.
    assert r.returncode == exits.RANK_DIED, r.stderr
    line = f"proxies.gpt2: rank 1: killed on purpose by --kill-rank at iteration {iteration}"
    assert line in r.stderr, r.stderr
    assert "proxies.gpt2: rank 1 (pid" in r.stderr and "died: killed by SIGKILL" in r.stderr
    assert "time per iteration" not in r.stdout
