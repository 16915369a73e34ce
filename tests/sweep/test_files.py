"""Sweep files without MPI: schema errors (one message naming file, key and problem),
expansion into points, launch commands, the Slurm script, results lines, report numbers."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from launch import ROOT

from proxies.sweep import expr, launch, report, results, runner
from proxies.sweep.schema import SweepError, expand, load

TINY = """
name: t
proxy: gpt2
ranks: [1, 2]
precheck: false
args:
  layers: 2
  model: gpt2-tiny
  seq_len: 16
  iters: 1
  warmup: 0
"""


def write(tmp_path, text: str, name: str = "s.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def points(tmp_path, text: str):
    return expand(load(write(tmp_path, text)))


def error(tmp_path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(SweepError) as e:
        expand(load(path))
    msg = str(e.value)
    assert msg.startswith(f"{path}: "), msg
    assert "\n" not in msg
    return msg[len(path) + 2 :]


# -- schema errors: each kind -------------------------------------------------------------

SCHEMA_ERRORS = [
    # (what, text appended or replacing, expected start of "KEY: problem")
    ("unknown key", TINY + "colour: red\n", "colour: unknown key"),
    ("unknown run key", "runs:\n  - proxy: gpt2\n    rank: [1]\n", "runs[0].rank: unknown key"),
    ("ranks type", TINY.replace("[1, 2]", "four"), "ranks: expected positive integers"),
    ("ranks positive", TINY.replace("[1, 2]", "[0, 2]"), "ranks: rank counts must be positive"),
    ("repeat type", TINY + "repeat: twice\n", "repeat: expected an integer, got a string"),
    ("repeat bool", TINY + "repeat: true\n", "repeat: expected an integer, got a boolean"),
    ("timeout", TINY + "timeout: -1\n", "timeout: expected a positive number"),
    ("scaling", TINY + "scaling: sideways\n", "scaling: expected strong or weak"),
    ("launcher", TINY + "launcher: mpiexec -n 4\n", "launcher: 'mpiexec -n 4': expected"),
    ("launcher braces", TINY + "launcher: 'x {nodes} {ranks} {command}'\n", "launcher: "),
    ("env", TINY + "env: {A: [1]}\n", "env.A: expected a string or number"),
    ("name", TINY.replace("name: t", "name: ../up"), "name: '../up': use letters"),
    ("missing proxy", "ranks: [1]\n", "proxy: missing"),
    ("missing ranks", "proxy: gpt2\n", "ranks: missing"),
    ("proxy name", TINY.replace("proxy: gpt2", "proxy: gpt2/../x"), "proxy: 'gpt2/../x' is not"),
    ("args type", TINY.replace("  layers: 2", "  layers: two"), "args.layers: expected a positive"),
    (
        "args option",
        TINY + "  colour: red\n",
        "args.colour: python -m proxies.gpt2 has no argument",
    ),
    (
        "args choice",
        TINY.replace("gpt2-tiny", "gpt2-huge"),
        "args.model: 'gpt2-huge' is not one of",
    ),
    ("args flag", TINY + "  check: 3\n", "args.check: --check is a flag: expected true or false"),
    ("args twice", TINY + "  seq-len: 8\n", "args.seq-len: given twice"),
    ("args bool for option", TINY + "  schedule: true\n", "args.schedule: expected a value"),
    ("args reserved", TINY + "  json: x.json\n", "args.json: set by the sweep itself"),
    ("args mapping", TINY + "  stages: {ranks}\n", "args.stages: a mapping is not a value; write"),
    ("args empty list", TINY + "  stages: []\n", "args.stages: an empty list gives no points"),
    ("expression name", TINY + '  stages: "{ranks // pipes}"\n', "args.stages: at ranks = 1:"),
    ("expression syntax", TINY + '  stages: "{ranks //}"\n', "args.stages: cannot parse"),
    ("expression call", TINY + '  stages: "{open(1)}"\n', "args.stages: 'open(1)': only min"),
    (
        "expression value",
        TINY + '  stages: "{ranks - 1}"\n',
        "args.stages = 0 (at ranks = 1): expected a positive integer",
    ),
    ("positional gap", TINY.replace("  layers: 2\n", "  stages: 2\n"), "args: layers is left out"),
    ("skip rule", TINY + "skip:\n  - colour: 1\n", "skip[0].colour: unknown rule"),
    ("skip shape", TINY + "skip:\n  - divisible: [ranks]\n", "skip[0].divisible: expected [a, b]"),
    ("skip name", TINY + "skip:\n  - require: 'pipes > 1'\n", "skip[0].require: 'pipes > 1'"),
    (
        "runs type",
        "runs: {proxy: gpt2}\n",
        "runs: expected a non-empty list of runs, got a mapping",
    ),
    (
        "duplicate points",
        "ranks: [1]\nprecheck: false\nruns:\n  - proxy: gpt2\n  - proxy: gpt2\n    label: b\n",
        "runs[1]: point b · 1 ranks",
    ),
    ("yaml", TINY + "args: [\n", "line "),
]


@pytest.mark.parametrize("what,text,want", SCHEMA_ERRORS, ids=[e[0] for e in SCHEMA_ERRORS])
def test_schema_error_names_key_and_problem(tmp_path, what, text, want):
    assert error(tmp_path, text).startswith(want)


def test_not_a_mapping_and_missing_file(tmp_path):
    assert error(tmp_path, "- 1\n").startswith("expected a mapping")
    with pytest.raises(SweepError, match="nope.yaml: cannot read"):
        load(str(tmp_path / "nope.yaml"))


@pytest.mark.slow
def test_bad_file_exits_2_with_one_line(tmp_path):
    path = write(tmp_path, TINY + "colour: red\n")
    r = subprocess.run(
        [sys.executable, "-m", "proxies", "sweep", path, "--print-commands"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.strip() == f"proxies sweep: error: {path}: colour: unknown key " + (
        "(allowed: name, description, launcher, sbatch, runs, label, proxy, ranks, args, "
        "repeat, timeout, env, skip, scaling, precheck, machine, machine_set, ranks_per_node, "
        "predict, predict_ranks)"
    )
    assert r.stdout == ""


def test_impossible_point_is_an_error_unless_skipped(tmp_path, capsys):
    """The proxy's own --dry-run decides; its message is the error, or the skip reason."""
    bad = TINY.replace("precheck: false", "precheck: true") + "  stages: 2\n"
    path = write(tmp_path, bad.replace("[1, 2]", "[1]"))
    assert runner.main([path, "--print-commands"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"proxies sweep: error: {path}: args: the point gpt2 · 1 ranks")
    assert "world size 1 is not a multiple of STAGES = 2" in err

    path = write(tmp_path, bad + "skip:\n  - proxy_rejects: true\n")
    assert runner.main([path, "--print-commands"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("# skipped: gpt2 · 1 ranks")
    assert out[1].endswith(
        "rejected by the proxy: proxies.gpt2: error: world size 1 is not a "
        "multiple of STAGES = 2 (the data-parallel degree is world size / STAGES)"
    )
    assert " -n 2 " in out[2] and out[2].count("proxies.gpt2 2 2 ") == 1


# -- expansion ----------------------------------------------------------------------------


def test_lists_form_a_product_and_rules_skip_with_reasons(tmp_path):
    ps = points(
        tmp_path,
        TINY.replace("[1, 2]", "[1, 2, 4]")
        + "  stages: [1, 2]\n  micro_batches: '{8 * stages // ranks}'\n  check: [true, false]\n"
        + "repeat: 2\nskip:\n  - divisible: [ranks, stages]\n"
        + "  - require: 'micro_batches >= stages'\n",
    )
    assert len(ps) == 3 * 2 * 2 * 2
    by = {(p.ranks, dict(p.args)["stages"], dict(p.args)["check"], p.repeat): p for p in ps}
    p = by[(4, 2, True, 1)]
    assert dict(p.args)["micro_batches"] == 4 and p.skip is None
    assert " ".join(p.argv) == "2 2 4 --model gpt2-tiny --seq-len 16 --iters 1 --warmup 0 --check"
    assert "--check" not in by[(4, 2, False, 0)].argv
    assert by[(1, 2, True, 0)].skip == "needs ranks % stages == 0 (ranks = 1, stages = 2)"
    # The series is the combination before expressions: one line across rank counts.
    assert by[(1, 1, True, 0)].series_id == by[(4, 1, True, 0)].series_id
    assert by[(1, 1, True, 0)].id != by[(1, 1, True, 1)].id  # repeats are points
    assert len({p.id for p in ps}) == len(ps)


def test_identity_is_canonical(tmp_path):
    a = points(tmp_path, TINY)
    swapped = TINY.replace("  layers: 2\n  model: gpt2-tiny\n", "  model: gpt2-tiny\n  layers: 2\n")
    b = points(tmp_path, swapped.replace("seq_len", "seq-len"))
    assert [p.id for p in a] == [p.id for p in b]
    assert json.loads(a[0].id) == {
        "proxy": "gpt2",
        "ranks": 1,
        "repeat": 0,
        "args": {"layers": 2, "model": "gpt2-tiny", "seq_len": 16, "iters": 1, "warmup": 0},
    }


def test_runs_inherit_top_level_and_a_misspelt_proxy_is_an_error(tmp_path):
    ps = points(tmp_path, TINY + "runs:\n  - args: {layers: 1}\n    env: {X: 1}\n  - timeout: 5\n")
    assert [dict(p.args)["layers"] for p in ps] == [1, 1, 2, 2]
    assert dict(ps[0].args)["model"] == "gpt2-tiny" and ps[0].run.env == (("X", "1"),)
    assert ps[2].run.timeout == 5.0 and ps[0].run.timeout == 1800.0
    # Not every point skipped with exit 0: the file is wrong, and the message says how.
    msg = error(tmp_path, TINY + "runs:\n  - args: {layers: 1}\n  - proxy: gtp2\n")
    assert msg == "runs[1].proxy: no proxy 'gtp2' (did you mean gpt2? proxies: " + (
        "bert, cosmoflow, dlrm, gpt2, gpt3, llama, resnet)"
    )
    msg = error(tmp_path, TINY.replace("gpt2", "zzz"))
    assert msg.startswith("proxy: no proxy 'zzz' (proxies:")


def test_expressions_are_safe_and_small():
    assert expr.evaluate("max(1, 32 * s // r) if r > 0 else 0", {"s": 2, "r": 8}) == 8
    assert expr.evaluate("r % s == 0 and not r < s", {"r": 4, "s": 2}) is True
    for bad in ("__import__('os')", "r.real", "[1][0]", "lambda: 1", "r ** 2"):
        with pytest.raises(expr.ExprError):
            expr.evaluate(bad, {"r": 1})
    with pytest.raises(expr.ExprError, match="division by zero"):
        expr.evaluate("1 // r", {"r": 0})


# -- commands -----------------------------------------------------------------------------


def test_launcher_templates(tmp_path):
    p = points(tmp_path, TINY + "env: {OMP_NUM_THREADS: 1}\n")[1]
    cmd = launch.command(p, "srun --mpi=pmi2 -n {ranks} {command}", "r.json")
    assert cmd[:4] == ["srun", "--mpi=pmi2", "-n", "2"]
    assert cmd[4:] == [sys.executable, "-m", "proxies.gpt2", "2", *p.argv[1:], "--json", "r.json"]
    cmd = launch.command(p, "mpiexec", None)
    assert os.path.basename(cmd[0]) == "mpiexec" and cmd[1:3] == ["-n", "2"]
    assert launch.environment(p)["OMP_NUM_THREADS"] == "1"
    for bad in ("{command}", "mpiexec -n {ranks}", "a {ranks} {command} {command}"):
        with pytest.raises(ValueError):
            launch.template(bad)


def test_print_commands(tmp_path, capsys):
    path = write(tmp_path, TINY + "env: {A: b c}\nskip:\n  - require: 'ranks > 1'\n")
    assert runner.main([path, "--print-commands", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"# sweep t ({path}): 2 points, 1 to run, 1 skipped")
    assert out[1] == (
        "# skipped: gpt2 · 1 ranks · layers=2 model=gpt2-tiny seq_len=16 iters=1 warmup=0: "
        "needs ranks > 1 (ranks = 1)"
    )
    want = (
        rf"A='b c' \S*mpiexec -n 2 {re.escape(sys.executable)} -m proxies.gpt2 2 --model "
        rf"gpt2-tiny --seq-len 16 --iters 1 --warmup 0 --json {tmp_path}/t/0001-gpt2-2r-\w+\.json"
    )
    assert re.fullmatch(want, out[2]), out[2]
    assert not (tmp_path / "t").exists()  # nothing ran


@pytest.mark.slow
def test_sbatch_script(tmp_path, capsys):
    text = TINY.replace("[1, 2]", "[2, 8]") + "timeout: 100\nsbatch: {partition: debug}\n"
    path = write(tmp_path, text)
    job = tmp_path / "job.sh"
    code = runner.main(
        [path, "--sbatch", str(job), "--launcher", "srun", "--results", str(tmp_path)]
    )
    assert code == 0
    text = job.read_text()
    assert "#SBATCH --ntasks=8\n" in text
    assert "#SBATCH --time=0-00:13:20\n" in text  # 2 x 100 s + 10 min
    assert "#SBATCH --partition=debug\n" in text
    assert f"-m proxies sweep {path} --results {tmp_path} --launcher srun\n" in text
    assert subprocess.run(["bash", "-n", str(job)]).returncode == 0


def test_every_config_expands():
    """Every shipped sweep file is valid against the proxies' parsers (no precheck here:
    the reference sizes plan up to 1024 ranks)."""
    configs = os.path.join(ROOT, "configs")
    names = sorted(f for f in os.listdir(configs) if f.endswith(".yaml"))
    assert "smoke.yaml" in names and "gpt2-scaling.yaml" in names
    for name in names:
        sweep = load(os.path.join(configs, name))
        assert sweep.name == name.removesuffix(".yaml")
        assert expand(sweep), name


# -- results and report -------------------------------------------------------------------


def test_append_is_whole_lines_and_torn_lines_are_skipped(tmp_path, capsys):
    path = str(tmp_path / "r.jsonl")
    results.append(path, record("a", 1, [1.0]))
    with open(path, "a") as f:
        f.write('{"point": {"id": "b"}, "sta')  # a crash mid-line
    results.append(path, record("c", 1, [1.0]))
    got = results.load(path)
    assert [r["point"]["label"] for r in got] == ["a", "c"]
    assert "r.jsonl:2: skipping a line: not a complete JSON record" in capsys.readouterr().err


def record(label, ranks, t, status="ok", scaling="strong", repeat=0, series=None, **bd):
    series = series or {"layers": 2}
    point = {
        "id": json.dumps([label, ranks, repeat, series]),
        "label": label,
        "proxy": "gpt2",
        "ranks": ranks,
        "args": {**series, "ranks_seen": ranks},
        "repeat": repeat,
        "series": series,
        "series_id": json.dumps([label, series]),
        "scaling": scaling,
    }
    rec = {"point": point, "status": status, "describe": label}
    if status == "ok":
        rec["result"] = {"iter_time_s": t, "breakdown_s": bd}
    else:
        rec["stderr_tail"] = "boom\nlast line"
    return rec


def test_speedup_and_efficiency():
    recs = [
        record("s", 1, [1.0, 3.0], compute=[1.5, 1.5]),
        record("s", 4, [0.5, 0.5], compute=[0.25, 0.25], idle=[0.1, 0.3]),
        record("s", 4, [1.0, 1.0], repeat=1, compute=[0.75, 0.75]),
        record("s", 8, None, status="failed"),
        record("w", 2, [1.0], scaling="weak"),
        record("w", 8, [1.25], scaling="weak"),
        record("w", 8, [9.0], scaling="weak", series={"layers": 4}),
    ]
    rows = {(r["label"], r["ranks"], r["series"]): r for r in report.rows(recs)}
    s1, s4, s8 = rows[("s", 1, "")], rows[("s", 4, "")], rows[("s", 8, "")]
    assert s1["iter_time_s"] == 2.0 and s4["iter_time_s"] == 0.75  # mean over iters, repeats
    assert s4["repeats"] == 2 and s4["speedup"] == pytest.approx(2.0 / 0.75)
    assert s4["efficiency"] == pytest.approx(2.0 / 0.75 / 4)
    assert s4["breakdown_s"] == {"compute": 0.5, "idle": 0.1}
    assert s8["status"] == "failed" and s8["reason"] == "last line" and s8["speedup"] is None
    w8 = rows[("w", 8, "layers=2")]
    assert w8["efficiency"] == pytest.approx(0.8) and w8["speedup"] == pytest.approx(3.2)
    assert rows[("w", 8, "layers=4")]["efficiency"] == 1.0  # its own series, its own base


@pytest.mark.slow
def test_report_cli_errors(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "proxies", "report", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 2 and "results.jsonl: no such file" in r.stderr


def test_csv_and_plots(tmp_path):
    rows = report.rows(
        [
            record("s", 1, [1.0], compute=[0.9], idle=[0.1]),
            record("s", 2, [0.6], compute=[0.45], idle=[0.15]),
            record("s", 4, None, status="timeout"),
        ]
    )
    report.write_csv(rows, str(tmp_path / "report.csv"))
    text = (tmp_path / "report.csv").read_text().splitlines()
    assert text[0].startswith("label,series,proxy,scaling,ranks,status,repeats,iter_time_s,")
    assert len(text) == 4 and ",timeout," in text[3]
    pytest.importorskip("matplotlib")
    paths = report.plot(rows, str(tmp_path), "t")
    assert [os.path.basename(p) for p in paths] == list(report.PLOTS)
    assert all(open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for p in paths)
