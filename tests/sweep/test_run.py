"""Sweeps that really launch: a sweep killed mid-way resumes with every point exactly once;
a failing and a timed-out point are recorded while the others complete; the report's
numbers are the JSONL's."""

import csv
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from launch import ROOT, run

from proxies.sweep import results

pytestmark = pytest.mark.mpi  # the sweeps launch their points under mpiexec

# gpt2-tiny, 16 tokens, one timed iteration: about a second a point, launch included.
SWEEP = """
name: {name}
proxy: gpt2
ranks: [1, 2]
precheck: false
timeout: 120
env: {{OMP_NUM_THREADS: 1}}
args:
  layers: 1
  stages: 1
  micro_batches: 1
  model: gpt2-tiny
  seq_len: 16
  iters: 1
  warmup: 0
"""
# Three points: a series over 1 and 2 ranks, and one more.
RESUME = (
    SWEEP
    + """
runs:
  - label: a
  - label: b
    ranks: [1]
    args: {{layers: 2}}
"""
)


def sweep_cmd(path, tmp_path, *extra) -> list[str]:
    return [sys.executable, "-m", "proxies", "sweep", str(path), "--results", str(tmp_path), *extra]


def write(tmp_path, text, name="s.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def lines(jsonl) -> list[dict]:
    return results.load(str(jsonl), warn=False)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Kill the runner's process group (SIGKILL) after its first point is recorded, then
    run the same command again."""
    tmp = tmp_path_factory.mktemp("resume")
    path = write(tmp, RESUME.format(name="resume"))
    jsonl = tmp / "resume" / "results.jsonl"
    cmd = sweep_cmd(path, tmp)
    proc = subprocess.Popen(
        [*cmd, "--no-report"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not (jsonl.exists() and lines(jsonl)):
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "no point finished in 120 s"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    before = lines(jsonl)
    second = run(cmd, timeout=240)
    return tmp, path, jsonl, before, second


def test_killed_sweep_resumes_every_point_once(resumed):
    _, _, jsonl, before, second = resumed
    assert 1 <= len(before) < 3, "the kill did not land mid-sweep"
    assert second.returncode == 0, second.stderr
    assert f"{3 - len(before)} to run, {len(before)} done before" in second.stdout
    recs = lines(jsonl)
    ids = [r["point"]["id"] for r in recs]
    assert len(ids) == 3 and len(set(ids)) == 3
    got = {(r["point"]["label"], r["point"]["ranks"]) for r in recs}
    assert got == {("a", 1), ("a", 2), ("b", 1)}
    assert all(
        r["status"] == "ok" and r["result"]["world_size"] == r["point"]["ranks"] for r in recs
    )
    assert recs[: len(before)] == before  # nothing recorded was rewritten


def test_report_numbers_are_the_jsonl_numbers(resumed):
    tmp, _, jsonl, _, _ = resumed
    r = run([sys.executable, "-m", "proxies", "report", str(tmp / "resume")], timeout=120)
    assert r.returncode == 0, r.stderr
    with open(tmp / "resume" / "report.csv") as f:
        rows = {(x["label"], int(x["ranks"])): x for x in csv.DictReader(f)}
    recs = {(x["point"]["label"], x["point"]["ranks"]): x["result"] for x in lines(jsonl)}
    t = {key: mean(res["iter_time_s"]) for key, res in recs.items()}
    for key, row in rows.items():
        assert float(row["iter_time_s"]) == pytest.approx(t[key], rel=1e-12)
        for c, v in recs[key]["breakdown_s"].items():
            assert float(row[f"breakdown_{c}_s"]) == pytest.approx(mean(v), rel=1e-12)
        assert f"{t[key]:.4f}" in r.stdout  # the table shows the same time
    speedup = t[("a", 1)] / t[("a", 2)]
    assert float(rows[("a", 2)]["speedup"]) == pytest.approx(speedup, rel=1e-12)
    assert float(rows[("a", 2)]["efficiency"]) == pytest.approx(speedup / 2, rel=1e-12)
    assert float(rows[("b", 1)]["speedup"]) == 1.0  # its own series


def test_failed_and_timed_out_points_are_recorded_and_the_rest_run(tmp_path):
    text = SWEEP.format(name="faults").replace("ranks: [1, 2]", "ranks: [1]")
    text += textwrap.dedent(
        """
        runs:
          - label: fails          # 1 rank cannot hold 2 stages: the proxy exits 2
            args: {layers: 2, stages: 2}
          - label: hangs          # GPT-2 124M cannot even start in 3 s here
            timeout: 3
            args: {model: gpt2, seq_len: 1024, iters: 50}
          - label: runs
        """
    )
    path = write(tmp_path, text)
    t0 = time.monotonic()
    r = run(sweep_cmd(path, tmp_path), timeout=240)
    assert r.returncode == 1, r.stdout + r.stderr
    recs = {x["point"]["label"]: x for x in lines(tmp_path / "faults" / "results.jsonl")}
    assert recs["fails"]["status"] == "failed" and recs["fails"]["returncode"] == 2
    assert "world size 1 is not a multiple of STAGES = 2" in recs["fails"]["stderr_tail"]
    assert recs["hangs"]["status"] == "timeout" and recs["hangs"]["returncode"] is None
    assert 3 <= recs["hangs"]["elapsed_s"] < 3 + 10  # SIGTERM, then SIGKILL after 3 s
    assert recs["runs"]["status"] == "ok" and recs["runs"]["result"]["iter_time_s"]
    assert "2 of 3 points failed or timed out" in r.stderr
    assert "failed: fails" in r.stderr and "timeout: hangs" in r.stderr
    assert time.monotonic() - t0 < 120
    # No process of the timed-out point survives it.
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path / "faults" / "tmp") not in ps
