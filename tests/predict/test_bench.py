"""benchmarks/predict.py: one real point with a shipped machine file (measured, predicted and
error fields), the row arithmetic, failures shown as rows, and bad input."""

import importlib.util
import json
import os
import statistics
import subprocess
import sys

import launch
import pytest

ROOT = launch.ROOT
SCRIPT = os.path.join(ROOT, "benchmarks", "predict.py")
MACHINE = os.path.join(ROOT, "configs", "machines", "one-node.yaml")

spec = importlib.util.spec_from_file_location("predict_bench", SCRIPT)
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench  # dataclasses look their module up there
spec.loader.exec_module(bench)


def tiny_point(proxy: str = "gpt2", mode: str = "none", tflops=None):
    config, args = bench.configs(proxy, 2, quick=True)
    return bench.Point(proxy, config, args, 2, mode, tflops, ["--ranks-per-node", "2"])


@pytest.mark.mpi
def test_one_point_measured_and_predicted():
    row = bench.run_point(tiny_point(), MACHINE, timeout=120, iters=2, warmup=1, run=launch.run)
    assert row["status"] == "ok", row
    assert len(row["measured_iters_s"]) == 2
    assert row["measured_s"] == pytest.approx(statistics.fmean(row["measured_iters_s"]))
    assert row["measured_s"] > 0 and row["predicted_s"] > 0
    m, p = row["measured_s"], row["predicted_s"]
    assert row["error_pct"] == pytest.approx(100 * (p - m) / m)
    # gpt2 at pp 2: the pipeline sends and the tied-embedding allreduce, both predicted
    assert {"pp", "embed_allreduce"} <= set(row["categories"])
    assert row["categories"]["embed_allreduce"]["predicted_s"] > 0
    assert "one node" in row["prediction"] and "2 ranks per node" in row["prediction"]
    assert row["worst_category"] is None or row["worst_category"] in row["categories"]
    assert row["command"].startswith("mpiexec -n 2 python -m proxies.gpt2 ")


@pytest.mark.mpi
def test_model_point_takes_the_rate():
    row = bench.run_point(
        tiny_point("dlrm", "model", 0.5), MACHINE, timeout=120, iters=1, run=launch.run
    )
    assert row["status"] == "ok", row
    assert "--device-tflops 0.5" in row["command"] and "--model-times flops" in row["command"]
    assert "0.5 TFLOP/s" in row["prediction"]
    assert row["categories"]["compute"]["predicted_s"] > 0


@pytest.mark.slow
def test_compute_at_one_tflops_is_the_dry_runs(tmp_path):
    # no MPI: the predictor's dry run at 1 TFLOP/s; at 2 and 4 TFLOP/s the busiest rank's
    # FLOPs take half and a quarter of the time
    point = tiny_point("gpt3")
    c1 = bench.compute_at_one_tflops(point, MACHINE)
    out = tmp_path / "dry.json"
    cmd = [sys.executable, "-m", "proxies.gpt3", *point.args, "--compute", "model",
           "--device-tflops", "2", "--dry-run", "--world-size", "2", "--machine", MACHINE,
           "--ranks-per-node", "2", "--json", str(out)]  # fmt: skip
    c = {}
    for tflops in ("2", "4"):
        cmd[cmd.index("--device-tflops") + 1] = tflops
        assert launch.run(cmd, timeout=60).returncode == 0
        c[tflops] = json.loads(out.read_text())["predicted_breakdown_max_s"]["compute"]
    # FLOPs / rate, plus what does not scale with the rate (each slept op's engine.wake)
    assert c1 > c["2"] > c["4"] > 0
    assert c1 - c["2"] == pytest.approx(2 * (c["2"] - c["4"]))


@pytest.mark.mpi
def test_failed_point_is_a_row():
    point = tiny_point("gpt3")
    point.args = [*point.args, "--tp", "3"]  # 3 does not divide the heads: exit 2
    row = bench.run_point(point, MACHINE, timeout=120, run=launch.run)
    assert row["status"].startswith("failed: exit 2: "), row
    assert "measured_s" not in row
    late = bench.run_point(tiny_point(), MACHINE, timeout=0.01)
    assert late["status"] == "failed: timed out after 0.01 s"


def result(iters, breakdown, predicted, pred_breakdown):
    return {
        "iter_time_s": iters,
        "breakdown_s": breakdown,
        "predicted_iter_time_s": predicted,
        "predicted_breakdown_s": pred_breakdown,
    }


def test_compare_judges_big_categories_only():
    r = bench.compare(
        result(
            [1.0, 3.0],  # mean 2
            {
                "compute": [1.0, 1.0],  # 50%, predicted 1.1: +10%
                "tp_allreduce": [0.4, 0.4],  # 20%, predicted 0.2: -50%
                "pp": [0.1, 0.1],  # 5%: not judged, though predicted 0
                "overhead": [0.5, 0.3],  # 20%, no prediction: -100%
                "dp_allreduce_hidden": [1.0, 1.0],  # overlapped: not judged
            },
            1.5,
            {"compute": 1.1, "tp_allreduce": 0.2, "pp": 0.0, "dp_allreduce_hidden": 5.0},
        )
    )
    assert r["measured_s"] == 2.0 and r["predicted_s"] == 1.5
    assert r["error_pct"] == pytest.approx(-25.0)
    assert r["worst_category"] == "overhead"
    assert r["worst_category_error_pct"] == pytest.approx(-100.0)
    assert r["categories"]["tp_allreduce"]["error_pct"] == pytest.approx(-50.0)
    assert r["categories"]["pp"]["share"] == pytest.approx(0.05)
    r = bench.compare(result([1.0], {"compute": [0.95], "pp": [0.05]}, 1.2, {"compute": 1.0}))
    assert r["worst_category"] == "compute"
    assert r["worst_category_error_pct"] == pytest.approx(100 * 0.05 / 0.95)


def test_launches_are_measured_as_the_median_launch(capsys):
    """A point launched 3 times: the median of the launches' medians, their spread, each
    category's median over launches (0 in a launch without it); one prediction."""
    r = bench.compare(
        [
            result([1.0, 1.2, 0.9], {"compute": [0.5] * 3, "pp": [0.5] * 3}, 1.5, {"pp": 0.6}),
            result([3.0, 3.0, 3.1], {"compute": [2.0] * 3}, 1.5, {"pp": 0.6}),
            result([2.0, 2.0, 1.0], {"compute": [1.0] * 3, "pp": [0.4] * 3}, 1.5, {"pp": 0.6}),
        ]
    )
    assert r["measured_launches_s"] == [1.0, 3.0, 2.0] and r["measured_s"] == 2.0
    assert r["spread_pct"] == pytest.approx(100.0) and len(r["measured_iters_s"]) == 9
    assert r["error_pct"] == pytest.approx(-25.0)
    assert r["categories"]["compute"]["measured_s"] == 1.0
    assert r["categories"]["pp"]["measured_s"] == 0.4  # median of 0.5, 0 and 0.4
    assert r["categories"]["pp"]["error_pct"] == pytest.approx(50.0)
    row = {"proxy": "gpt3", "config": "c", "ranks": 2, "mode": "none", "tflops": None,
           "status": "ok"} | r  # fmt: skip
    one = row | bench.compare(result([2.0], {"compute": [1.0]}, 2.2, {"compute": 1.1}))
    bench.print_table([row, one], 25)
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[-3:] == ["spread", "worst", ">=10%"]
    assert "-25%   100%  " in out[1] and "+10%      -  " in out[2]
    assert out[3] == (
        "# within 25%: 2 of 2; the launches of 1 of 1 points spread wider than 25% (the "
        "measurement's own repeatability)"
    )


def test_each_launch_runs_and_a_failed_one_fails_the_point():
    """run_point with launches=3: three runs of the same command, the probe before the first
    and after the last; a launch that fails names itself."""
    times = iter([[1.0], [3.0], [2.0], [1.0], [9.0]])
    seen, probes = [], []

    class Done:
        returncode, stdout, stderr = 0, "", ""

    class Failed:
        returncode, stdout, stderr = 1, "", "rank 1 stalled\n"

    def run(cmd, timeout):
        seen.append(cmd)
        if len(seen) == 5:
            return Failed()
        with open(cmd[cmd.index("--json") + 1], "w") as f:
            json.dump(result(next(times), {"compute": [0.5]}, 2.0, {"compute": 0.5}), f)
        return Done()

    def probe():
        probes.append(len(seen))
        return {"cold_s": 1e-4}

    row = bench.run_point(tiny_point(), MACHINE, run=run, probe=probe, launches=3)
    assert row["status"] == "ok" and row["measured_launches_s"] == [1.0, 3.0, 2.0]
    assert row["measured_s"] == 2.0 and row["error_pct"] == 0.0
    assert len(seen) == 3 and seen[0] == seen[1] == seen[2] and probes == [0, 3]
    row = bench.run_point(tiny_point(), MACHINE, run=run, launches=3)
    assert row["status"] == "failed: launch 2 of 3: exit 1: rank 1 stalled"
    assert "measured_s" not in row


def test_per_state_calibrates_each_state_once(tmp_path, capsys):
    """--per-state: a point starting in the first file's state uses it; one in a state beyond
    the band calibrates a second file, which later points in that state reuse; a probe that
    failed, the first file; past MAX_CALIBRATIONS files, the nearest state's."""
    import yaml

    text = open(MACHINE).read()
    first = yaml.safe_load(text)["calibration"]["state"]  # the shipped file's state
    calibrated = []

    def run(ranks, path, quick, timeout):  # a calibration that finds the copies halved
        calibrated.append((ranks, path))
        d = yaml.safe_load(text)
        d["calibration"]["state"] = first | {"copy": first["copy"] / 2}
        with open(path, "w") as f:
            yaml.safe_dump(d, f)

    cals = bench.Calibrations(MACHINE, 4, str(tmp_path), run=run)
    same = dict(first)
    assert cals.pick(same) == (MACHINE, 1, first) and not calibrated
    halved = first | {"copy": first["copy"] / 2.1}
    path, k, state = cals.pick(halved)
    assert (k, state["copy"]) == (2, first["copy"] / 2) and calibrated == [(4, path)]
    assert cals.pick(first | {"copy": first["copy"] / 1.9})[1] == 2 and len(calibrated) == 1
    assert cals.pick(None)[1] == 1 and cals.pick({})[1] == 1
    assert "# file 2: " in capsys.readouterr().out
    bench.MAX_CALIBRATIONS, saved = 2, bench.MAX_CALIBRATIONS
    try:  # a third state, no room: the nearest (copies x1/3: file 2's x1/2)
        assert cals.pick(first | {"copy": first["copy"] / 3})[1] == 2 and len(calibrated) == 1
    finally:
        bench.MAX_CALIBRATIONS = saved
    # the row keeps the file and its state, which drift is measured against
    row = {"state": [halved, halved], "calibrated_state": state}
    assert bench.drift(row, first) == pytest.approx(2.1 / 2)  # not the first file's x2.1
    assert bench.drift({"state": row["state"]}, first) == pytest.approx(2.1)


def test_points_in_another_machine_state_are_told_apart(capsys):
    """The state probes before and after a point, against the calibrated figures: a point
    where any figure moved beyond the band ran in another state (~), and the summary counts
    the points within the target among all and among those run in the calibrated state."""
    cal = {"cold_s": 1e-4, "reread": 1.3, "copy": 40e9}

    def st(reread=1.3, copy=40e9):
        return {"cold_s": 1e-4, "same_s": reread * 1e-4, "reread": reread, "copy": copy}

    def row(error, state):
        return {"proxy": "gpt3", "config": "c", "ranks": 2, "mode": "none", "tflops": None,
                "status": "ok", "measured_s": 1.0, "predicted_s": 1 + error / 100,
                "error_pct": error, "worst_category": None, "state": state}  # fmt: skip

    rows = [
        row(5, [st(), st(1.2)]),
        row(-60, [st(2.6), st(2.7)]),  # the same-buffer state moved
        row(-40, [st(), st(copy=20e9)]),  # copies halved during the run
        row(10, [None, st()]),  # the first probe failed: unknown
    ]
    assert [bench.steady(r, cal) for r in rows] == [True, False, False, None]
    assert bench.drift(rows[1], cal) == pytest.approx(2.7 / 1.3)
    assert bench.drift(rows[2], cal) == pytest.approx(2.0)
    assert bench.steady(rows[0], None) is None and bench.steady({"status": "ok"}, cal) is None
    bench.print_table(rows, 25, cal)
    out = capsys.readouterr().out.splitlines()
    assert out[1].endswith("drift x1.1") and out[2].endswith("*  drift x2.1 ~")
    assert out[3].endswith("*  drift x2 ~") and out[4].endswith("-")
    assert out[5].startswith("# within 25%: 2 of 4; 1 of the 1 run in the calibrated state")
    bench.print_table(rows[:1], 25)  # a machine file without the figures: no state count
    assert capsys.readouterr().out.splitlines()[-1] == "# within 25%: 1 of 1"


def test_configs_use_the_ranks():
    assert bench.configs("gpt3", 4)[1][:2] == ["2", "2"]  # 2 layers over 2 stages, tp 2
    assert "--global-batch" in bench.configs("cosmoflow", 4)[1]
    for proxy in bench.PROXIES:
        for ranks in (2, 4, 8):
            config, args = bench.configs(proxy, ranks)
            assert config and args


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["--ranks", "3"], "--ranks: expected even rank counts >= 2"),
        (["--ranks", "2,x"], "--ranks: expected even rank counts"),
        (["--proxies", "gpt2,bert"], "--proxies: expected a subset of"),
        (["--modes", "real"], "--modes: expected a subset of none,model"),
        (["--tflops", "-1"], "--tflops: expected a positive number or auto"),
        (["--tflops", "fast"], "--tflops: expected a positive number or auto"),
        (["--machine", "/nonexistent.yaml"], "--machine: no such file"),
        (["--machine", MACHINE, "--calibrate"], "not allowed with argument"),
        (["--restate", "--no-probe"], "--restate needs the state probe"),
        (["--per-state", "--no-probe"], "--per-state needs the state probe"),
        (["--per-state", "--restate"], "--restate and --per-state: one or the other"),
        (["--launches", "0"], "--launches: "),
        (["--launches", "1.5"], "--launches: "),
        (["--restate", "--machine", MACHINE], "has no calibration.reuse.predicted_cold_s"),
    ],
)
def test_bad_input(args, message):
    r = subprocess.run(
        [sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2
    assert message in r.stderr
    assert r.stdout == ""


@pytest.mark.mpi
def test_script_end_to_end(tmp_path):
    # the whole script on one proxy: the none point, the rate from it, the model point, table
    out = tmp_path / "rows.json"
    cmd = [sys.executable, SCRIPT, "--machine", MACHINE, "--ranks", "2", "--proxies", "dlrm",
           "--quick", "--launches", "2", "--json", str(out)]  # fmt: skip
    r = launch.run(cmd, timeout=120)
    assert r.returncode == 0, r.stderr
    stdout = r.stdout
    table = stdout.split("# * error above 25%")[1]
    assert table.count("dlrm-tiny B=64, row-wise") == 2 and " TF " in table
    d = json.loads(out.read_text())
    none, model = d["rows"]
    assert (none["mode"], model["mode"]) == ("none", "model")
    assert none["status"] == model["status"] == "ok"
    assert model["tflops"] > 0 and d["machine"].startswith("one node")
    # the machine's state probed before and after each point, against the file's
    for r in (none, model):
        assert len(r["state"]) == 2 and all(s["cold_s"] > 0 and s["copy"] > 0 for s in r["state"])
    from proxies.core.machine import load

    assert d["calibrated_state"] == load(MACHINE).calibration["state"]
    assert table.count(" drift x") == 2 and "calibrated state" in table
    assert d["command"].startswith("python benchmarks/predict.py --machine")
    assert d["launches"] == 2 and all(len(r["measured_launches_s"]) == 2 for r in (none, model))
    assert d["calibrations"][0]["yaml"] == open(MACHINE).read()  # predicted again from it
    assert "the median of 2 launches" in stdout and "points spread wider" in table


@pytest.mark.mpi
def test_script_shows_failed_points(tmp_path):
    cmd = [sys.executable, SCRIPT, "--machine", MACHINE, "--ranks", "2", "--proxies", "gpt2",
           "--quick", "--timeout", "0.01"]  # fmt: skip
    r = launch.run(cmd, timeout=60)
    assert r.returncode == 1, r.stderr
    table = r.stdout.split("# * error above 25%")[1]
    assert "none            failed: timed out after 0.01 s" in table
    assert "failed: no --device-tflops (the none point failed" in table


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        ([], "MACHINE.yaml [MiB ...]"),
        (["/nonexistent.yaml"], "/nonexistent.yaml: cannot read"),
        ([MACHINE, "x"], "invalid literal"),
    ],
)
def test_allreduce_check_bad_input(args, message):
    """benchmarks/predict_allreduce.py: usage and bad input, one line, exit 2."""
    script = os.path.join(ROOT, "benchmarks", "predict_allreduce.py")
    r = subprocess.run(
        [sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_restate_predicts_each_point_with_the_probes_same_buffer_time():
    """--restate: the probe before the point sets reuse.reread (its same-buffer time over the
    file's cold price of it) on the point's command line, kept in the row."""
    seen = []

    class Failed:
        returncode, stdout, stderr = 2, "", "stopped here\n"

    def run(cmd, timeout):
        seen.append(cmd)
        return Failed()

    probes = iter([{"same_s": 3e-4, "copy": 2e10}, {"same_s": 1e-4, "copy": 4e10}])
    restate = bench.Restate(cold_s=1.5e-4, copy=4e10, memory=44e9)
    row = bench.run_point(
        tiny_point(), MACHINE, run=run, probe=lambda: next(probes), restate=restate
    )
    # the probe before: twice the cold price, copies at half the calibration's rate
    assert row["restated_reread"] == 2.0 and row["restated_memory"] == 22e9
    sets = [seen[0][i + 1] for i, a in enumerate(seen[0]) if a == "--machine-set"]
    assert sets == ["reuse.reread=2.0", "compute.memory=22 GB/s"]
    assert "--machine-set reuse.reread=2.0" in row["command"]
    # a file whose calibration recorded no copy rate: reread alone
    bare = bench.Restate(cold_s=1.5e-4, copy=None, memory=44e9)
    row = bench.run_point(
        tiny_point(), MACHINE, run=run, probe=lambda: {"same_s": 3e-4, "copy": 2e10}, restate=bare
    )
    assert "restated_memory" not in row and "compute.memory=22 GB/s" not in seen[-1]
    # without a probe result, or without --restate: the file as it is
    for probe, given in ((lambda: None, restate), (lambda: {"same_s": 3e-4}, None)):
        row = bench.run_point(tiny_point(), MACHINE, run=run, probe=probe, restate=given)
        assert "restated_reread" not in row and "--machine-set" not in seen[-1]
