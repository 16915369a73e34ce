"""--trace without MPI: the predicted timeline (--dry-run --machine) against the prediction's
own breakdown, the trace's format, the options' refusals, the PNG of python -m proxies
timeline. The measured timeline under mpiexec is tests/core/test_trace_mpi.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from proxies.core import cli, prediction, trace, trace_predicted
from proxies.core.machine import load
from proxies.core.schedules import Action, one_f_one_b
from proxies.gpt2 import proxy as gpt2

MACHINE = "configs/machines/dgx-a100.yaml"
GPT2 = ["8", "4", "4", "--model", "gpt2-tiny", "--seq-len", "32", "--compute", "model"]
GPT2 += ["--device-tflops", "0.01"]  # compute of milliseconds: the nanosecond rounding is noise

# What the Trace Event Format requires of each phase this package writes (Chrome's "Trace
# Event Format" document; Perfetto's JSON importer reads the same): every event has ph,
# pid and tid; X has ts and dur; b/e and s/f carry an id; M names a process or thread.
REQUIRED = {
    "X": {"name", "cat", "ts", "dur", "pid", "tid"},
    "M": {"name", "pid", "args"},
    "b": {"name", "cat", "id", "ts", "pid"},
    "e": {"name", "cat", "id", "ts", "pid"},
    "s": {"name", "cat", "id", "ts", "pid", "tid"},
    "f": {"name", "cat", "id", "ts", "pid", "tid", "bp"},
}


def check_format(doc: dict) -> None:
    """The schema facts the viewers rely on, and flows paired one "s" to one "f"."""
    json.loads(json.dumps(doc))  # plain JSON: no NaN, no tuples-as-keys
    assert isinstance(doc["traceEvents"], list) and doc["displayTimeUnit"] in ("ms", "ns")
    flows: dict[int, list[str]] = {}
    for ev in doc["traceEvents"]:
        assert REQUIRED[ev["ph"]] <= set(ev), ev
        if ev["ph"] == "X":
            assert ev["dur"] >= 0 and ev["args"]["category"] == ev["cat"]
        if ev["ph"] == "M":
            assert ev["name"] in (
                "process_name",
                "process_sort_index",
                "thread_name",
                "thread_sort_index",
            )
        if ev["ph"] in "sf":
            flows.setdefault(ev["id"], []).append(ev["ph"])
            if ev["ph"] == "f":
                assert ev["bp"] == "e"
    assert all(sorted(v) == ["f", "s"] for v in flows.values()), flows
    assert len(flows) == doc["otherData"]["flows"]


def predicted(argv: list[str], world: int, m=MACHINE):
    args = gpt2.parser().parse_args(argv + ["--dry-run", "--world-size", str(world)])
    job = gpt2.make_job(args, world)
    pred, note = prediction.run_prediction(job, args, load(m), keep_spans=True)
    return job, args, pred, trace_predicted.document(job, args, pred, note)


def test_predicted_trace_adds_up_to_the_predicted_breakdown():
    job, _, pred, doc = predicted([*GPT2, "--predict", "steps"], 8)
    check_format(doc)
    sums = trace.category_seconds(doc)
    assert sorted(sums) == list(range(8))
    for r in range(8):
        want = {c: v for c, v in pred.of(r).items() if not c.endswith("_hidden") and v > 0}
        got = {c: v for c, v in sums[r].items() if abs(v) > 1e-12}
        assert got.keys() == want.keys(), r
        for c in want:
            assert got[c] == pytest.approx(want[c], rel=1e-6, abs=1e-8), (r, c)
    # one flow per message of the iteration, each from a send to its receive
    sends = sum(1 for r in range(8) for _, _, d in job.plan(r).messages() if d == "send")
    assert doc["otherData"]["flows"] == sends > 0 and doc["otherData"]["flows_unpaired"] == 0
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names[5] == "rank 5: pp 1 dp 1"  # order pp-dp: pp varies fastest


def test_predicted_order_is_1f1b():
    job, _, _, doc = predicted(GPT2, 4)
    for r in range(4):
        stage = job.grid.coords(r)["pp"]
        got = [
            e["name"]
            for e in sorted(doc["traceEvents"], key=lambda e: e.get("ts", 0))
            if e["ph"] == "X" and e["args"].get("op") in ("forward", "backward") and e["pid"] == r
        ]
        assert [Action.parse(a) for a in got] == one_f_one_b(4, 4, stage)


def test_folded_prediction_draws_representatives_or_named_ranks():
    argv = [*GPT2, "--predict", "coarse"]
    args = gpt2.parser().parse_args(argv + ["--dry-run", "--world-size", "64"])
    job = gpt2.make_job(args, 64)
    pred, note = prediction.run_prediction(job, args, load(MACHINE), fold="always", keep_spans=True)
    assert pred.rep_of is not None
    doc = trace_predicted.document(job, args, pred, note)
    check_format(doc)
    assert doc["otherData"]["ranks"] == sorted(pred.spans)  # the representatives
    # a rank not simulated: its representative's timeline, its own peers
    args.trace_ranks = "17,18"
    doc = trace_predicted.document(job, args, pred, note)
    check_format(doc)
    shown = doc["otherData"]["shown_as"]
    assert shown == {"17": int(pred.rep_of[17]), "18": int(pred.rep_of[18])}
    assert 17 not in pred.spans and doc["otherData"]["flows"] > 0  # 17 and 18 are pp neighbours
    sums = trace.category_seconds(doc)
    assert sums[17]["compute"] == pytest.approx(pred.of(17)["compute"], rel=1e-6)


def test_cli_writes_the_predicted_trace(tmp_path):
    out = tmp_path / "p.json"
    argv = [*GPT2, "--dry-run", "--world-size", "8", "--machine", MACHINE, "--trace", str(out)]
    assert gpt2.main([*argv, "--quiet"]) == 0
    doc = json.loads(out.read_text())
    check_format(doc)
    assert doc["otherData"]["kind"] == "predicted" and len(doc["otherData"]["ranks"]) == 8


DRY = [*GPT2, "--dry-run", "--world-size", "8"]
ON = ["--machine", "dgx-a100", "--trace", "t.json"]  # a shipped machine, by name


@pytest.mark.slow  # each case runs the CLI in a process of its own
@pytest.mark.parametrize(
    "argv, words",
    [
        ([*DRY, "--trace-iters", "2"], "--trace-iters goes with --trace"),
        ([*DRY, "--trace-ranks", "0"], "--trace-ranks goes with --trace"),
        ([*DRY, "--trace", "t.json"], "give --machine FILE"),
        ([*DRY, *ON, "--trace-ranks", "9"], "rank 9 is outside 0..7"),
        ([*DRY, *ON, "--trace-ranks", "a"], "expected 'all' or ranks"),
        ([*DRY, *ON, "--trace-iters", "2"], "a prediction is one iteration"),
        ([*GPT2, "--trace", "t.json", "--trace-iters", "0"], "expected a positive integer"),
        ([*DRY, *ON, "--trace", "/no/such/dir/t.json"], "no such directory"),
        ([*DRY, *ON, "--trace", "/proc/t.json"], "not a place for results"),
    ],
)
def test_bad_trace_options_exit_2(tmp_path, argv, words):
    r = subprocess.run(
        [sys.executable, "-m", "proxies.gpt2", *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 2, (r.stdout[-500:], r.stderr)
    assert words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "t.json").exists()


def test_trace_ranks_parse():
    assert trace.ranks_of(None, 100) == list(range(trace.MAX_RANKS))
    assert trace.ranks_of("all", 3) == [0, 1, 2]
    assert trace.ranks_of("2,0,2", 3) == [0, 2]
    with pytest.raises(cli.UsageError):
        trace.ranks_of("3", 3)


@pytest.mark.slow
def test_timeline_png(tmp_path):
    pytest.importorskip("matplotlib")
    job, args, pred, doc = predicted(GPT2, 4)
    src = tmp_path / "t.json"
    src.write_text(json.dumps(doc))
    png = tmp_path / "t.png"
    r = subprocess.run(
        [sys.executable, "-m", "proxies", "timeline", str(src), "-o", str(png), "--ranks", "0,3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run(
        [sys.executable, "-m", "proxies", "timeline", str(src), "-o", str(png), "--ranks", "7"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "rank 7 is not in the trace" in bad.stderr


@pytest.mark.slow
def test_timeline_without_matplotlib_is_one_line_exit_2(tmp_path):
    _, _, _, doc = predicted(GPT2, 4)
    src = tmp_path / "t.json"
    src.write_text(json.dumps(doc))
    # matplotlib made unimportable for the child process only
    code = (
        "import sys; sys.modules['matplotlib'] = None; "
        "from proxies.core.cli import run_main; from proxies.timeline.command import PROG, main; "
        f"run_main(PROG, main, [{str(src)!r}, '-o', {str(tmp_path / 'x.png')!r}])"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "needs matplotlib" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
