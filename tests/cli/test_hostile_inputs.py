"""Hostile input: every numeric option of every entry point, outputs, divergence, environment.

The generated test walks each entry point's argparse parser and feeds every numeric option
(and numeric positional) the values that used to slip through: 0, -1, nan, inf, 1e20, a
float where an integer is due, an empty string. Each must be refused (exit 2, one line) or be
in ACCEPTED below, deliberately, with the value it must parse to. In-process: parsing is the
whole check and takes milliseconds; a few end-to-end runs prove the status and the one line.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
from launch import ROOT, flavour, mpiexec, mpirun, run

from proxies.core import cli, exits, report, threads


@functools.cache
def _bench(name: str):
    spec = importlib.util.spec_from_file_location(
        f"bench_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _module(name: str):
    return importlib.import_module(name)


# entry point -> (parser factory, arguments it needs besides the one under test)
ENTRY_POINTS = {
    "proxies.gpt2": (lambda: _module("proxies.gpt2.proxy").parser(), []),
    "proxies.gpt3": (lambda: _module("proxies.gpt3.proxy").parser(), []),
    "proxies.llama": (lambda: _module("proxies.llama.proxy").parser(), []),
    "proxies.bert": (lambda: _module("proxies.bert.proxy").parser(), []),
    "proxies.cosmoflow": (lambda: _module("proxies.cosmoflow.proxy").parser(), []),
    "proxies.dlrm": (lambda: _module("proxies.dlrm.proxy").parser(), []),
    "proxies.resnet": (lambda: _module("proxies.resnet.proxy").parser(), []),
    "proxies.collectives": (lambda: _module("proxies.collectives.bench").parser(), []),
    "proxies.calibrate": (lambda: _module("proxies.calibrate.main").parser(), ["-o", "m.yaml"]),
    "proxies.calibrate.probe": (lambda: _module("proxies.calibrate.probe").parser(), []),
    "benchmarks/gpt2_step.py": (lambda: _bench("gpt2_step").parser(), []),
    "proxies.sweep": (lambda: _module("proxies.sweep.runner").parser(), ["s.yaml"]),
    "benchmarks/predict.py": (lambda: _bench("predict").parser(), []),
    "benchmarks/gpt3_comm.py": (lambda: _bench("gpt3_comm").parser(), []),
}

HOSTILE = ["0", "-1", "nan", "inf", "-inf", "1e20", "100000000000000000000", "2.5", "", "x"]

# Deliberately accepted hostile values: (entry point, option) -> {value: what it parses to}.
# 0 where 0 means something (no warm-up, seed 0, watchdog off, no cap, ...); 2.5 where the
# option is a real number and 2.5 is in its range.
ZERO = {"0": 0}
GPTS = ("proxies.gpt2", "proxies.gpt3", "proxies.llama", "proxies.bert")  # gpt3's options: 1..
ACCEPTED: dict[tuple[str, str], dict[str, float]] = {
    **{
        (p, o): ZERO
        for p in (*GPTS, "proxies.cosmoflow", "proxies.dlrm")
        for o in ("--warmup", "--seed")
    },
    **{
        (p, o): {"2.5": 2.5}
        for p in (*GPTS, "proxies.cosmoflow", "proxies.dlrm")
        for o in ("--device-tflops", "--lr")
    },
    **{
        (p, "--timeout"): {"0": 0, "2.5": 2.5}  # 0: the watchdog off
        for p in (*GPTS, "proxies.cosmoflow", "proxies.dlrm")
    },
    ("proxies.gpt2", "--bucket-mb"): {"0": 0, "2.5": 2.5},
    ("proxies.gpt2", "--zero"): ZERO,
    ("proxies.gpt2", "--weight-decay"): ZERO,
    **{(p, "--weight-decay"): ZERO for p in GPTS[1:]},
    **{(p, "--capacity-factor"): {"2.5": 2.5} for p in GPTS[1:3]},
    **{(p, "--moe-experts"): ZERO for p in GPTS[1:3]},
    **{(p, "--bucket-mb"): {"0": 0, "2.5": 2.5} for p in GPTS[1:]},
    **{(p, "--dp-bucket"): ZERO for p in GPTS[1:3]},
    **{(p, "--inflight-buckets"): ZERO for p in GPTS[1:]},
    ("proxies.cosmoflow", "--momentum"): ZERO,
    ("proxies.dlrm", "--max-rows"): ZERO,
    **{("proxies.resnet", o): ZERO for o in ("--warmup", "--seed", "--momentum", "--weight-decay")},
    **{("proxies.resnet", o): {"2.5": 2.5} for o in ("--device-tflops", "--lr")},
    ("proxies.resnet", "--timeout"): {"0": 0, "2.5": 2.5},
    ("proxies.resnet", "--bucket-mb"): {"0": 0, "2.5": 2.5},
    # nccl-tests' spellings: --warmup_iters 0, --check 0 (off), --root 0, -I 0 (off), -K 0
    **{
        ("proxies.collectives", o): ZERO
        for o in ("--warmup_iters", "--check", "--root", "--per_iter_timing", "--per_iter_skip")
    },
    ("benchmarks/gpt2_step.py", "--warmup"): ZERO,
    ("benchmarks/gpt2_step.py", "--seed"): ZERO,
    ("benchmarks/predict.py", "--timeout"): {"2.5": 2.5},
    ("benchmarks/predict.py", "--target"): {"2.5": 2.5},
    ("benchmarks/predict.py", "--tflops"): {"2.5": 2.5},
    ("benchmarks/gpt3_comm.py", "--warmup"): ZERO,
    ("benchmarks/gpt3_comm.py", "--timeout"): {"2.5": 2.5},
}


def numeric_actions(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """Actions that take a number: a `type` other than str, or a numeric default."""
    out = []
    for a in p._actions:
        if a.nargs == 0 or isinstance(a, argparse._HelpAction):
            continue
        numeric_default = isinstance(a.default, int | float) and not isinstance(a.default, bool)
        if (a.type is not None and a.type is not str) or numeric_default:
            out.append(a)
    return out


def name_of(a: argparse.Action) -> str:
    return max(a.option_strings, key=len) if a.option_strings else a.dest


def argv_for(p, base: list[str], a: argparse.Action, value: str) -> list[str]:
    if a.option_strings:  # "--opt=-1": a value that starts with "-" is not an option
        return [*base, f"{name_of(a)}={value}"]
    # a positional: the ones before it get a valid value
    before = []
    for b in p._actions:
        if b is a:
            break
        if not b.option_strings:
            before.append("2")
    return [*base, *before, value]


def cases():
    for entry, (make, _) in ENTRY_POINTS.items():
        p = make()
        for a in numeric_actions(p):
            for value in HOSTILE:
                yield pytest.param(entry, name_of(a), value, id=f"{entry} {name_of(a)} {value!r}")


def outcome(entry: str, option: str, value: str, capsys) -> tuple[str, object]:
    make, base = ENTRY_POINTS[entry]
    p = make()
    a = next(a for a in numeric_actions(p) if name_of(a) == option)
    try:
        ns = p.parse_args(argv_for(p, base, a, value))
    except cli.UsageError as e:
        return "refused", str(e)
    except SystemExit as e:  # a plain argparse parser: usage and the error, exit 2
        return ("refused" if e.code == exits.USAGE else f"exit {e.code}"), capsys.readouterr().err
    return "accepted", getattr(ns, a.dest)


@pytest.mark.parametrize("entry,option,value", list(cases()))
def test_every_numeric_option_refuses_hostile_values(entry, option, value, capsys):
    kind, detail = outcome(entry, option, value, capsys)
    accepted = ACCEPTED.get((entry, option), {})
    if value in accepted:
        assert kind == "accepted", detail
        assert detail == accepted[value]
        return
    assert kind == "refused", f"{entry} {option} {value!r}: {kind} as {detail!r}"
    text = str(detail).strip().splitlines()[-1]
    assert option in text or option.upper() in text or "argument" in text, text
    assert "Traceback" not in str(detail)


def test_the_walk_finds_the_options_and_no_bare_types():
    """The generated test covers what it claims: numeric options found in every proxy, and
    no parser uses a bare int/float type (which lets nan, inf and truncation through)."""
    found = {}
    for entry, (make, _) in ENTRY_POINTS.items():
        actions = numeric_actions(make())
        found[entry] = {name_of(a) for a in actions}
        for a in actions:
            assert a.type not in (int, float), f"{entry} {name_of(a)}: bare {a.type.__name__}"
    for entry in ("proxies.gpt2", "proxies.gpt3", "proxies.cosmoflow", "proxies.dlrm"):
        assert {"--iters", "--warmup", "--timeout", "--device-tflops", "--lr"} <= found[entry]
    assert {"layers", "stages", "micro_batches"} <= found["proxies.gpt2"]
    assert {"--batch", "--image-size", "--classes", "--bucket-mb"} <= found["proxies.resnet"]
    assert {"--minbytes", "--stepfactor", "--iters"} <= found["proxies.collectives"]
    assert found["proxies.sweep"] == set()  # no numeric option today: nothing to check
    # every deliberate acceptance names a real option
    for entry, option in ACCEPTED:
        assert option in found[entry], (entry, option)


@pytest.mark.parametrize(
    "text,value",
    [("1", 1.0), (" 3 ", 3.0), ("1e-3", 0.001), ("-0", 0.0)],
)
def test_number_accepts_finite_values_in_range(text, value):
    t = cli.number(min=0, max=10)
    assert t(text) == value and math.copysign(1, t(text)) == 1


def test_integer_never_truncates():
    for text in ("2.0", "2.5", "1e3", "0x10", "", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli.positive_int(text)
    assert cli.positive_int("+7") == 7 and cli.integer(min=-3)("-3") == -3


def test_ranges_at_their_ends():
    assert cli.timeout_seconds("0") == 0 and cli.timeout_seconds("1") == 1
    for bad in ("0.5", "1e-9", "-5", "1e7"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli.timeout_seconds(bad)
    assert cli.device_tflops(str(cli.TFLOPS_MIN)) == cli.TFLOPS_MIN
    with pytest.raises(argparse.ArgumentTypeError):
        cli.device_tflops("1e-300")
    assert cli.learning_rate("10") == 10
    for t, bad in ((cli.learning_rate, "0"), (cli.momentum, "1"), (cli.weight_decay, "1.5")):
        with pytest.raises(argparse.ArgumentTypeError):
            t(bad)


# -- end to end: exit status and one line ---------------------------------------------------


def one_line(r, prog: str) -> str:
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == exits.USAGE, (r.returncode, r.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    return lines[0]


E2E = [
    ("proxies.gpt2", ["2", "--timeout", "nan"], "--timeout"),
    ("proxies.gpt2", ["2", "--timeout", "1e-9"], "--timeout"),
    ("proxies.gpt2", ["2", "--lr", "1e300"], "--lr"),
    ("proxies.gpt2", ["2", "--weight-decay", "nan"], "--weight-decay"),
    ("proxies.gpt3", ["--device-tflops", "1e-300"], "--device-tflops"),
    ("proxies.gpt3", ["--micro-batches", "2.0"], "--micro-batches"),
    ("proxies.cosmoflow", ["--momentum", "inf"], "--momentum"),
    ("proxies.dlrm", ["--batch", ""], "--batch"),
    ("proxies.resnet", ["--image-size", "1e20"], "--image-size"),
    ("proxies.collectives", ["-n", "1e20"], "--iters"),
    ("proxies.calibrate", ["-o", "m.yaml", "--ranks-per-node", "-1"], "--ranks-per-node"),
]


@pytest.mark.slow
@pytest.mark.parametrize("module,args,option", E2E, ids=[" ".join(c[1]) for c in E2E])
def test_hostile_value_end_to_end(module, args, option):
    r = run([sys.executable, "-m", module, *args], timeout=60)
    assert option in one_line(r, module)


@pytest.mark.mpi
def test_hostile_value_under_mpiexec_prints_once():
    r = mpirun(2, "proxies.gpt2", "2", "--timeout", "-5", timeout=60)
    assert "--timeout" in one_line(r, "proxies.gpt2")


# -- outputs --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "path,words",
    [
        ("/proc/x.json", "not a place for results"),
        ("/sys/x.json", "not a place for results"),
        ("{tmp}", "is a directory"),
        ("{tmp}/no/such/x.json", "no such directory"),
        ("", "empty path"),
    ],
)
@pytest.mark.parametrize("module", ["proxies.gpt2", "proxies.collectives"])
def test_unwritable_output_is_refused_before_the_run(module, path, words, tmp_path):
    path = path.format(tmp=tmp_path)
    r = run([sys.executable, "-m", module, "--json", path, "--iters", "1"], timeout=60)
    assert words in one_line(r, module)
    assert os.listdir(tmp_path) == []  # nothing left behind


@pytest.mark.slow
def test_dry_run_output_is_checked_before_planning():
    r = run([sys.executable, "-m", "proxies.gpt3", "--dry-run", "--json", "/proc/x"], timeout=60)
    assert "--json /proc/x" in one_line(r, "proxies.gpt3")


@pytest.mark.mpi
def test_calibrate_output_uses_the_same_check(tmp_path):
    r = mpirun(2, "proxies.calibrate", "-o", str(tmp_path), "--quick", timeout=60)
    assert "is a directory" in one_line(r, "proxies.calibrate")


def test_a_failing_write_falls_back_and_says_where(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    gone = tmp_path / "removed" / "r.json"  # the folder vanished after the check
    written = report.write_json(str(gone), {"iter_time_s": [1.0]}, prog="p")
    assert written is not None and os.path.dirname(written) == str(tmp_path)
    assert json.loads(open(written).read()) == {"iter_time_s": [1.0]}
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(gone) in err and written in err
    assert os.listdir(tmp_path) == [os.path.basename(written)]  # no stray temp file


def test_when_nothing_can_be_written_none_and_no_temp_file(tmp_path, monkeypatch, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.chdir(locked)
    monkeypatch.setattr(report.tempfile, "gettempdir", lambda: str(locked))
    monkeypatch.setattr(report, "_write_atomic", lambda path, text: "No space left on device")
    assert report.write_json(str(tmp_path / "r.json"), {}, prog="p") is None
    assert "nor a fallback" in capsys.readouterr().err
    # the real writer cleans its temp file up when the replace fails
    target = tmp_path / "adir"
    target.mkdir()
    (target / "x").write_text("")  # a non-empty folder cannot be replaced by a file
    monkeypatch.undo()
    assert report._write_atomic(str(target), "{}") is not None
    assert sorted(os.listdir(tmp_path)) == ["adir", "locked"]


# -- divergence -----------------------------------------------------------------------------


@pytest.mark.mpi
def test_a_diverging_run_exits_6_with_its_results_written(tmp_path):
    out = tmp_path / "r.json"
    # dlrm-tiny's SGD at lr 10 overflows: loss inf/nan within 6 iterations (deterministic)
    r = mpirun(
        2, "proxies.dlrm", "--model", "dlrm-tiny", "--lr", "10", "--iters", "6", "--warmup",
        "0", "--quiet", "--json", str(out), timeout=120,
    )  # fmt: skip
    assert r.returncode == exits.DIVERGED, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "loss is not finite from iteration" in lines[0], r.stderr
    assert "time per iteration" in r.stdout  # the report was printed
    loss = json.loads(out.read_text())["loss"]  # strict JSON: null for non-finite
    assert loss[0] is not None and None in loss
    first = loss.index(None)
    assert f"from iteration {first} " in lines[0]


# -- environment ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,count",
    [("3", 3), ("4,2", 4), (" 2 ", 2), ("abc", None), ("0", None), ("-1", None), ("", None),
     ("4,x", None), ("1.5", None)],
)  # fmt: skip
def test_omp_num_threads_as_openmp_reads_it(value, count):
    assert threads.parse_threads(value) == count


def blas_decision(env: dict) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in threads.BLAS_VARS}
    base.pop(threads.AUTO_MARK, None)
    code = (
        "import proxies, os, json; from proxies.core import threads as t; "
        "print(json.dumps([t.decision, os.environ.get('OPENBLAS_NUM_THREADS')]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True
    )
    return json.loads(out.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("value", ["abc", "0", "-1"])
def test_invalid_omp_num_threads_is_ignored_and_reported(value):
    (n, _, cores, source), blas = blas_decision({"OMP_NUM_THREADS": value, "MPI_LOCALNRANKS": "1"})
    assert n == cores == int(blas)  # what the BLAS gets is what is reported
    assert f"OMP_NUM_THREADS={value!r} ignored" in source


@pytest.mark.slow
def test_nested_omp_num_threads_reports_the_outer_level():
    (n, _, _, source), _ = blas_decision({"OMP_NUM_THREADS": "4,2"})
    assert n == 4 and source.startswith("user (OMP_NUM_THREADS=4,2")


@pytest.mark.parametrize(
    "env,rank,size",
    [
        ({"PMI_RANK": "3"}, 0, None),  # no size: stale
        ({"PMI_RANK": "3", "PMI_SIZE": "4"}, 0, None),  # no PMI connection: no launcher
        ({"PMI_RANK": "3", "PMI_SIZE": "4", "PMI_FD": "9"}, 3, 4),  # hydra
        ({"PMI_RANK": "0", "PMI_SIZE": "2", "PMI_FD": "9"}, 0, 2),
        ({"PMI_RANK": "5", "PMI_SIZE": "4", "PMI_FD": "9"}, 0, None),  # rank >= size
        ({"PMI_RANK": "x", "PMI_SIZE": "4", "PMI_FD": "9"}, 0, None),
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"}, 2, 4),
        ({"SLURM_PROCID": "1"}, 0, None),
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, 1, 2),
    ],
)
def test_env_rank_trusts_only_consistent_launchers(env, rank, size, monkeypatch):
    for var in (*cli.RANK_VARS, *cli.SIZE_OF.values(), *cli.PMI_LINKS):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert (cli.env_rank(), cli.env_world_size()) == (rank, size)


@pytest.mark.slow
@pytest.mark.parametrize(
    "env", [{"PMI_RANK": "3"}, {"PMI_RANK": "3", "PMI_SIZE": "4"}, {"SLURM_PROCID": "7"}]
)
def test_a_stale_rank_variable_does_not_hide_errors(env):
    r = run([sys.executable, "-m", "proxies.gpt2", "2", "--bogus"], env=env, timeout=60)
    assert "unrecognized arguments: --bogus" in one_line(r, "proxies.gpt2")


@pytest.mark.mpi
def test_ctrl_c_is_one_line_and_exit_130():
    # A long run; SIGINT to the launcher's process group, as a terminal's Ctrl-C does.
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "proxies.gpt2", "2", "2", "--seq-len",
           "16", "--iters", "100000", "--quiet", "--timeout", "60"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        start_new_session=True,
    )  # fmt: skip
    time.sleep(4)  # past interpreter start-up (before it, Python itself owns Ctrl-C)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("Ctrl-C did not end the run") from None
    if flavour() == "openmpi":
        # Open MPI's launcher does not pass SIGINT on: it kills the ranks and exits 1 without
        # a word (README, "Choosing the MPI"). What holds: the run ends, no traceback.
        assert proc.returncode != 0 and "Traceback" not in err + out, (proc.returncode, err)
        return
    assert proc.returncode == exits.INTERRUPTED, (proc.returncode, err)
    assert "Traceback" not in err and "Traceback" not in out
    assert err.count("interrupted") == 1, err
