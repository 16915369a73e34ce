"""What a sweep records and reports when things go wrong: a full disk (never a torn line, one
line saying what is recorded, a rerun resumes), points ending with exits.py's statuses (a
readable reason, not "failed, exit N"), and `report` on corrupt or foreign JSONL (each bad
line skipped with a warning, exit 2 when nothing usable remains, never a traceback).

Points are not launched here: launch.run is replaced by a fake that writes what a proxy
would (its JSON, its stderr) and returns its exit status, so each test takes milliseconds."""

import copy
import errno
import io
import json
import os
import random
import textwrap

import pytest
from rich.console import Console

from proxies.core import exits
from proxies.sweep import launch, report, results, runner

SWEEP = """
name: t
proxy: gpt2
ranks: [1, 2]
precheck: false
args:
  layers: [1, 2]
  model: gpt2-tiny
  seq_len: 16
  iters: 1
  warmup: 0
"""
MPICH_BANNER = """
===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 4242 RUNNING AT host
=   EXIT CODE: 5
=   CLEANING UP REMAINING PROCESSES
===================================================================================
"""


def write(tmp_path, text=SWEEP) -> str:
    path = tmp_path / "s.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def fake_launcher(monkeypatch, outcomes: dict[int, tuple[int, str]] | None = None, log=None):
    """launch.run replaced: point i exits with outcomes[i] = (status, stderr), default 0
    with a JSON result; `log` collects the indices launched."""
    outcomes = outcomes or {}

    def run(cmd, env, timeout, out, err, tick=None):
        json_path = cmd[cmd.index("--json") + 1]
        index = int(os.path.basename(json_path)[:4])
        rc, stderr = outcomes.get(index, (0, ""))
        if log is not None:
            log.append(index)
        with open(out, "w"), open(err, "w") as f:
            f.write(stderr)
        if rc == 0:
            with open(json_path, "w") as f:
                json.dump({"iter_time_s": [0.5 + index], "breakdown_s": {"compute": [0.5]}}, f)
        return launch.Outcome("ok" if rc == 0 else "failed", rc, 0.01)

    monkeypatch.setattr(launch, "run", run)


def sweep(tmp_path, *extra) -> int:
    return runner.main([write(tmp_path), "--results", str(tmp_path), "--no-report", *extra])


def jsonl_lines(tmp_path) -> list[dict]:
    data = (tmp_path / "t" / results.FILE).read_bytes()
    assert not data or data.endswith(b"\n"), "a torn last line"
    return [json.loads(x) for x in data.splitlines()]


def error_line(capsys, prefix="proxies sweep: error: ") -> str:
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith(prefix)]
    assert len(lines) == 1, lines
    return lines[0].removeprefix(prefix)


# -- a full disk ---------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["short write", "write fails", "fsync fails"])
def test_append_on_a_full_disk_leaves_no_torn_line(tmp_path, monkeypatch, how):
    path = str(tmp_path / "r.jsonl")
    results.append(path, {"n": 1})
    before = open(path, "rb").read()

    def short(fd, data):
        return os.write(fd, data[: len(data) // 2])

    def fails(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(
        results, "write", {"short write": short, "write fails": fails}.get(how, os.write)
    )
    monkeypatch.setattr(results, "fsync", fails if how == "fsync fails" else os.fsync)
    with pytest.raises(OSError) as e:
        results.append(path, {"n": 2, "pad": "x" * 10000})
    assert e.value.errno == errno.ENOSPC and e.value.filename == path
    assert open(path, "rb").read() == before


def test_full_disk_stops_the_sweep_and_a_rerun_resumes(tmp_path, monkeypatch, capsys):
    launched = []
    fake_launcher(monkeypatch, log=launched)
    calls = []

    def filling(fd, data):  # the third record finds the disk full, half written
        calls.append(1)
        if len(calls) == 3:
            return os.write(fd, data[: len(data) // 2])
        return os.write(fd, data)

    monkeypatch.setattr(results, "write", filling)
    assert sweep(tmp_path) == exits.FAILED
    jsonl = tmp_path / "t" / results.FILE
    assert error_line(capsys) == (
        f"the disk is full ({jsonl}): stopped with 2 of 4 points recorded in {jsonl}; free "
        "space and run the same command again to resume"
    )
    assert [r["point"]["index"] for r in jsonl_lines(tmp_path)] == [0, 1]
    assert launched == [0, 1, 2]

    monkeypatch.setattr(results, "write", os.write)
    assert sweep(tmp_path) == exits.OK
    assert "4 points: 2 to run, 2 done before" in capsys.readouterr().out
    recs = jsonl_lines(tmp_path)
    assert [r["point"]["index"] for r in recs] == [0, 1, 2, 3]
    assert all(r["status"] == "ok" for r in recs) and launched == [0, 1, 2, 2, 3]


def test_full_disk_for_the_logs_stops_the_sweep(tmp_path, monkeypatch, capsys):
    fake_launcher(monkeypatch)
    real = launch.run

    def no_log(cmd, env, timeout, out, err, tick=None):
        if "/0001-" in err:
            raise OSError(errno.ENOSPC, "No space left on device", err)
        return real(cmd, env, timeout, out, err, tick)

    monkeypatch.setattr(launch, "run", no_log)
    assert sweep(tmp_path) == exits.FAILED
    msg = error_line(capsys)
    assert msg.startswith(f"the disk is full ({tmp_path}/t/logs/0001-gpt2-2r-")
    assert "stopped with 1 of 4 points recorded" in msg


def test_results_unreadable_or_bad_lines_before_the_sweep(tmp_path, monkeypatch, capsys):
    fake_launcher(monkeypatch)
    os.makedirs(tmp_path / "t")
    with open(tmp_path / "t" / results.FILE, "wb") as f:
        f.write(b"\x00\xff binary\n[1, 2]\n")
    assert sweep(tmp_path) == exits.OK  # bad lines are warned about, their points rerun
    err = capsys.readouterr().err
    assert f"{results.FILE}:1: skipping a line: not UTF-8 text (byte 1)" in err
    assert f"{results.FILE}:2: skipping a line: not a JSON object" in err
    assert len(jsonl_lines_ok(tmp_path)) == 4


def jsonl_lines_ok(tmp_path) -> list[dict]:
    return results.load(str(tmp_path / "t" / results.FILE), warn=False)


# -- why a point failed --------------------------------------------------------------------

DIAGNOSIS = "proxies.gpt2: error: rank 1 died (signal 9) during the allreduce of bucket 3"
ENDINGS = [
    (exits.RANK_DIED, DIAGNOSIS + "\n" + MPICH_BANNER, f"a rank died (exit status 5): {DIAGNOSIS}"),
    (exits.STALLED, "proxies.gpt2: no progress for 60 s: rank 2 waits in recv from 3\n", None),
    (exits.CHECK, "proxies.gpt2: --check: allreduce 4 differs at element 17\n", None),
    (exits.DIVERGED, "warning: x\nproxies.gpt2: loss is nan at iteration 3\n", None),
    (
        exits.USAGE,
        "proxies.gpt2: error: bad\n",
        "bad input (exit status 2): proxies.gpt2: error: bad",
    ),
    (255, "", "exit status 255, nothing on stderr"),
    (-9, "", "killed by SIGKILL, nothing on stderr"),
    (7, "some tool: oops\n" + MPICH_BANNER, "exit status 7: some tool: oops"),
]


@pytest.mark.parametrize("rc,stderr,want", ENDINGS, ids=[str(e[0]) for e in ENDINGS])
def test_failed_point_reason_names_the_status_and_diagnosis(
    tmp_path, monkeypatch, capsys, rc, stderr, want
):
    if want is None:
        want = f"{exits.MEANING[rc]} (exit status {rc}): {stderr.strip().splitlines()[-1]}"
    fake_launcher(monkeypatch, {1: (rc, stderr)})
    assert sweep(tmp_path) == exits.FAILED
    out, err = capsys.readouterr()
    rec = {r["point"]["index"]: r for r in jsonl_lines(tmp_path)}[1]
    assert rec["status"] == "failed" and rec["returncode"] == rc and rec["reason"] == want
    assert f"FAILED: {want}\n" in out  # the progress line
    assert f"  failed: {rec['describe']}: {want}\n" in err  # the summary at the end
    row = next(r for r in report.rows(jsonl_lines_ok(tmp_path)) if r["status"] == "failed")
    assert row["reason"] == want


@pytest.mark.slow
def test_a_command_that_cannot_start_is_a_failed_point_with_the_reason(tmp_path):
    err = str(tmp_path / "e")
    o = launch.run([str(tmp_path / "no-such-program")], {}, 10, str(tmp_path / "o"), err)
    assert o.status == "failed" and o.returncode is None
    assert o.error == f"cannot start {tmp_path}/no-such-program: No such file or directory"
    assert open(err).read() == o.error + "\n"


def test_old_records_without_a_reason_still_report_one():
    rec = {"status": "failed", "returncode": 5, "stderr_tail": "x\n" + MPICH_BANNER}
    assert report.reason(rec) == "x"
    assert report.reason({"status": "failed", "returncode": 6}) == (
        "loss not finite (exit status 6), nothing on stderr"
    )


# -- report on corrupt or foreign JSONL ----------------------------------------------------

GOOD = {
    "point": {
        "id": "a",
        "label": "g",
        "proxy": "gpt2",
        "ranks": 2,
        "args": {"layers": 1},
        "repeat": 0,
        "series": {"layers": 1},
        "series_id": "s",
        "scaling": "strong",
        "index": 0,
    },
    "describe": "g",
    "status": "ok",
    "elapsed_s": 1.0,
    "returncode": 0,
    "result": {"iter_time_s": [0.5, 0.7], "breakdown_s": {"compute": [0.4, 0.6]}},
}
HOSTILE = [None, True, -1, 0, 1e308, "x", "", [], [None], {}, {"a": []}, [[[]]], 10**400]


def paths(obj, prefix=()):
    """Every key path of a JSON object, leaves and inner nodes."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield (*prefix, k)
            yield from paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield (*prefix, i)
            yield from paths(v, (*prefix, i))


def mutations():
    """GOOD with one value replaced by each hostile value, or one key removed."""
    for path in paths(GOOD):
        for value in [*HOSTILE, "<removed>"]:
            rec = copy.deepcopy(GOOD)
            node = rec
            for k in path[:-1]:
                node = node[k]
            if value == "<removed>":
                if isinstance(node, dict):
                    del node[path[-1]]
                else:
                    node.pop(path[-1])
            else:
                node[path[-1]] = value
            yield rec


def test_every_mutated_record_is_read_or_skipped_and_the_report_never_fails(tmp_path):
    path = tmp_path / results.FILE
    recs = list(mutations())
    with open(path, "w") as f:
        for i, rec in enumerate(recs):
            if isinstance(rec.get("point"), dict) and rec["point"].get("id") == "a":
                rec["point"]["id"] = f"p{i}"  # each its own point, unless id is mutated
            f.write(json.dumps(rec) + "\n")
    got = results.load(str(path), warn=False)
    assert 0 < len(got) < len(recs)  # some survive (an extra key is harmless), many do not
    assert all(results.problem(r) is None for r in got)
    rows = report.rows(got)
    out = Console(file=io.StringIO(), width=200)
    report.print_table(rows, "t", out)
    report.write_csv(rows, str(tmp_path / "report.csv"))
    for rec in recs:  # and each alone, as the only record
        rows = report.rows([r for r in [rec] if results.problem(r) is None])
        report.print_table(rows, "t", out)


def report_main(tmp_path, data: bytes, capsys) -> tuple[int, str]:
    (tmp_path / results.FILE).write_bytes(data)
    code = report.main([str(tmp_path)])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_report_skips_bad_lines_with_a_warning_each(tmp_path, capsys):
    bad = [
        b"\x89PNG\x1a\x00",
        b"[1, 2]",
        b'"ok"',
        b"{}",
        b'{"point": 1, "status": "ok"}',
        json.dumps({**GOOD, "result": {"iter_time_s": []}}).encode(),
        json.dumps({**GOOD, "status": "done"}).encode(),
        b"[" * 100000,
        b"1e999",
    ]
    data = b"\n".join([*bad, json.dumps(GOOD).encode()]) + b"\n"
    code, err = report_main(tmp_path, data, capsys)
    assert code == exits.OK
    warned = [x for x in err.splitlines() if ": skipping a line: " in x]
    assert [int(x.split(":")[1]) for x in warned] == list(range(1, 10))
    assert f"{tmp_path}/{results.FILE}:6: skipping a line: result.iter_time_s is not a " in err
    assert (tmp_path / "report.csv").exists()


@pytest.mark.parametrize("what", ["empty", "blank lines", "binary", "all foreign"])
def test_report_with_nothing_usable_is_one_error_and_exit_2(tmp_path, capsys, what):
    data = {
        "empty": b"",
        "blank lines": b"\n\n  \n",
        "binary": random.Random(7).randbytes(1 << 16),
        "all foreign": b"\n".join(json.dumps(x).encode() for x in HOSTILE[:-1]) + b"\n",
    }[what]
    code, err = report_main(tmp_path, data, capsys)
    assert code == exits.USAGE
    assert err.splitlines()[-1] == (
        f"proxies report: error: {tmp_path}/{results.FILE}: no usable records (run a sweep first)"
    )
    warned = [x for x in err.splitlines() if ": skipping a line: " in x]
    assert len(warned) <= results.MAX_WARNINGS
    if what == "binary":  # more bad lines than warnings: counted
        assert err.splitlines()[-2].endswith("lines skipped in all")


def test_report_outputs_are_checked_before_work(tmp_path, capsys, monkeypatch):
    (tmp_path / "report.csv").mkdir()
    code, err = report_main(tmp_path, json.dumps(GOOD).encode() + b"\n", capsys)
    assert code == exits.USAGE
    assert err == (
        f"proxies report: error: {tmp_path}/report.csv: exists and is not a regular file "
        "(it would be replaced)\n"
    )
    os.rmdir(tmp_path / "report.csv")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report.csv, "writer", full)
    monkeypatch.setattr(report, "plot", lambda *a: [])
    code, err = report_main(tmp_path, json.dumps(GOOD).encode() + b"\n", capsys)
    assert code == exits.FAILED
    assert err == f"proxies report: error: {tmp_path}: cannot write the report: No space left " + (
        "on device\n"
    )
    assert sorted(os.listdir(tmp_path)) == [results.FILE]  # no half CSV left behind
