"""Hostile sweep files and options: each is one line on stderr and an exact exit status
(exits.py), before any point runs; never a traceback, a hang or a silent surprise.
Expressions: every exploding input is refused (a seeded property test over the evaluator)."""

import os
import random
import shlex
import subprocess
import sys
import textwrap

import pytest
from launch import ROOT

from proxies.core import exits
from proxies.sweep import expr, preflight, runner, schema, yamlfile
from proxies.sweep.schema import MAX_POINTS, MAX_REPEAT, SweepError, expand, load

from .test_files import TINY  # the one tiny sweep file the sweep tests share


def write(tmp_path, text, name="s.yaml") -> str:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(textwrap.dedent(text))
    return str(path)


def sweep(tmp_path, path, *extra) -> int:
    """runner.main in-process (fast), results under tmp_path/res."""
    return runner.main([path, "--results", str(tmp_path / "res"), *extra])


def one_line_error(capsys, path: str | None = None) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("proxies sweep: error: "), err
    assert "Traceback" not in err
    msg = err.removeprefix("proxies sweep: error: ").rstrip("\n")
    if path:
        assert msg.startswith(f"{path}: "), msg
        msg = msg[len(path) + 2 :]
    return msg


def refused(tmp_path, capsys, text, *extra, status=exits.USAGE) -> str:
    """The file is refused by every mode: run, --print-commands and --sbatch."""
    path = write(tmp_path, text)
    msgs = set()
    for mode in ([], ["--print-commands"], ["--sbatch", str(tmp_path / "job.sh")]):
        assert sweep(tmp_path, path, *mode, *extra) == status
        msgs.add(one_line_error(capsys, path))
    assert len(msgs) == 1, msgs
    assert not (tmp_path / "res").exists() and not (tmp_path / "job.sh").exists()
    return msgs.pop()


# -- the file itself ------------------------------------------------------------------------

BIG = TINY + "description: '" + "x" * yamlfile.MAX_FILE_BYTES + "'\n"
BAD_BYTE = len(TINY) + len("description: caf")  # TINY is ASCII
FILES = [
    # (what, bytes or text, expected start of the message after the path)
    ("not UTF-8", TINY.encode() + b"description: caf\xe9\n", f"byte offset {BAD_BYTE} (line 12): "),
    ("duplicate key", TINY + "ranks: [4]\n", "line 12: 'ranks' is given twice in one mapping"),
    ("duplicate arg", TINY + "  layers: 4\n", "line 12: 'layers' is given twice in one mapping"),
    ("NUL", TINY + '  data: "a\\0b"\n', "args.data: holds a NUL character"),
    ("control char", TINY + "description: a\x07b\n", f"character {BAD_BYTE - 2}: not valid YAML"),
    ("huge integer", TINY.replace("layers: 2", "layers: " + "9" * 5000), "not a sweep file: "),
    (
        "nested",
        TINY + "description: " + "[" * 10**5 + "]" * 10**5 + "\n",
        "line 12: brackets nested",
    ),
    ("nested blocks", TINY + "".join(" " * i + f"k{i}:\n" for i in range(600)), "nested too deep"),
    ("too big", BIG, f"{len(BIG)} bytes: a sweep file may have at most {yamlfile.MAX_FILE_BYTES}"),
    (
        "billion laughs",
        TINY
        + "sbatch:\n  a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n"
        + "".join(
            f"  {c}: &{c} [{', '.join(['*' + p] * 10)}]\n"
            for p, c in zip("abcd", "bcde", strict=True)
        ),
        "more than 100000 values (aliases counted at each use)",
    ),
]


@pytest.mark.parametrize("what,text,want", FILES, ids=[f[0] for f in FILES])
def test_bad_file_is_one_line_exit_2(tmp_path, capsys, what, text, want):
    msg = refused(tmp_path, capsys, text)
    assert msg.startswith(want), msg


def test_duplicate_key_names_both_lines_and_merges_may_override(tmp_path, capsys):
    msg = refused(tmp_path, capsys, TINY + "ranks: [4]\n")
    assert msg == "line 12: 'ranks' is given twice in one mapping (first on line 4)"
    # A merge key brings defaults that the mapping may override: not a duplicate.
    text = (
        TINY + "runs:\n  - &r {label: a, timeout: 5}\n  - {<<: *r, label: b, args: {layers: 1}}\n"
    )
    ps = expand(load(write(tmp_path, text)))
    assert [(p.run.label, p.run.timeout) for p in ps][::2] == [("a", 5.0), ("b", 5.0)]


def test_not_a_regular_file_is_refused_without_reading(tmp_path, capsys):
    fifo = str(tmp_path / "fifo.yaml")
    os.mkfifo(fifo)  # reading it would block forever: no writer
    assert sweep(tmp_path, fifo) == exits.USAGE
    assert one_line_error(capsys, fifo) == "cannot read: not a regular file"
    for path in ("/dev/zero", str(tmp_path)):
        assert sweep(tmp_path, path) == exits.USAGE
        assert one_line_error(capsys, path).startswith("cannot read: ")


def test_reader_alone_bounds_nesting_without_recursion(tmp_path):
    path = write(tmp_path, "a: " + "[" * 40 + "]" * 40 + "\n")
    with pytest.raises(yamlfile.LoadError, match=r"a\[0\]\[0\].*: nested more than 32 deep"):
        yamlfile.read(path)


# -- keys and values ----------------------------------------------------------------------

VALUES = [
    ("env name with =", TINY + "env: {'A=B': 1}\n", "env.A=B: not a variable name"),
    ("env name digit", TINY + "env: {1A: 1}\n", "env.1A: not a variable name"),
    ("env NUL", TINY + 'env: {A: "x\\0"}\n', "env.A: holds a NUL character"),
    ("sbatch newline", TINY + 'sbatch: {partition: "debug\\nrm -rf ~"}\n', "sbatch.partition: "),
    ("sbatch key", TINY + "sbatch: {'part ition': debug}\n", "sbatch.part ition: expected a long"),
    ("sbatch null", TINY + "sbatch: {partition: }\n", "sbatch.partition: expected option"),
    ("timeout inf", TINY + "timeout: .inf\n", "timeout: expected a positive number of seconds"),
    ("timeout nan", TINY + "timeout: .nan\n", "timeout: expected a positive number of seconds"),
    (
        "timeout huge",
        TINY + "timeout: 1.0e+300\n",
        "timeout: expected a positive number of seconds",
    ),
    ("timeout zero", TINY + "timeout: 0\n", "timeout: expected a positive number of seconds"),
    ("repeat float", TINY + "repeat: 1.0e+9\n", "repeat: expected an integer, got a float"),
    ("repeat huge", TINY + "repeat: 1000000000\n", f"repeat: expected 1 to {MAX_REPEAT} repeats"),
    ("label newline", TINY + 'label: "a\\nb"\n', "label: 'a\\nb': a label may not hold a newline"),
    ("launcher newline", TINY + 'launcher: "mpiexec -n {ranks}\\n{command}"\n', "launcher: "),
    ("misspelt proxy", TINY.replace("proxy: gpt2", "proxy: gtp2"), "proxy: no proxy 'gtp2' (did"),
    (
        "too many points",  # counted before any point is made
        TINY.replace("  layers: 2\n", "  layers: &w [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]\n").replace(
            "  seq_len: 16\n", "  seq_len: *w\n"
        )
        + "  check: [true, false]\nrepeat: 300\n",
        f"args: 120000 points (200 argument combinations x (2 rank counts x 300 repeats + 0 "
        f"predicted)): a sweep may have at most {MAX_POINTS}",
    ),
]


@pytest.mark.parametrize("what,text,want", VALUES, ids=[v[0] for v in VALUES])
def test_bad_value_is_one_line_exit_2(tmp_path, capsys, what, text, want):
    msg = refused(tmp_path, capsys, text)
    assert msg.startswith(want), msg


def test_runs_are_counted_before_they_are_parsed(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(schema, "MAX_POINTS", 20)
    msg = refused(tmp_path, capsys, TINY + "runs: [" + ", ".join(["{}"] * 21) + "]\n")
    assert msg == "runs: 21 runs: a sweep may have at most 20 points"
    msg = refused(tmp_path, capsys, TINY + "runs: [{}, {ranks: [1, 2, 3, 4]}, {repeat: 8}]\n")
    assert msg.startswith("runs[2]: 16 points (1 argument combinations x (2 rank counts x 8 ")
    assert msg.endswith("predicted), 22 in all): a sweep may have at most 20")


def test_env_values_reach_the_point_and_sbatch_values_stay_on_their_line(tmp_path, capsys):
    text = TINY + "env: {A_1: 'x y'}\nsbatch: {partition: 'debug # not a line'}\n"
    path = write(tmp_path, text)
    job = tmp_path / "job.sh"
    assert sweep(tmp_path, path, "--sbatch", str(job)) == exits.OK
    lines = job.read_text().splitlines()
    assert "#SBATCH --partition=debug # not a line" in lines
    assert sum(not x.startswith("#") for x in lines) == 3  # set, cd, exec
    assert expand(load(path))[0].run.env == (("A_1", "x y"),)


# -- before the first point -----------------------------------------------------------------


def test_launcher_not_on_path_is_refused_before_the_first_point(tmp_path, capsys):
    path = write(tmp_path, TINY + "launcher: 'no-such-launcher -n {ranks} {command}'\n")
    assert sweep(tmp_path, path) == exits.USAGE
    msg = one_line_error(capsys, path)
    assert msg.startswith("launcher: 'no-such-launcher' is not on PATH: it would launch 2 points")
    assert not (tmp_path / "res" / "t" / "results.jsonl").exists()
    assert sweep(tmp_path, path, "--launcher", "nope {ranks} {command}") == exits.USAGE
    assert one_line_error(capsys, path).startswith("--launcher: 'nope' is not on PATH")
    # Printing needs no launcher here (it is on the cluster).
    assert sweep(tmp_path, path, "--print-commands") == exits.OK
    assert sweep(tmp_path, path, "--sbatch", str(tmp_path / "job.sh")) == exits.OK


def test_data_files_are_checked_up_front(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, TINY + "  data: [tokens.bin, missing.bin]\n")
    (tmp_path / "tokens.bin").write_bytes(b"")
    assert sweep(tmp_path, path) == exits.USAGE
    msg = one_line_error(capsys, path)
    assert msg == f"args.data: missing.bin: No such file or directory (points run in {tmp_path})"
    assert sweep(tmp_path, path, "--sbatch", str(tmp_path / "job.sh")) == exits.USAGE
    capsys.readouterr()
    assert sweep(tmp_path, path, "--print-commands") == exits.OK  # prints only
    os.mkdir(tmp_path / "missing.bin")  # a directory is not a data file
    assert sweep(tmp_path, path) == exits.USAGE
    assert one_line_error(capsys, path).startswith("args.data: missing.bin: not a regular file")
    # A skipped point's file is not needed.
    sw = load(
        write(
            tmp_path,
            TINY + "  data: [tokens.bin, gone.bin]\nskip:\n  - require: \"data == 'tokens.bin'\"\n",
        )
    )
    points = expand(sw)
    assert [dict(p.args)["data"] for p in points if p.skip] == ["gone.bin", "gone.bin"]
    preflight.data_files(sw, points)


def test_a_huge_value_in_a_message_is_clipped(tmp_path, capsys):
    path = write(tmp_path, TINY.replace("[1, 2]", "x" * 100_000))
    assert sweep(tmp_path, path, "--print-commands") == exits.USAGE
    msg = one_line_error(capsys, path)
    assert msg.startswith("ranks: expected positive integers, e.g. [1, 2, 4], got 'xxx")
    assert "characters ...]" in msg and len(msg) < 2000


OUTPUTS = [
    # (what, options (TMP: the test's folder), expected message)
    ("results is a file", ["--results", "TMP/file"], "--results: cannot write results to TMP/"),
    ("results file, sbatch", ["--results", "TMP/file", "--sbatch", "TMP/j.sh"], "--results: "),
    ("sbatch in no folder", ["--sbatch", "TMP/no/job.sh"], "--sbatch: TMP/no/job.sh: no such dir"),
    ("sbatch is a folder", ["--sbatch", "TMP"], "--sbatch: TMP: is a directory"),
    ("sbatch is a device", ["--sbatch", "/dev/null"], "--sbatch: /dev/null: exists and is not"),
    ("results newline", ["--results", "TMP/a\nb", "--sbatch", "TMP/j.sh"], "--results: 'TMP/a"),
]


@pytest.mark.parametrize("what,options,want", OUTPUTS, ids=[o[0] for o in OUTPUTS])
def test_outputs_are_checked_before_the_first_point(
    tmp_path, capsys, monkeypatch, what, options, want
):
    (tmp_path / "file").write_text("")
    path = write(tmp_path, TINY.replace("precheck: false", "precheck: true"))
    # The proxy's precheck is long work: it must not run before the outputs are checked.
    monkeypatch.setattr(runner.launch, "precheck", lambda points: pytest.fail("precheck ran"))
    if what == "results newline":
        monkeypatch.setattr(runner.launch, "precheck", lambda points: {})
    options = [o.replace("TMP", str(tmp_path)) for o in ["--results", "TMP/res", *options]]
    assert runner.main([path, *options]) == exits.USAGE
    assert one_line_error(capsys).startswith(want.replace("TMP", str(tmp_path)))


@pytest.mark.slow
def test_sweep_path_with_a_newline_cannot_add_a_line_to_scripts(tmp_path, capsys):
    path = write(tmp_path, TINY + "skip:\n  - require: 'ranks > 1'\n", "s\necho pwned.yaml")
    job = tmp_path / "job.sh"
    assert sweep(tmp_path, path, "--sbatch", str(job)) == exits.OK
    head, _, tail = job.read_text().partition("\nexec ")
    assert "s\\necho pwned.yaml" in head and "\necho" not in head  # escaped in comments
    assert shlex.split(tail)[4] == path  # quoted as one word
    assert subprocess.run(["bash", "-n", str(job)]).returncode == 0
    capsys.readouterr()
    assert sweep(tmp_path, path, "--print-commands") == exits.OK
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and not any(x.startswith("echo pwned") for x in out)


@pytest.mark.slow
def test_subprocess_gets_one_line_and_exit_2(tmp_path):
    path = write(tmp_path, TINY + "ranks: [4]\n")
    r = subprocess.run(
        [sys.executable, "-m", "proxies", "sweep", path, "--print-commands"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == exits.USAGE and r.stdout == ""
    assert r.stderr == f"proxies sweep: error: {path}: line 12: 'ranks' is given twice in one " + (
        "mapping (first on line 4)\n"
    )


# -- expressions ----------------------------------------------------------------------------

EXPLODING = [
    "'x' * 1000000000",
    "1000000000 * 'x'",
    "'ab' * r * r",
    "('x' * 5000) + ('x' * 5000) + 'x'",
    "'%0999999999d' % 1",
    "'%.999999999f' % 1.0",
    "'%*d' % r",
    "'%(a)1000d' % r",
    "r * r * r * r * r * r * r * r * r * r * r * r * r * r * r * r * r * r * r * r * r * r",
    "-" * 60 + "1",
    "+".join(["1"] * 60),
    "(" * 250 + "1" + ")" * 250,
    "max(" * 60 + "1" + ")" * 60,
    "9" * 2000,
    "1e308 * 10",
    "r / 0.5e-300 / 1e-300",
    "r ** 2",
    "r << 100000",
    "[1] * 10",
    "'x'.center(10**9)",
    "(lambda: 1)()",
    "b'x' * 3",
    "1j * 2",
    "'%c' % 99999999",
    "1 if not r else 'x' * 100000",
]


@pytest.mark.parametrize("text", EXPLODING)
def test_exploding_expressions_are_refused(text):
    with pytest.raises(expr.ExprError) as e:
        expr.evaluate(text, {"r": 2**300})
    assert "\n" not in str(e.value)


def test_expressions_that_fit_still_work():
    assert expr.evaluate("'gpt2-%03d' % r", {"r": 5}) == "gpt2-005"
    assert expr.evaluate("'x' * 10000", {}) == "x" * expr.MAX_LEN
    assert expr.evaluate("r * r", {"r": 2**2000}) == 2**4000
    assert expr.evaluate("-" * 40 + "1", {}) == 1


def random_expression(rng: random.Random, depth: int) -> str:
    """Grammar-random expressions built from big and awkward operands."""
    atoms = ["r", "s", "'ab'", "'%d'", "'%0500d'", "1e308", "9999999999999999", "0", "-1", "2.5"]
    if depth == 0 or rng.random() < 0.2:
        return rng.choice(atoms)
    a, b = random_expression(rng, depth - 1), random_expression(rng, depth - 1)
    form = rng.choice(
        [
            "{} * {}",
            "{} + {}",
            "{} % {}",
            "{} // {}",
            "{} / {}",
            "-{}",
            "max({}, {})",
            "{} if {} else 1",
            "({} < {})",
            "not {}",
        ]
    )
    return form.format(a, b) if form.count("{}") == 2 else form.format(a)


def test_random_expressions_never_escape_the_bounds():
    """Seeded property test: whatever an expression is, evaluating it either gives a value
    within the bounds or raises ExprError (never MemoryError, RecursionError, a huge value)."""
    rng = random.Random(1234)
    values = {"r": 2**4000, "s": "x" * 9000}
    outcomes = {"ok": 0, "refused": 0}
    for _ in range(3000):
        text = random_expression(rng, rng.randint(1, 7))
        try:
            v = expr.evaluate(text, values)
        except expr.ExprError as e:
            assert "\n" not in str(e)
            outcomes["refused"] += 1
            continue
        outcomes["ok"] += 1
        if isinstance(v, str):
            assert len(v) <= expr.MAX_LEN
        elif isinstance(v, int):
            assert v.bit_length() <= expr.MAX_INT_BITS
    assert outcomes["ok"] > 300 and outcomes["refused"] > 300, outcomes  # both kinds seen


def test_exploding_expression_in_a_file_names_the_file_and_key(tmp_path, capsys):
    bomb = "model: \"{'x' * ranks * 1000000000}\""
    msg = refused(tmp_path, capsys, TINY.replace("model: gpt2-tiny", bomb))
    assert msg.startswith("args.model: at ranks = 1: \"'x' * ranks * 1000000000\": repeating")
    msg = refused(tmp_path, capsys, TINY + "skip:\n  - require: '" + "-" * 80 + "ranks'\n")
    assert msg.startswith("skip[0].require: '-----") and msg.endswith("nested more than 50 deep")


def test_every_shipped_config_still_loads():
    configs = os.path.join(ROOT, "configs")
    for name in sorted(f for f in os.listdir(configs) if f.endswith(".yaml")):
        try:
            load(os.path.join(configs, name))
        except SweepError as e:  # pragma: no cover - a shipped file must stay valid
            pytest.fail(str(e))
