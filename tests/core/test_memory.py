"""Per-rank memory (core/memory.py and each proxy's estimate): measured peak against the
estimate, the up-front refusal and its override, the dry run's report, huge counts."""

import json
import os
import subprocess
import sys

import pytest
from launch import ROOT, mpiexec, mpirun, run

from proxies.core import exits, memory
from proxies.core.cli import UsageError
from proxies.core.schedules import SCHEDULES

# Runs a proxy's main with runner.run wrapped: the resident set when run starts (MPI and
# every import done, nothing of the model built) and the peak after it, beside the estimate.
PROBE = """
import importlib, json, os, resource, sys
from proxies.core import memory, runner
orig = runner.run
def private(pid):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return sum(int(l.split()[1]) * 1024 for l in f if l.startswith("Private_"))
def run(job, args, MPI, machine=None):
    from proxies.core import supervisor
    with open("/proc/self/statm") as f:
        base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    # the fixed cost of a rank: this process's resident set, and what its supervisor holds
    # of its own (the pages they share after the fork counted once)
    fixed = base + (private(os.getppid()) if supervisor.beacon() is not None else 0)
    est = job.memory_estimate(MPI.COMM_WORLD.rank)
    code = orig(job, args, MPI, machine)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {"base": base, "fixed": fixed, "peak": peak, "est": est}
    print("MEMORY " + json.dumps(out), flush=True)
    return code
runner.run = run
importlib.import_module(f"proxies.{sys.argv[1]}.proxy").main(sys.argv[2:])
"""

SHORT = ["--iters", "2", "--warmup", "1", "--quiet"]

# Small real-compute cases whose model dominates the fixed costs (tens to hundreds of MiB).
MEASURED = {
    "gpt2-1f1b": ["gpt2", "4", "1", "4", "--micro-batch", "4"],
    "gpt2-gpipe": ["gpt2", "4", "1", "4", "--micro-batch", "4", "--schedule", "gpipe"],
    "gpt3": ["gpt3", "--model", "gpt3-tiny", "--micro-batch", "4"],
    "cosmoflow": ["cosmoflow", "--shards", "1", "--global-batch", "16"],
    "dlrm": ["dlrm", "--model", "dnn-cpp-proxies"],
}


@pytest.mark.mpi
@pytest.mark.parametrize("case", sorted(MEASURED))
def test_estimate_within_25_percent_of_measured_peak(case):
    cmd = [mpiexec(), "-n", "1", sys.executable, "-c", PROBE, *MEASURED[case], *SHORT]
    r = run(cmd, timeout=120)
    assert r.returncode == exits.OK, r.stderr
    got = json.loads(r.stdout.split("MEMORY ", 1)[1])
    est = got["est"]
    assert est["baseline"] == memory.BASELINE_BYTES
    assert {"parameters", "gradients", "activations"} <= set(est)
    measured = got["peak"] - got["base"]  # what the run allocated beyond the baseline
    estimated = memory.total(est) - est["baseline"]
    assert 0.75 <= measured / estimated <= 1.25, (case, measured >> 20, estimated >> 20, est)
    # the baseline figure itself: before the model, the rank and its supervisor, within 25%
    assert 0.75 <= got["fixed"] / memory.BASELINE_BYTES <= 1.25, got["fixed"] >> 20


@pytest.mark.mpi
def test_impossible_config_is_refused_up_front_with_the_figures():
    # the hardening issue's example: before, a NumPy MemoryError traceback
    r = mpirun(
        2,
        "proxies.gpt2",
        *("--model", "gpt2-xl", "--micro-batch", "64", "--seq-len", "1024", "--compute", "real"),
        timeout=60,
    )
    assert r.returncode == exits.USAGE, r.stderr
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    line = lines[0]
    for words in ("proxies.gpt2: error: --compute real needs about", "GiB per rank",
                  "largest part: activations", "x 2 rank(s) per node", "this node's",
                  "--memory-limit off"):  # fmt: skip
        assert words in line, line


@pytest.mark.mpi
def test_memory_limit_size_refuses_and_off_overrides():
    args = ["gpt2-tiny", "--seq-len", "32", "--iters", "1", "--warmup", "0", "--quiet"]
    r = mpirun(1, "proxies.gpt2", "--model", *args, "--memory-limit", "64MiB", timeout=60)
    assert r.returncode == exits.USAGE
    assert "more than this node's 64.00 MiB (--memory-limit)" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = mpirun(1, "proxies.gpt2", "--model", *args, "--memory-limit", "off", timeout=60)
    assert r.returncode == exits.OK, r.stderr
    r = mpirun(1, "proxies.gpt2", "--model", *args, "--memory-limit", "4 GiB", timeout=60)
    assert r.returncode == exits.OK, r.stderr


@pytest.mark.mpi
def test_gpt3_real_175b_layers_refused():
    r = mpirun(1, "proxies.gpt3", "8", "1", "--compute", "real", timeout=60)
    assert r.returncode == exits.USAGE
    assert "largest part: parameters" in r.stderr or "largest part: optimizer" in r.stderr


HUGE = {
    "iters": (["proxies.gpt2", "--iters", "100000000000000000000"], "--iters"),
    "warmup": (["proxies.dlrm", "--warmup", "2000000"], "--warmup"),
    "world": (["proxies.gpt2", "--dry-run", "--world-size", "100000000"], "--world-size"),
    "world-gpt3": (["proxies.gpt3", "--dry-run", "--world-size", "100000000"], "--world-size"),
    "layers": (["proxies.gpt2", "10000000", "--dry-run"], "LAYERS = 10,000,000"),
    "layers-gpt3": (["proxies.gpt3", "10000000", "--dry-run"], "LAYERS = 10,000,000"),
    "tables": (["proxies.dlrm", "--tables", "10000000", "--dry-run"], "--tables"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(HUGE))
def test_huge_counts_are_refused_fast(case):
    argv, words = HUGE[case]
    r = run([sys.executable, "-m", *argv], timeout=30)
    assert r.returncode == exits.USAGE, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "at most" in lines[0], r.stderr


# -- the dry run -----------------------------------------------------------------------------


def dry(tmp_path, module, *argv) -> tuple[str, dict]:
    out = tmp_path / "dry.json"
    r = run([sys.executable, "-m", module, "--dry-run", *argv, "--json", str(out)], timeout=60)
    assert r.returncode == exits.OK, r.stderr
    return r.stdout, json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    "module,argv",
    [
        ("proxies.gpt2", ["--world-size", "4", "4", "2"]),
        ("proxies.gpt3", ["--world-size", "8", "--tp", "2", "8", "2"]),
        ("proxies.cosmoflow", ["--world-size", "4"]),
        ("proxies.dlrm", ["--world-size", "4"]),
    ],
)
def test_dry_run_prints_and_writes_the_estimate(tmp_path, module, argv):
    text, got = dry(tmp_path, module, *argv)
    assert "memory per rank" in text and "(--compute" in text and "holds" in text
    per = got["memory_bytes"]
    assert per and all(v["baseline"] == memory.BASELINE_BYTES for v in per.values())


@pytest.mark.slow
def test_gpt2_estimate_is_the_hand_arithmetic(tmp_path):
    # 4 layers on 2 stages, 4 micro-batches of 2 x 32, 1f1b: stage 0 keeps 2 in flight,
    # stage 1 one; gpipe keeps all 4 on both
    C, V, T, B, NH, m = 64, 50257, 32, 2, 4, 4
    layer = 12 * C * C + 13 * C
    argv = ["--world-size", "2", "4", "2", str(m), "--seq-len", str(T), "--micro-batch", str(B)]
    _, got = dry(tmp_path, "proxies.gpt2", *argv)
    s0, s1 = got["memory_bytes"].values()
    n0 = V * C + 1024 * C + 2 * layer
    n1 = V * C + 2 * layer + 2 * C
    assert (s0["parameters"], s1["parameters"]) == (4 * n0, 4 * n1)
    assert s0["gradients"] == 4 * n0 and s0["optimizer"] == 8 * n0
    # StageShard's saved state: the chunk input and residual gradient, per layer 16C + 4
    # per token and the softmax; the head's ln_f out, mean, rstd, lse and its kept
    # probabilities and max (N, V + 1)
    per_layer = B * T * 16 * C + 4 * B * T + B * NH * T * T
    first = 4 * (2 * B * T * C + 2 * per_layer)
    last = first + 4 * (B * T * C + 3 * B * T + B * T * (V + 1))
    assert s0["activations"] == 2 * first and s1["activations"] == 1 * last
    # the TP and loss buffers (tp = 1: N C and 3 N), and the pipeline's: stage 0 grad_out,
    # stage 1 act_in and grad_in, one per micro-batch
    fixed = 4 * (B * T * C + 3 * B * T)
    assert s0["buffers"] == fixed + m * 4 * B * T * C
    assert s1["buffers"] == fixed + 2 * m * 4 * B * T * C
    _, got = dry(tmp_path, "proxies.gpt2", *argv, "--schedule", "gpipe")
    g0, g1 = got["memory_bytes"].values()
    assert g0["activations"] == m * first and g1["activations"] == m * last


@pytest.mark.slow
def test_comm_only_modes_hold_no_model(tmp_path):
    _, real = dry(tmp_path, "proxies.gpt2", "--world-size", "2", "4", "2")
    _, none = dry(tmp_path, "proxies.gpt2", "--world-size", "2", "4", "2", "--compute", "none")
    for r, n in zip(real["memory_bytes"].values(), none["memory_bytes"].values(), strict=True):
        assert "activations" in r and "activations" not in n and "parameters" not in n
        # the BufferPool (one replica: no gradient allreduce): the tied embedding's
        # allreduce the largest message, not all the gradients
        assert "gradients" not in n and 4 * 50257 * 64 <= n["buffers"] < r["gradients"]


def test_inflight_counts_the_schedules():
    assert [memory.inflight(SCHEDULES["1f1b"](4, 8, s)) for s in range(4)] == [4, 3, 2, 1]
    assert [memory.inflight(SCHEDULES["gpipe"](4, 8, s)) for s in range(4)] == [8] * 4
    assert memory.inflight(SCHEDULES["1f1b"](4, 2, 0)) == 2  # fewer micro-batches than stages


# -- the node ----------------------------------------------------------------------------


def test_cgroup_limit_reads_v2_and_v1(tmp_path):
    v2, v1 = tmp_path / "memory.max", tmp_path / "limit_in_bytes"
    v2.write_text("max\n")
    v1.write_text("9223372036854771712\n")  # v1's "no limit"
    assert memory.cgroup_limit([str(v2), str(v1)]) == 0
    v2.write_text("8589934592\n")
    assert memory.cgroup_limit([str(v2), str(v1)]) == 8 << 30
    assert memory.cgroup_limit([str(tmp_path / "missing"), str(v2)]) == 8 << 30


def test_ranks_per_node_from_the_launcher(monkeypatch):
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE",
                "PALS_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    assert memory.ranks_per_node(16) == (16, "all ranks on this node")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")
    assert memory.ranks_per_node(16) == (4, "SLURM_NTASKS_PER_NODE")
    monkeypatch.setenv("MPI_LOCALNRANKS", "8")
    assert memory.ranks_per_node(16) == (8, "MPI_LOCALNRANKS")


def test_refusal_names_every_figure(monkeypatch):
    monkeypatch.setenv("MPI_LOCALNRANKS", "3")

    class Args:
        compute, memory_limit = "real", 1 << 30

    est = {"parameters": 300 << 20, "activations": 100 << 20, "baseline": 64 << 20}
    with pytest.raises(UsageError) as e:
        memory.refuse(est, Args, 3)
    text = str(e.value)
    assert "464.00 MiB per rank (largest part: parameters 300.00 MiB) x 3 rank(s)" in text
    assert "= 1.36 GiB, more than this node's 1.00 GiB (--memory-limit)" in text
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")
    memory.refuse(est, Args, 3)  # 928 MiB fit
    Args.memory_limit = "off"
    monkeypatch.setenv("MPI_LOCALNRANKS", "300")
    memory.refuse(est, Args, 300)


@pytest.mark.parametrize(
    "text,want", [("auto", "auto"), ("off", "off"), ("8GiB", 8 << 30), ("512 MB", 512_000_000)]
)
def test_memory_limit_values(text, want):
    assert memory.parse_limit(text) == want


@pytest.mark.slow
def test_memory_limit_bad_value_is_one_line():
    env = {**os.environ}
    r = subprocess.run(
        [sys.executable, "-m", "proxies.cosmoflow", "--memory-limit", "lots"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=30,
    )  # fmt: skip
    assert r.returncode == exits.USAGE
    assert r.stderr.count("\n") == 1 and "--memory-limit" in r.stderr
