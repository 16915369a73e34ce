"""python -m proxies compare, and the sweep report's CSV, plots, per-point JSON loading and
scaling warning. Results are built by core.report.summarize (the proxies' own code), so
they are shaped exactly like a --json file."""

import csv
import itertools
import json
import os
import sys

import pytest
from launch import ROOT, mpirun, run

from proxies.compare import command, stats
from proxies.core import exits
from proxies.core.report import summarize
from proxies.sweep import report, results, runner, schema

HERE = {"PYTHONPATH": ROOT}  # this checkout's proxies, from any folder
CONFIG = {"model": "gpt2-tiny", "layers": 2, "global_batch": 4, "allreduce": "mpi", "iters": 10}


def result(iters: list[float], ranks: int = 2, config: dict | None = None) -> dict:
    """A result JSON: per-rank rows (compute 80% of the iteration, allreduce the rest)."""
    rows = [
        {
            "rank": r,
            "label": "stage 0",
            "iter_s": list(iters),
            "seconds": {
                "compute": [0.8 * t for t in iters],
                "dp_allreduce": [0.2 * t for t in iters],
            },
            "bytes": {"dp_allreduce": 1000},
        }
        for r in range(ranks)
    ]
    cfg = {**CONFIG, **(config or {})}
    return {"proxy": "gpt2", "config": cfg, "world_size": ranks, **summarize(rows)}


def write(path, obj) -> str:
    path.write_text(json.dumps(obj))
    return str(path)


# Deterministic "noise": the same ten relative deviations, in two different orders.
NOISE = [0.00, 0.03, -0.02, 0.05, -0.04, 0.01, -0.01, 0.04, -0.03, 0.02]
SLOW = [0.100 * (1 + e) for e in NOISE]
FAST = [0.080 * (1 + e) for e in reversed(NOISE)]
SAME = [0.100 * (1 + e) for e in NOISE[5:] + NOISE[:5]]


def test_mann_whitney_exact_distribution_is_the_enumerated_one():
    for n1, n2 in ((1, 1), (2, 3), (3, 4), (4, 4)):
        counts = [0] * (n1 * n2 + 1)
        for pos in itertools.combinations(range(n1 + n2), n1):
            counts[sum(p - i for i, p in enumerate(pos))] += 1
        assert stats.u_distribution(n1, n2) == counts
    # every B below every A, 5 vs 5: p = 2 / C(10, 5)
    u, p = stats.mann_whitney([6, 7, 8, 9, 10], [1, 2, 3, 4, 5])
    assert u == 25 and p == pytest.approx(2 / 252)


def test_clear_difference_detected(tmp_path, capsys):
    a, b = write(tmp_path / "a.json", result(SLOW)), write(tmp_path / "b.json", result(FAST))
    out = tmp_path / "cmp.json"
    assert command.main([a, b, "--json", str(out)]) == exits.OK
    text = capsys.readouterr().out
    assert "B faster by 20.0%" in text
    doc = json.loads(out.read_text())
    rows = doc["points"][0]["rows"]
    assert set(rows) == {"iteration", "compute", "dp_allreduce"}
    it = rows["iteration"]
    assert it["a"]["median"] == pytest.approx(0.1005) and it["b"]["median"] == pytest.approx(0.0804)
    assert it["ratio"] == pytest.approx(0.8) and it["faster"] == "B"
    # every B iteration faster than every A one: p = 2 / C(20, 10)
    assert it["p"] == pytest.approx(2 / 184756)
    assert it["verdict"] == "B faster by 20.0% (p=1.1e-05 < 0.05; ranges do not overlap)"
    assert rows["compute"]["faster"] == "B" and rows["compute"]["ratio"] == pytest.approx(0.8)
    # and the other way round: A faster, B slower by 25%
    assert command.main([b, a]) == exits.OK
    assert "B slower by 25.0%" in capsys.readouterr().out


def test_same_work_with_noise_is_no_difference(tmp_path, capsys):
    a, b = write(tmp_path / "a.json", result(SLOW)), write(tmp_path / "b.json", result(SAME))
    out = tmp_path / "cmp.json"
    assert command.main([a, b, "--json", str(out)]) == exits.OK
    assert "no difference beyond noise (p=1; ranges overlap)" in capsys.readouterr().out
    rows = json.loads(out.read_text())["points"][0]["rows"]
    assert all(r["faster"] is None for r in rows.values())


def test_too_few_iterations_say_so(tmp_path, capsys):
    a = write(tmp_path / "a.json", result([0.1, 0.11]))
    b = write(tmp_path / "b.json", result([0.05, 0.051]))
    assert command.main([a, b]) == exits.OK
    assert "too few iterations to tell" in capsys.readouterr().out


def test_different_work_refused_unless_allowed(tmp_path, capsys):
    a = write(tmp_path / "a.json", result(SLOW))
    b = write(tmp_path / "b.json", result(FAST, config={"layers": 4, "global_batch": 8}))
    assert command.main([a, b]) == exits.USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("proxies compare: error: ")
    assert "run different work: layers (2 vs 4), global_batch (4 vs 8); --allow-different" in err
    assert command.main([a, b, "--allow-different"]) == exits.OK
    assert "different work (--allow-different): layers, global_batch" in capsys.readouterr().out
    # What differs in how, not what: compared, and said.
    c = write(tmp_path / "c.json", result(FAST, config={"allreduce": "ring", "iters": 20}))
    assert command.main([a, c]) == exits.OK
    assert "differs (same work): allreduce: mpi -> ring; iters: 10 -> 20" in capsys.readouterr().out
    d = write(tmp_path / "d.json", result(FAST, ranks=4))
    assert command.main([a, d]) == exits.USAGE
    assert "world_size (2 vs 4)" in capsys.readouterr().err


def sweep_dir(path, points: dict[str, list[float]]) -> str:
    """A results directory: one ok record per point (name: layers=N at 2 ranks)."""
    os.makedirs(path)
    for i, (layers, iters) in enumerate(points.items()):
        p = {
            "id": f"p{layers}",
            "label": "gpt2",
            "proxy": "gpt2",
            "ranks": 2,
            "args": {"layers": layers},
            "series": {"layers": layers},
            "series_id": f"s{layers}",
            "index": i,
        }
        res = result(iters, config={"layers": layers})
        results.append(str(path / results.FILE), {"point": p, "status": "ok", "result": res})
    return str(path)


def test_sweep_dirs_matched_by_point(tmp_path, capsys):
    a = sweep_dir(tmp_path / "a", {1: SLOW, 2: SLOW})
    b = sweep_dir(tmp_path / "b", {2: FAST, 3: FAST})
    out = tmp_path / "cmp.json"
    assert command.main([a, b, "--json", str(out)]) == exits.OK
    text = capsys.readouterr().out
    assert "gpt2 · 2 ranks · layers=2" in text and "B faster by 20.0%" in text
    assert f"only in {a} (1, not compared): gpt2 · 2 ranks · layers=1" in text
    assert f"only in {b} (1, not compared): gpt2 · 2 ranks · layers=3" in text
    doc = json.loads(out.read_text())
    assert len(doc["points"]) == 1 and doc["only_in_a"] == ["gpt2 · 2 ranks · layers=1"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "what, words",
    [
        ("missing", "missing.json: no such file or directory"),
        ("not json", "notjson.json: not a JSON file"),
        ("not a result", 'other.json: not a proxy result JSON (no "proxy"'),
        ("prediction", "dry.json: a prediction without a measurement"),
        ("empty dir", "empty: no results.jsonl and no per-point JSON files"),
        ("sweep without results", "results.jsonl: no measured point that finished ok"),
        ("file vs sweep", "compare two of the same kind"),
        ("bad --json", "--json nodir/x.json: no such directory"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, what, words):
    good = write(tmp_path / "good.json", result(SLOW))
    (tmp_path / "notjson.json").write_text("{not json")
    write(tmp_path / "other.json", {"rows": []})
    write(tmp_path / "dry.json", {"proxy": "gpt2", "predicted_iter_time_s": 0.1})
    (tmp_path / "empty").mkdir()
    (tmp_path / "failed").mkdir()
    bad = {"point": {"id": "x", "label": "g", "proxy": "gpt2", "ranks": 1, "args": {}}}
    bad["point"].update(series={}, series_id="s")
    results.append(str(tmp_path / "failed" / results.FILE), {**bad, "status": "failed"})
    sweep = sweep_dir(tmp_path / "sweep", {1: SLOW})
    other = {
        "missing": "missing.json",
        "not json": "notjson.json",
        "not a result": "other.json",
        "prediction": "dry.json",
        "empty dir": "empty",
        "sweep without results": "failed",
        "file vs sweep": sweep,
    }
    argv = [good, str(tmp_path / other.get(what, "good.json"))]
    if what == "bad --json":
        argv += ["--json", "nodir/x.json"]
    r = run(
        [sys.executable, "-m", "proxies", "compare", *argv], timeout=60, cwd=str(tmp_path), env=HERE
    )
    assert r.returncode == exits.USAGE, r.stderr
    assert r.stderr.count("\n") == 1 and words in r.stderr, r.stderr
    assert r.stdout == ""


@pytest.mark.mpi
def test_real_runs_compare(tmp_path):
    """Two real 1-rank runs of the same configuration: compared, whatever the verdict."""
    paths = [str(tmp_path / f"{x}.json") for x in "ab"]
    for p in paths:
        r = mpirun(1, "proxies.gpt2", "1", "1", "2", "--seq-len", "16", "--iters", "5",
                   "--warmup", "1", "--json", p, "--quiet")  # fmt: skip
        assert r.returncode == 0, r.stderr
    r = run([sys.executable, "-m", "proxies", "compare", *paths], timeout=60)
    assert r.returncode == 0, r.stderr
    assert "time per iteration" in r.stdout and "compute" in r.stdout


# -- the sweep report: CSV, plots, per-point JSON files, the scaling warning ----------------


def record(i: int, ranks: int, iters: list[float], scaling="strong", batch=4, cats=None) -> dict:
    res = result(iters, ranks=ranks, config={"global_batch": batch})
    if cats:
        res["breakdown_s"] = {c: [0.01] * len(iters) for c in cats}
    p = {
        "id": f"p{i}",
        "label": "gpt2",
        "proxy": "gpt2",
        "ranks": ranks,
        "args": {"layers": 2, "stages": 1, "check": True, "micro_batches": 8 // ranks},
        "series": {"layers": 2, "stages": 1, "check": True, "micro_batches": "{8 // ranks}"},
        "series_id": "s",
        "scaling": scaling,
        "index": i,
    }
    return {"point": p, "status": "ok", "result": res}


def test_csv_has_one_column_per_argument_and_the_spread(tmp_path):
    recs = [record(0, 1, [0.3, 0.1, 0.2]), record(1, 2, [0.05, 0.15, 0.4, 0.1])]
    path = str(tmp_path / "report.csv")
    report.write_csv(report.rows(recs), path)
    with open(path) as f:
        got = list(csv.DictReader(f))
    assert "args" not in got[0]
    assert [(r["arg_layers"], r["arg_check"], r["arg_micro_batches"]) for r in got] == [
        ("2", "true", "8"),
        ("2", "true", "4"),
    ]
    spread = [[float(r[f"iter_time_{k}_s"]) for k in ("min", "median", "max")] for r in got]
    assert spread == [[0.1, 0.2, 0.3], [0.05, 0.125, 0.4]]
    assert float(got[1]["iter_time_s"]) == pytest.approx(0.175)


def test_plots_have_distinct_category_colours_and_error_bars(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    figures = {}
    monkeypatch.setattr(
        report, "save", lambda fig, path, plt: figures.setdefault(os.path.basename(path), fig)
    )
    for n in (12, 23):  # tab20; beyond 20, hatches
        cats = [f"cat{j:02d}" for j in range(n)]
        recs = [record(0, 1, [0.1, 0.2], cats=cats), record(1, 4, [0.1, 0.3], cats=cats)]
        figures.clear()
        report.plot(report.rows(recs), str(tmp_path), "t")
        ax = figures["breakdown.png"].axes[0]
        looks = {(c.patches[0].get_facecolor(), c.patches[0].get_hatch()) for c in ax.containers}
        assert len(ax.containers) == n and len(looks) == n
    time_ax = figures["time.png"].axes[0]
    bars = [c for c in time_ax.containers if type(c).__name__ == "ErrorbarContainer"]
    assert len(bars) == 1
    segments = bars[0].lines[2][0].get_segments()  # min to max over iterations
    assert [(s[0][1], s[1][1]) for s in segments] == [(0.1, 0.2), (0.1, 0.3)]
    assert time_ax.get_xscale() == "log" and list(time_ax.get_xticks()) == [1, 4]


@pytest.mark.parametrize(
    "scaling, batches, words",
    [
        ("weak", (4, 4), "scaling: weak, but the work (global_batch 4, layers 2) is the same"),
        (
            "strong",
            (4, 8),
            "scaling: strong, but the work changes with the ranks (global_batch 4 -> 8",
        ),
        ("weak", (4, 8), None),
        ("strong", (4, 4), None),
    ],
)
def test_scaling_warning(scaling, batches, words):
    recs = [record(i, 1 + i, [0.1], scaling=scaling, batch=b) for i, b in enumerate(batches)]
    got = report.scaling_warnings(recs)
    assert got == [] if words is None else (len(got) == 1 and words in got[0])


@pytest.mark.slow
def test_report_reads_print_commands_point_files(tmp_path):
    sweep = tmp_path / "w.yaml"
    sweep.write_text(
        "name: w\nranks: [1, 2]\nprecheck: false\nargs:\n  iters: 2\nruns:\n"
        "  - proxy: gpt2\n    args:\n      layers: 1\n      stages: [1, 2]\n"
        "    skip:\n      - divisible: [ranks, stages]\n"
    )
    points = schema.expand(schema.load(str(sweep)))
    d = tmp_path / "res"
    d.mkdir()
    for i, p in enumerate(points):
        if not p.skip:
            write(d / f"{runner.tag(i, p)}.json", result([0.1 * p.ranks, 0.2], ranks=p.ranks))
    r = run([sys.executable, "-m", "proxies", "report", str(d)], timeout=60)
    assert r.returncode == exits.USAGE and "name their sweep file with --sweep FILE" in r.stderr
    r = run([sys.executable, "-m", "proxies", "report", str(d), "--sweep", str(sweep)], timeout=60)
    assert r.returncode == exits.OK, r.stderr
    with open(d / report.CSV_FILE) as f:
        got = list(csv.DictReader(f))
    assert [(g["ranks"], g["arg_stages"], g["status"]) for g in got] == [
        ("1", "1", "ok"),
        ("2", "1", "ok"),
        ("1", "2", "skipped"),
        ("2", "2", "ok"),
    ]
    assert [g["iter_time_max_s"] for g in got if g["status"] == "ok"] == ["0.2", "0.2", "0.2"]


@pytest.mark.slow
def test_compare_is_a_command():
    r = run([sys.executable, "-m", "proxies"], timeout=60, cwd=ROOT)
    assert "compare" in r.stdout
