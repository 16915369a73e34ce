"""--trace of a real run under mpiexec: the 1F1B order, flows from each send to its receive,
and per category the trace's self times equal to the run's own breakdown (--json)."""

from __future__ import annotations

import json

import pytest
from launch import mpirun

from proxies.core import trace
from proxies.core.schedules import Action, one_f_one_b

from .test_trace import check_format

pytestmark = pytest.mark.mpi  # every test here starts MPI


def test_measured_trace_of_gpt2_1f1b(tmp_path):
    out, res = tmp_path / "t.json", tmp_path / "r.json"
    r = mpirun(
        4,
        "proxies.gpt2",
        *("8", "4", "4", "--iters", "2", "--warmup", "1", "--quiet"),
        *("--compute", "model", "--device-tflops", "1"),
        *("--trace", str(out), "--json", str(res)),
        timeout=240,
    )
    assert r.returncode == 0, r.stderr
    doc, result = json.loads(out.read_text()), json.loads(res.read_text())
    check_format(doc)
    meta = doc["otherData"]
    assert meta["kind"] == "measured" and meta["ranks"] == [0, 1, 2, 3]
    assert meta["iterations"] == [1, 2] and meta["dropped_iterations"] == {}
    assert meta["clock"]["residual_us_max"] >= 0
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names[2] == "rank 2: pp 2 dp 0"
    # Each rank's forwards and backwards, per iteration, in 1F1B order (stage = pp coordinate).
    for rank in range(4):
        marks = sorted(e["ts"] for e in events if e["pid"] == rank and e["cat"] == "iteration")
        assert len(marks) == 2
        for k, start in enumerate(marks):
            end = marks[k + 1] if k + 1 < len(marks) else float("inf")
            got = [
                Action.parse(e["name"])
                for e in sorted(events, key=lambda e: e["ts"])
                if e["pid"] == rank and start <= e["ts"] < end
                if e["args"].get("op") in ("forward", "backward")
            ]
            assert got == one_f_one_b(4, 4, rank), (rank, k)
    # Every pipeline message of the two iterations: one flow, from its sender's batch to its
    # receiver's, the receiver being the sender's pipeline neighbour.
    flows: dict[int, dict[str, dict]] = {}
    for e in doc["traceEvents"]:
        if e["ph"] in "sf":
            flows.setdefault(e["id"], {})[e["ph"]] = e
    # 4 micro-batches x 3 stage boundaries x (activation + gradient) x 2 iterations
    assert len(flows) == 4 * 3 * 2 * 2 and meta["flows_unpaired"] == 0
    for f in flows.values():
        s, d = f["s"], f["f"]
        assert abs(s["pid"] - d["pid"]) == 1
        # the receive ends after the send began (clocks aligned within the residual)
        slack = (
            meta["clock"]["residual_us"][str(s["pid"])]
            + meta["clock"]["residual_us"][str(d["pid"])]
        )
        assert d["ts"] >= s["ts"] - slack - 1.0
        for end in (s, d):  # bound inside a point-to-point batch on the flow's thread
            assert any(
                e["pid"] == end["pid"]
                and e["tid"] == end["tid"]
                and e["cat"] == "pp"
                and e["ts"] <= end["ts"] <= e["ts"] + e["dur"]
                for e in events
            )
    # Self times per category: the breakdown the run reported, within 2%.
    sums = trace.category_seconds(doc)
    breakdown = result["breakdown_s"]  # per category, per iteration: mean over ranks
    cats = {c for per in sums.values() for c in per}
    assert {"compute", "pp", "idle"} <= cats
    iteration = sum(result["iter_time_s"])
    for c in cats:
        mean = sum(per.get(c, 0.0) for per in sums.values()) / 4
        want = sum(breakdown[c])
        assert mean == pytest.approx(want, rel=0.02, abs=1e-4 * iteration), c
    assert cats <= set(breakdown)  # overhead (between ops) is the one not drawn
