"""What a run prints while it goes (core/live.py): the header before anything else, one line
per iteration on rank 0 with the run's own numbers, nothing under --quiet, and the header
on screen while a run hangs (read line by line, with arrival times, from the launcher)."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from launch import ROOT, launcher_env, mpiexec, mpirun
from rich.console import Console

from proxies.core import live

# One tiny 4-rank run per proxy: 1 warm-up + 2 timed iterations.
RUNS = {
    "gpt2": ["8", "4", "4", "--model", "gpt2-tiny", "--seq-len", "32"],
    "gpt3": ["2", "2", "--model", "gpt3-tiny", "--seq-len", "32", "--micro-batches", "2"],
    "cosmoflow": ["--shards", "2"],
    "dlrm": ["--model", "dlrm-tiny"],
}
SHORT = ["--iters", "2", "--warmup", "1", "--timeout", "120"]
ITERATION = re.compile(
    r"iteration (\d+)/(\d+)( \(warm-up\))?: (\d+\.\d{4}) s \(slowest rank\)( · loss (\S+))?$"
)


def plain() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=200, force_terminal=False, highlight=False), buf


# -- the display, in one process ---------------------------------------------------------


def test_iteration_line_format():
    assert live.iteration_line(0, 2, 7, 0.5231, 10.8022461) == (
        "iteration 1/7 (warm-up): 0.5231 s (slowest rank) · loss 10.802246"
    )
    assert live.iteration_line(2, 2, 7, 0.16504, None) == ("iteration 3/7: 0.1650 s (slowest rank)")
    assert ITERATION.match(live.iteration_line(6, 0, 7, 1.0, 2.5))


def test_mode():
    assert live.mode_for(quiet=True, rank=0, terminal=True) == "off"
    assert live.mode_for(quiet=False, rank=1, terminal=False) == "off"
    assert live.mode_for(quiet=False, rank=0, terminal=False) == "plain"
    assert live.mode_for(quiet=False, rank=0, terminal=True) == "rich"


def test_plain_lines_and_phases():
    out, buf = plain()
    shown = live.Live("plain", warmup=1, iters=1, out=out, slow_s=0.0)
    shown.lines(["header one", "header two"])
    shown.phase("building the model and its buffers")
    deadline = time.monotonic() + 30
    while "building" not in buf.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)  # the phase line comes from a timer thread
    shown.show(0, 0.25, 3.0)
    shown.show(1, 0.125, None)
    shown.close()
    assert buf.getvalue().splitlines() == [
        "header one",
        "header two",
        "building the model and its buffers ...",
        "iteration 1/2 (warm-up): 0.2500 s (slowest rank) · loss 3.000000",
        "iteration 2/2: 0.1250 s (slowest rank)",
    ]


def test_a_quick_phase_leaves_no_line():
    out, buf = plain()
    shown = live.Live("plain", warmup=0, iters=1, out=out, slow_s=3600.0)
    shown.phase("creating the communicators")
    shown.show(0, 0.5, None)  # ends the phase: its timer never fires
    shown.close()
    assert buf.getvalue().splitlines() == ["iteration 1/1: 0.5000 s (slowest rank)"]


def test_off_prints_nothing():
    out, buf = plain()
    shown = live.Live("off", warmup=1, iters=1, out=out, slow_s=0.0)
    shown.lines(["header"])
    shown.phase("building")
    shown.show(0, 0.1, 1.0)
    shown.close()
    time.sleep(0.05)
    assert buf.getvalue() == ""


def test_rich_bar_ends_at_the_last_iteration():
    buf = io.StringIO()
    out = Console(file=buf, width=120, force_terminal=True, color_system=None)
    shown = live.Live("rich", warmup=1, iters=2, out=out)
    shown.lines(["the header"])
    shown.phase("building the model and its buffers")
    for it in range(3):
        shown.show(it, 0.1 * (it + 1), 1.5)
    shown.close()
    text = buf.getvalue()
    assert text.index("the header") < text.index("building the model")
    assert "3/3" in text and "0.3000 s (slowest rank) · loss 1.500000" in text
    assert text.count("the header") == 1


# -- real runs ----------------------------------------------------------------------------


def stamped(n: int, module: str, *args: str, timeout: float, env: dict | None = None):
    """Start `mpiexec -n N python -m MODULE ARGS`; yields (seconds since start, stdout line)
    as each line arrives, then (seconds, None) at the end of stdout. The process group is
    killed when the caller stops reading, or after `timeout` seconds."""
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", module, *args]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **launcher_env(), **(env or {})},
        cwd=ROOT,
        start_new_session=True,
    )
    killer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
    killer.start()
    try:
        for line in proc.stdout:
            yield time.monotonic() - t0, line.rstrip("\n")
        yield time.monotonic() - t0, None
    finally:
        killer.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()


@pytest.mark.mpi
@pytest.mark.parametrize("proxy", sorted(RUNS))
def test_header_then_iterations_then_report(proxy, tmp_path):
    out = tmp_path / "r.json"
    argv = [*RUNS[proxy], *SHORT, "--json", str(out)]
    arrived = list(stamped(4, f"proxies.{proxy}", *argv, timeout=300))
    lines = [line for _, line in arrived if line is not None]
    at = {line: t for t, line in arrived if line is not None}
    end = arrived[-1][0]
    first = f"proxies.{proxy} · "
    assert lines[0].startswith(first), lines[:3]
    assert sum(line.startswith(first) for line in lines) == 1  # the header, once
    runs = [i for i, line in enumerate(lines) if line.startswith("ran on 4 ranks")]
    its = [i for i, line in enumerate(lines) if ITERATION.match(line)]
    summary = [i for i, line in enumerate(lines) if line.startswith("time per iteration")]
    assert len(runs) == 1 and len(its) == 3 and len(summary) == 1  # rank 0 only
    assert runs[0] < its[0] and its == list(range(its[0], its[0] + 3)) and its[-1] < summary[0]
    assert at[lines[0]] <= at[lines[its[0]]] <= end  # arrival order, as read

    # The lines carry the run's own numbers: those of the JSON, which kept its content.
    result = json.loads(out.read_text())
    parsed = [ITERATION.match(lines[i]).groups() for i in its]
    assert [(int(n), int(of), bool(w)) for n, of, w, *_ in parsed] == [
        (1, 3, True),
        (2, 3, False),
        (3, 3, False),
    ]
    assert [float(p[3]) for p in parsed[1:]] == [round(x, 4) for x in result["iter_time_s"]]
    assert [float(p[5]) for p in parsed] == [round(x, 6) for x in result["loss"]]
    assert "loss per iteration" in lines[-1]


@pytest.mark.mpi
def test_quiet_prints_the_summary_line_only():
    r = mpirun(4, "proxies.dlrm", *RUNS["dlrm"], *SHORT, "--quiet", timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("time per iteration: "), lines


@pytest.mark.mpi
def test_header_shows_while_a_run_hangs():
    """Rank 1 stalls in its first pipeline send (test hook): the run never completes an
    iteration, yet the header and the run line arrive, read as they come, while it runs.
    Before core/live.py nothing came until the watchdog ended the job."""
    args = [*RUNS["gpt2"], *SHORT]
    seen = []
    for t, line in stamped(4, "proxies.gpt2", *args, timeout=120, env={"PROXIES_FAULT": "stall:1"}):
        assert line is not None, f"the run ended before its header and run line: {seen}"
        seen.append((t, line))
        if line.startswith("ran on 4 ranks"):
            break  # stops reading: the generator kills the job
    assert seen[0][1].startswith("proxies.gpt2 · ")
    assert not any(ITERATION.match(line) for _, line in seen)
    # For the README's figure (never asserted): seconds from launch to the header.
    print(f"header after {seen[0][0]:.2f} s, run line after {seen[-1][0]:.2f} s")
