"""Sweeps that predict: the machine keys (validated at load, one message naming the sweep
file, the key and the machine file's own message), the machine options in every point's
command, predicted-only points (predict_ranks) run as one dry-run process without the
launcher, recorded and resumed like the others, and the report's predicted column, error
and predicted scaling, checked against hand arithmetic."""

import csv
import io
import json
import os
import sys
import textwrap

import pytest
from launch import ROOT, run

from proxies.sweep import launch, report, results, runner
from proxies.sweep.schema import SweepError, expand, load

MACHINE = os.path.join(ROOT, "configs", "machines", "10gbe.yaml")
# GPT-3 tiny, transformer layers only, pipeline only (dp = tp = 1): no collectives, so the
# prediction needs only point-to-point pricing. Compute modelled: a point takes < 1 s.
BASE = f"""
name: t
proxy: gpt3
precheck: false
timeout: 120
env: {{OMP_NUM_THREADS: 1}}
machine: {MACHINE}
args:
  layers: 16
  stages: "{{ranks}}"
  model: gpt3-tiny
  layers_only: true
  compute: model
  iters: 2
  warmup: 1
"""


def write(tmp_path, text: str, name: str = "s.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def error(tmp_path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(SweepError) as e:
        expand(load(path))
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg, msg
    return msg[len(path) + 2 :]


# -- schema --------------------------------------------------------------------------------


def test_bad_machine_file_names_sweep_key_and_machine_message(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(open(MACHINE).read().replace("intra_node:", "intra_nod:"))
    msg = error(tmp_path, BASE.replace(MACHINE, "bad.yaml") + "ranks: [2]\n")
    # The file is found beside the sweep file; the machine module's message follows.
    assert msg.startswith(f"machine: {bad}: intra_nod: unknown key (did you mean 'intra_node'?)")
    msg = error(tmp_path, BASE.replace(MACHINE, "nope.yaml") + "ranks: [2]\n")
    assert msg.startswith("machine: nope.yaml: no such file (looked beside the sweep file")


SCHEMA_ERRORS = [
    ("predict_ranks without machine", "predict_ranks: [4]\n", "predict_ranks: predicting needs"),
    ("predict_ranks zero", "ranks: [2]\npredict_ranks: [0, 4]\n", "predict_ranks: rank counts "),
    ("predict_ranks negative", "predict_ranks: [-4]\n", "predict_ranks: rank counts must be"),
    ("predict_ranks type", "predict_ranks: [four]\n", "predict_ranks: expected positive integ"),
    ("predict_ranks bool", "predict_ranks: true\n", "predict_ranks: expected positive integ"),
    ("predict_ranks twice", "predict_ranks: [4, 4]\n", "predict_ranks: a rank count is listed"),
    ("in ranks too", "ranks: [2, 4]\npredict_ranks: [4]\n", "predict_ranks: 4 is in ranks too"),
    ("ranks_per_node", "ranks: [2]\nranks_per_node: 0\n", "ranks_per_node: expected a positive"),
    ("predict mode", "ranks: [2]\npredict: fast\n", "predict: expected one of auto, steps, c"),
    ("machine type", "ranks: [2]\nmachine: [a]\n", "machine: expected a string, got a list"),
    (
        "machine_set value",
        "ranks: [2]\nmachine_set: {inter_node.bandwidth: 10 us}\n",
        "machine_set.inter_node.bandwidth: ",
    ),
    ("machine_set type", "ranks: [2]\nmachine_set: [a]\n", "machine_set: expected a mapping"),
    ("machine in args", "", "args.machine: not in args"),
    (
        "run's machine_set",
        "ranks: [2]\nruns:\n  - machine_set: {nodes.cores_per_node: 0}\n",
        "runs[0].machine_set.nodes.cores_per_node: ",
    ),
]


@pytest.mark.parametrize("what,extra,want", SCHEMA_ERRORS, ids=[e[0] for e in SCHEMA_ERRORS])
def test_schema_errors(tmp_path, what, extra, want):
    text = BASE + extra
    if "without machine" in what or what == "machine type":
        text = text.replace(f"machine: {MACHINE}\n", "")
    if what == "machine in args":  # in BASE's args (a second args: key is an error)
        text = BASE.replace("  layers: 16\n", "  layers: 16\n  machine: x\n") + "ranks: [2]\n"
    assert error(tmp_path, text).startswith(want)


def test_machine_options_without_machine(tmp_path):
    plain = BASE.replace(f"machine: {MACHINE}\n", "") + "ranks: [2]\n"
    for extra, key in (
        ("machine_set: {inter_node.latency: 1 us}\n", "machine_set.inter_node.latency"),
        ("ranks_per_node: 2\n", "ranks_per_node"),
        ("predict: coarse\n", "predict"),
    ):
        assert error(tmp_path, plain + extra) == f"{key}: goes with machine: FILE (a machine " + (
            "model to predict on)"
        )


def test_machine_set_message_is_the_machine_modules(tmp_path):
    msg = error(tmp_path, BASE + "ranks: [2]\nmachine_set: {inter_node.bandwidth: 10 us}\n")
    assert msg == (
        f"machine_set.inter_node.bandwidth: {MACHINE}: --machine-set inter_node.bandwidth: "
        "expected a bandwidth like '10 Gb/s' or '25 GB/s', got '10 us'"
    )


# -- points and commands -------------------------------------------------------------------

PREDICTING = (
    BASE
    + """
ranks: [1, 2]
predict_ranks: [64, 8]
repeat: 2
ranks_per_node: 4
predict: coarse
machine_set:
  inter_node.latency: 30 us
  mpi.allreduce: [[64 KiB, rd], [any, ring]]
"""
)


def test_every_point_carries_the_machine_options(tmp_path):
    ps = expand(load(write(tmp_path, PREDICTING)))
    # Measured ranks twice each (repeat 2), predicted ranks once each (deterministic).
    assert [(p.ranks, p.predicted, p.repeat) for p in ps] == [
        (1, False, 0),
        (1, False, 1),
        (2, False, 0),
        (2, False, 1),
        (8, True, 0),
        (64, True, 0),
    ]
    words = [
        "--machine",
        MACHINE,
        "--machine-set",
        "inter_node.latency=30 us",
        "--machine-set",
        'mpi.allreduce=[["64 KiB", "rd"], ["any", "ring"]]',  # JSON: YAML to the proxy
        "--ranks-per-node",
        "4",
        "--predict",
        "coarse",
    ]
    measured = launch.command(ps[2], "mpiexec", "r.json")
    assert os.path.basename(measured[0]) == "mpiexec" and measured[1:3] == ["-n", "2"]
    assert measured[3:] == [
        sys.executable,
        "-m",
        "proxies.gpt3",
        *ps[2].argv,
        *words,
        "--json",
        "r.json",
    ]
    # A predicted point: no launcher, one process planning and predicting 64 ranks.
    predicted = launch.command(ps[5], "srun -n {ranks} {command}", "r.json")
    assert predicted == [
        sys.executable,
        "-m",
        "proxies.gpt3",
        "16",
        "64",
        *ps[5].argv[2:],
        *words,
        "--json",
        "r.json",
        "--dry-run",
        "--world-size",
        "64",
    ]
    # The precheck only asks whether the point can be planned: no prediction.
    assert "--machine" not in launch.proxy_command(ps[5], None, machine=False)
    assert ps[5].record()["predicted"] is True and ps[5].record()["machine"] == MACHINE
    assert "predicted" not in ps[2].record() and ps[5].describe().endswith(" · predicted")


def test_identity_of_predictions_follows_the_machine(tmp_path):
    """A predicted point is redone when the machine model changes; a measurement is not."""
    a = expand(load(write(tmp_path, PREDICTING)))
    b = expand(load(write(tmp_path, PREDICTING.replace("30 us", "40 us"), "b.yaml")))
    assert [p.id for p in a if not p.predicted] == [p.id for p in b if not p.predicted]
    assert all(x.id != y.id for x, y in zip(a, b, strict=True) if x.predicted)
    assert json.loads(a[-1].id)["machine"]["set"][0] == "inter_node.latency=30 us"


def test_machine_path_relative_to_the_sweep_file_or_the_cwd(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "m.yaml").write_text(open(MACHINE).read())
    ps = expand(
        load(write(tmp_path, BASE.replace(MACHINE, "m.yaml") + "ranks: [2]\n", "sub/s.yaml"))
    )
    assert ps[0].run.machine.path == str(tmp_path / "sub" / "m.yaml")
    monkeypatch.chdir(ROOT)
    rel = "configs/machines/10gbe.yaml"
    ps = expand(load(write(tmp_path, BASE.replace(MACHINE, rel) + "ranks: [2]\n")))
    assert ps[0].run.machine.path == MACHINE and ps[0].run.machine.file == rel


def test_print_commands_and_sbatch_size_by_measured_points(tmp_path, capsys):
    path = write(tmp_path, BASE + "ranks: [2]\npredict_ranks: [4096]\n")
    assert runner.main([path, "--print-commands", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(
        "2 points, 2 to run, 0 skipped; 1 predicted, one process each, no launcher"
    )
    assert "mpiexec -n 2 " in out[1] and f"--machine {MACHINE}" in out[1]
    assert out[2].startswith(f"OMP_NUM_THREADS=1 {sys.executable} -m proxies.gpt3 16 4096 ")
    assert out[2].endswith("--dry-run --world-size 4096")
    job = tmp_path / "job.sh"
    assert runner.main([path, "--sbatch", str(job), "--results", str(tmp_path)]) == 0
    assert "#SBATCH --ntasks=2\n" in job.read_text()  # not 4096


# -- report --------------------------------------------------------------------------------


def record(ranks, t=None, pred=None, predicted=False, status="ok", **pbd):
    series = {"layers": 8}
    point = {
        "id": json.dumps([ranks, predicted]),
        "label": "g",
        "proxy": "gpt3",
        "ranks": ranks,
        "args": series,
        "repeat": 0,
        "series": series,
        "series_id": "s",
        "scaling": "strong",
        "machine": "m.yaml",
        **({"predicted": True} if predicted else {}),
    }
    rec = {"point": point, "status": status, "describe": f"g {ranks}"}
    if status == "ok":
        rec["result"] = {"predicted_iter_time_s": pred, "predicted_breakdown_s": pbd}
        if t is not None:
            rec["result"].update(iter_time_s=t, breakdown_s={"compute": t})
    else:
        rec["stderr_tail"] = "ImportError: no pricing"
    return rec


def test_report_predicted_column_error_and_predicted_scaling(tmp_path):
    recs = [
        record(1, t=[2.0, 4.0], pred=2.5, compute=2.5),  # measured 3.0, predicted 2.5
        record(2, t=[2.0], pred=1.5, compute=1.5),
        record(8, pred=0.5, predicted=True, compute=0.25, pp=0.25),
        record(64, predicted=True, status="failed"),
    ]
    rows = {r["ranks"]: r for r in report.rows(recs)}
    r1, r2, r8, r64 = rows[1], rows[2], rows[8], rows[64]
    assert r1["iter_time_s"] == 3.0 and r1["predicted_s"] == 2.5
    assert r1["error"] == pytest.approx(-0.5 / 3.0) and r2["error"] == pytest.approx(-0.25)
    assert r2["speedup"] == pytest.approx(1.5)  # measured: 3.0 / 2.0
    assert r2["predicted_speedup"] == pytest.approx(2.5 / 1.5)
    # The predicted-only point: no measurement; scaling against the predicted time at 1 rank.
    assert r8["predicted"] and r8["iter_time_s"] is None and r8["error"] is None
    assert r8["speedup"] == pytest.approx(5.0) and r8["efficiency"] == pytest.approx(5.0 / 8)
    assert r8["predicted_breakdown_s"] == {"compute": 0.25, "pp": 0.25}
    assert r64["status"] == "failed" and r64["reason"] == "ImportError: no pricing"

    from rich.console import Console

    buf = io.StringIO()
    report.print_table(list(rows.values()), "t", Console(file=buf, width=200))
    text = buf.getvalue()
    assert "predicted" in text.splitlines()[2] and "error" in text.splitlines()[2]
    line1 = next(x for x in text.splitlines() if x.startswith("│ g ") and " 1 │" in x)
    assert "3.0000" in line1 and "2.5000" in line1 and "-16.7%" in line1
    line8 = next(x for x in text.splitlines() if "g (pred)" in x and " 8 │" in x)
    assert "predicted" in line8 and "0.5000" in line8 and "5.00x" in line8 and "62%" in line8
    assert "failed: g (pred) at 64 ranks: ImportError: no pricing" in text

    report.write_csv(list(rows.values()), str(tmp_path / "r.csv"))
    with open(tmp_path / "r.csv") as f:
        got = {int(x["ranks"]): x for x in csv.DictReader(f)}
    assert float(got[1]["predicted_s"]) == 2.5 and float(got[1]["error"]) == pytest.approx(-1 / 6)
    assert got[8]["predicted"] == "True" and got[8]["iter_time_s"] == ""
    assert float(got[8]["predicted_breakdown_pp_s"]) == 0.25
    pytest.importorskip("matplotlib")
    paths = report.plot(list(rows.values()), str(tmp_path), "t")
    assert [os.path.basename(p) for p in paths] == list(report.PLOTS)


# -- running -------------------------------------------------------------------------------


def sweep(path, tmp_path, *extra):
    cmd = [sys.executable, "-m", "proxies", "sweep", str(path), "--results", str(tmp_path)]
    return run([*cmd, *extra], timeout=240)


@pytest.mark.slow
def test_predicted_points_run_without_the_launcher_and_resume(tmp_path):
    """A launcher that fails everything: predicted points never use it."""
    text = BASE + "launcher: 'false -n {ranks} {command}'\npredict_ranks: [4, 16]\n"
    path = write(tmp_path, text)
    r = sweep(path, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 to run, 0 done before" in r.stdout
    recs = results.load(str(tmp_path / "t" / "results.jsonl"))
    assert [(x["point"]["ranks"], x["status"], x["point"]["predicted"]) for x in recs] == [
        (4, "ok", True),
        (16, "ok", True),
    ]
    for x in recs:
        assert x["command"][0] == sys.executable and x["command"][-3:] == [
            "--dry-run",
            "--world-size",
            str(x["point"]["ranks"]),
        ]
        res = x["result"]
        assert res["world_size"] == x["point"]["ranks"] and res["predicted_iter_time_s"] > 0
        assert "10 GbE cluster" in res["prediction"] and "iter_time_s" not in res
    assert "(pred)" in r.stdout and "predicted" in r.stdout
    again = sweep(path, tmp_path)
    assert again.returncode == 0 and "0 to run, 2 done before" in again.stdout
    assert len(results.load(str(tmp_path / "t" / "results.jsonl"))) == 2


@pytest.mark.slow
def test_measured_point_carries_its_prediction(tmp_path):
    path = write(tmp_path, BASE + "ranks: [2]\npredict_ranks: [4]\n")
    r = sweep(path, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    recs = {x["point"]["ranks"]: x for x in results.load(str(tmp_path / "t" / "results.jsonl"))}
    measured = recs[2]["result"]
    assert measured["world_size"] == 2 and measured["iter_time_s"]
    assert measured["predicted_iter_time_s"] > 0 and "--machine" in recs[2]["command"]
    with open(tmp_path / "t" / "report.csv") as f:
        rows = {int(x["ranks"]): x for x in csv.DictReader(f)}
    t = sum(measured["iter_time_s"]) / len(measured["iter_time_s"])
    p = measured["predicted_iter_time_s"]
    assert float(rows[2]["predicted_s"]) == pytest.approx(p, rel=1e-12)
    assert float(rows[2]["error"]) == pytest.approx((p - t) / t, rel=1e-9)
    p4 = recs[4]["result"]["predicted_iter_time_s"]
    assert float(rows[4]["speedup"]) == pytest.approx(p / p4, rel=1e-12)


@pytest.mark.slow  # plans five 175B layouts of up to 12,288 ranks: seconds
def test_shipped_gpt3_predict_config():
    """All predicted, tp 8 x 16 stages x DP 1, 2, 8, 32, 96 on the DGX A100 model, 8 ranks
    per node; the proxy plans every point (its precheck dry run accepts them all)."""
    path = os.path.join(ROOT, "configs", "gpt3-predict.yaml")
    ps = expand(load(path))
    assert [(p.ranks, p.predicted) for p in ps] == [(128 * dp, True) for dp in (1, 2, 8, 32, 96)]
    m = ps[0].run.machine
    assert m.path == os.path.join(ROOT, "configs", "machines", "dgx-a100.yaml")
    assert m.ranks_per_node == 8 and ps[0].run.scaling == "weak"
    assert " ".join(ps[0].argv).startswith("96 16 --model gpt3-175b --tp 8 --order megatron")
    assert launch.precheck(ps) == {}
