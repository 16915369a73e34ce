"""Faults on purpose, in one process: parsing, bad values (exit 2, one line), the seeded
samples, what each rank's engine is told, the predictor's perturbed iteration, and the
who-waited-for-whom table. Multi-rank runs are in tests/core/test_faults_mpi.py."""

from __future__ import annotations

import argparse
import math
import statistics

import numpy as np
import pytest

from proxies.core import cli, exits, faults, prediction, report

ONE_NODE = "configs/machines/one-node.yaml"
# GPT-3 transformer layers only: 4 identical pipeline stages (test_breakdown's layout).
GPT3 = ["4", "4", "--model", "gpt3-medium", "--layers-only", "--seq-len", "64"]
GPT3 += ["--micro-batches", "4", "--compute", "model", "--device-tflops", "1"]


def parser() -> cli.Parser:
    p = cli.Parser(prog="t")
    faults.add_faults(p)
    return p


# -- parsing -------------------------------------------------------------------------------


def test_options_parse_into_faults():
    args = parser().parse_args(
        "--slow-rank 1:2 --slow-rank 3:1.5 --slow-link 2-0:4 --jitter normal:5% "
        "--kill-rank 2@3".split()
    )
    args.seed = 7
    f = faults.from_args(args)
    assert f.slow == {1: 2.0, 3: 1.5}
    assert f.links == {(0, 2): 4.0}  # either direction, stored low-high
    assert f.kill == {2: 3}
    assert (f.jitter.kind, f.jitter.a) == ("normal", pytest.approx(0.05))
    assert f.seed == 7 and f.active and f.perturbs
    assert f.describe() == (
        "faults on purpose: rank 1 computes x2; rank 3 computes x1.5; jitter normal:5% "
        "(seed 7); link 0-2 x4; rank 2 killed at iteration 3"
    )
    assert f.config()["slow_link"] == {"0-2": 4.0}


@pytest.mark.parametrize(
    "text, kind, a, b",
    [
        ("lognormal:0.1", "lognormal", 0.1, 0.0),
        ("normal:0.2", "normal", 0.2, 0.0),
        ("normal:5%", "normal", 0.05, 0.0),
        ("uniform:0.9-1.1", "uniform", 0.9, 1.1),
        ("exp:1ms", "exp", 1e-3, 0.0),
        ("EXP:50 us", "exp", 50e-6, 0.0),
    ],
)
def test_jitter_grammar(text, kind, a, b):
    j = faults.parse_jitter(text)
    assert (j.kind, j.a, j.b) == (kind, pytest.approx(a), pytest.approx(b))


BAD = [
    ("--slow-rank", "1"),
    ("--slow-rank", "x:2"),
    ("--slow-rank", "-1:2"),
    ("--slow-rank", "1:0.5"),  # faster is not a fault (a kernel cannot be sped up)
    ("--slow-rank", "1:0"),
    ("--slow-rank", "1:nan"),
    ("--slow-rank", "1:inf"),
    ("--slow-rank", "1:1e308"),
    ("--slow-link", "1-1:2"),
    ("--slow-link", "1:2"),
    ("--slow-link", "0-1:0.9"),
    ("--slow-link", "a-b:2"),
    ("--jitter", "gamma:1"),
    ("--jitter", "normal"),
    ("--jitter", "normal:0"),
    ("--jitter", "normal:-5%"),
    ("--jitter", "lognormal:1e9"),
    ("--jitter", "uniform:1.1-0.9"),
    ("--jitter", "uniform:1"),
    ("--jitter", "exp:5"),  # no unit
    ("--jitter", "exp:-1ms"),
    ("--jitter", "exp:1e9 s"),
    ("--kill-rank", "1"),
    ("--kill-rank", "1@x"),
    ("--kill-rank", "1@-1"),
]


@pytest.mark.parametrize("option, value", BAD)
def test_bad_values_are_usage_errors(option, value):
    with pytest.raises(cli.UsageError, match=option):
        parser().parse_args([option, value])


@pytest.mark.parametrize("option", ["--slow-rank 1:2", "--slow-link 0-1:2", "--kill-rank 1@0"])
def test_a_rank_or_link_given_twice_is_a_usage_error(option):
    args = parser().parse_args(f"{option} {option.replace(':2', ':3').replace('@0', '@1')}".split())
    with pytest.raises(cli.UsageError, match="more than once"):
        faults.from_args(args)


def gpt2_error(argv: list[str]) -> str:
    """The UsageError gpt2's main raises (cli.run_main prints it once and exits 2)."""
    from proxies.gpt2 import proxy

    with pytest.raises(cli.UsageError) as e:
        proxy.main(argv)
    return str(e.value)


DRY = "4 4 4 --compute model --dry-run --world-size 4 --iters 2 --warmup 1".split()


# Impossible combinations, checked against the job: one line, before any work.
@pytest.mark.parametrize(
    "extra, says",
    [
        ("--slow-rank 4:2", "rank 4 is outside the world (ranks 0..3)"),
        ("--slow-link 0-7:2", "rank 7 is outside the world"),
        ("--slow-link 0-2:2", "ranks 0 and 2 exchange no point-to-point messages"),
        ("--kill-rank 1@0", "--kill-rank applies to a real run"),
        ("--slow-rank 1:2 --compute none", "--compute none has no compute to slow"),
        ("--jitter exp:1ms --compute none", "--compute none has no compute to slow"),
        ("--slow-rank 1:2", "need --machine FILE"),
        ("--slow-rank 9:1.5 --slow-rank 9:2", "rank 9 is given more than once"),
    ],
)
def test_impossible_combinations_are_one_line_usage_errors(extra, says):
    message = gpt2_error(DRY + extra.split())
    assert says in message and "\n" not in message


def test_kill_iteration_must_be_in_the_run():
    args = argparse.Namespace(dry_run=False, warmup=1, iters=2, compute="real", machine=None)
    faults.check(faults.Faults(kill={1: 2}), args, 4)  # the last iteration: fine
    with pytest.raises(cli.UsageError, match=r"1@3: the run has iterations 0..2 \(1 warm-up"):
        faults.check(faults.Faults(kill={1: 3}), args, 4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "module, extra",
    [
        ("proxies.gpt2", "--slow-rank 1:0.5"),  # at parsing
        ("proxies.gpt3", "--slow-link 0-2:2"),  # against the job, gpt3's own dry run
        ("proxies.cosmoflow", "--kill-rank 0@0"),
    ],
)
def test_bad_faults_exit_2_with_one_line(module, extra):
    import subprocess
    import sys

    argv = "--dry-run --world-size 4 --compute model".split()
    if module == "proxies.gpt3":
        argv = ["4", "4", "--model", "gpt3-medium", "--layers-only", *argv]
    if module == "proxies.gpt2":
        argv = ["4", "4", *argv]
    r = subprocess.run(
        [sys.executable, "-m", module, *argv, *extra.split()], capture_output=True, text=True
    )
    assert r.returncode == exits.USAGE, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"{module}: error: ") and extra.split()[0] in r.stderr


def test_every_proxy_takes_the_options():
    from proxies.cosmoflow import proxy as cosmoflow
    from proxies.dlrm import proxy as dlrm
    from proxies.gpt2 import proxy as gpt2
    from proxies.gpt3 import proxy as gpt3

    for mod in (gpt2, gpt3, cosmoflow, dlrm):
        args = mod.parser().parse_args(
            "--slow-rank 1:2 --jitter exp:1ms --slow-link 0-1:3 --kill-rank 0@1".split()
        )
        f = faults.from_args(args)
        assert (f.slow, f.links, f.kill, f.jitter.kind) == ({1: 2}, {(0, 1): 3}, {0: 1}, "exp")


# -- what a rank is told -------------------------------------------------------------------


def test_rank_faults_stretch_compute_and_hold_messages():
    f = faults.Faults(slow={1: 3.0}, links={(1, 2): 5.0}, seed=0)
    r1, r2, r0 = f.for_rank(1), f.for_rank(2), f.for_rank(0)
    assert r1.seconds(0.5) == pytest.approx(1.5)  # model/replay: F x the time
    assert r1.extra(0.5) == pytest.approx(1.0)  # real: (F - 1) x the measured kernel
    assert r0.seconds(0.5) == 0.5 and r0.extra(0.5) == 0.0 and not r0.touches_compute
    assert r1.hold(2, 0.01) == pytest.approx(0.04) and r2.hold(1, 0.01) == pytest.approx(0.04)
    assert r1.hold(0, 0.01) == 0.0 and r0.hold(1, 0.01) == 0.0
    assert r0.links == {} and r1.links == {2: 5.0} and r2.links == {1: 5.0}


def draws(f: faults.Faults, rank: int, iteration: int, n: int = 200) -> list[float]:
    rf = f.for_rank(rank)
    rf.start_iteration(iteration, kill=False)
    return [rf.seconds(1.0) for _ in range(n)]


@pytest.mark.parametrize("dist", ["lognormal:0.1", "normal:5%", "uniform:0.9-1.1", "exp:1ms"])
def test_jitter_is_reproducible_from_the_seed(dist):
    j = faults.parse_jitter(dist)
    a = draws(faults.Faults(jitter=j, seed=3), 1, 2)
    assert a == draws(faults.Faults(jitter=j, seed=3), 1, 2)  # same seed, rank, iteration
    assert a != draws(faults.Faults(jitter=j, seed=4), 1, 2)  # another seed
    assert a != draws(faults.Faults(jitter=j, seed=3), 0, 2)  # another rank
    assert a != draws(faults.Faults(jitter=j, seed=3), 1, 3)  # another iteration


def test_jitter_distributions_have_their_stated_shape():
    n = 4000

    def sample(text):
        return draws(faults.Faults(jitter=faults.parse_jitter(text)), 0, 0, n)

    assert statistics.median(sample("lognormal:0.1")) == pytest.approx(1.0, abs=0.01)
    assert np.std(np.log(sample("lognormal:0.1"))) == pytest.approx(0.1, rel=0.05)
    s = sample("normal:5%")
    assert np.mean(s) == pytest.approx(1.0, abs=0.005) and np.std(s) == pytest.approx(
        0.05, rel=0.05
    )
    assert min(sample("normal:2")) == 0.0  # 1 + 2z clipped at 0: a duration is never negative
    u = sample("uniform:0.9-1.1")
    assert 0.9 <= min(u) and max(u) <= 1.1 and np.mean(u) == pytest.approx(1.0, abs=0.005)
    e = np.array(sample("exp:1ms")) - 1.0  # added to the op's 1 s
    assert e.min() >= 0 and e.mean() == pytest.approx(1e-3, rel=0.06)
    # real compute only gets slower: the sleep owed is never negative
    rf = faults.Faults(jitter=faults.parse_jitter("normal:50%")).for_rank(0)
    assert min(rf.extra(0.1) for _ in range(500)) == 0.0


# -- the predictor -------------------------------------------------------------------------


def predicted(extra: str = "", *args: str):
    """Predicted iteration of the 4-stage GPT-3 layers on one node: (prediction, args)."""
    from proxies.gpt3 import proxy as gpt3

    argv = [*GPT3, *args, "--dry-run", "--world-size", "4", "--machine", ONE_NODE]
    argv += ["--ranks-per-node", "4", *extra.split()]
    a = gpt3.parser().parse_args(argv)
    machine = cli.use_machine(a)
    job = gpt3.make_job(a, 4)
    faults.attach(job, a)
    pred, note = prediction.run_prediction(job, a, machine)
    return pred, note


def adds_up(pred) -> None:
    for r, book in pred.breakdown.items():
        spent = sum(v for c, v in book.items() if not c.endswith("_hidden"))
        assert spent == pytest.approx(pred.time, rel=1e-9), r


def test_predicted_idle_on_the_other_stages_grows_with_the_slowed_stage():
    runs = [predicted(f"--slow-rank 1:{f}" if f > 1 else "") for f in (1, 1.5, 2, 3)]
    base = runs[0][0].breakdown
    for (pred, note), f in zip(runs, (1, 1.5, 2, 3), strict=True):
        adds_up(pred)
        # the slowed stage computes F times as long; the others as before
        assert pred.breakdown[1]["compute"] == pytest.approx(f * base[1]["compute"], rel=1e-9)
        for r in (0, 2, 3):
            assert pred.breakdown[r]["compute"] == pytest.approx(base[r]["compute"], rel=1e-9)
        if f > 1:
            assert "rank 1 computes x" in note
    for r in (0, 2, 3):
        idle = [pred.breakdown[r]["idle"] for pred, _ in runs]
        assert idle == sorted(idle) and idle[-1] > idle[0] + base[1]["compute"] / 2, (r, idle)
    times = [pred.time for pred, _ in runs]
    assert times == sorted(times) and len(set(times)) == 4


def test_predicted_slow_link_is_fault_delay_on_its_receivers():
    # spinning waits: 4 ranks on the file's 2 cores would yield, and a yielding wait sees
    # its message only at its next test, which makes the iteration a step function of
    # the delay (a later message can meet an earlier test); this test is about the delay
    base, _ = predicted("--wait spin")
    pred, _ = predicted("--wait spin --slow-link 1-2:20")
    slow, _ = predicted("--wait spin --slow-link 1-2:40")
    adds_up(pred)
    assert "fault_delay" not in base.breakdown[1]
    for r in (1, 2):  # both receive over the link (activations one way, gradients back)
        assert 0 < pred.breakdown[r]["fault_delay"] < slow.breakdown[r]["fault_delay"]
    for r in (0, 3):
        assert "fault_delay" not in pred.breakdown[r]
    assert base.time < pred.time < slow.time


def test_predicted_jitter_follows_the_seed():
    a, _ = predicted("--jitter lognormal:0.2 --seed 1")
    b, _ = predicted("--jitter lognormal:0.2 --seed 1")
    c, _ = predicted("--jitter lognormal:0.2 --seed 2")
    adds_up(a)
    assert a.time == b.time and a.breakdown == b.breakdown
    assert a.time != c.time


def test_faults_unfold_the_prediction():
    """Slowed or jittered ranks are no longer images of their representative."""
    from proxies.gpt2 import proxy as gpt2

    argv = "8 2 --compute model --dry-run --world-size 8 --machine".split() + [ONE_NODE]
    a = gpt2.parser().parse_args([*argv, "--ranks-per-node", "8", "--slow-rank", "5:2"])
    job = gpt2.make_job(a, 8)
    faults.attach(job, a)
    pred, note = prediction.run_prediction(job, a, cli.use_machine(a), fold="always")
    assert pred.rep_of is None and "all 8 ranks" in note
    assert pred.breakdown[5]["compute"] == pytest.approx(2 * pred.breakdown[1]["compute"])


# -- the report ----------------------------------------------------------------------------


def rows(n: int) -> list[dict]:
    return [
        {
            "rank": r,
            "label": f"stage {r % 4}",
            "iter_s": [1.0],
            "seconds": {"compute": [1.0 - 0.01 * r], "idle": [0.01 * r]},
            "bytes": {},
            "waited_for": {str((r + 1) % n): 0.006 * r, str((r + 2) % n): 0.004 * r},
        }
        for r in range(n)
    ]


def test_waited_for_in_the_json_and_the_table(capsys):
    result = report.summarize(rows(4))
    assert result["waited_for"][3] == {"0": pytest.approx(0.018), "1": pytest.approx(0.012)}
    report.print_report(result, [])
    out = capsys.readouterr().out
    assert "who waited for whom" in out
    line = next(x for x in out.splitlines() if x.startswith("│    3"))
    assert "0.0300" in line and "0: 0.0180" in line and "1: 0.0120" in line


def test_waited_for_table_stays_short_at_scale(capsys):
    report.print_report(report.summarize(rows(64)), [])
    out = capsys.readouterr().out
    assert "16 of 64 ranks, the most idle" in out
    table = out[out.index("who waited for whom") :].splitlines()
    shown = [int(x.split("│")[1]) for x in table if x.startswith("│")]
    assert shown == list(range(48, 64))


def test_no_waited_for_without_a_measurement():
    result = report.summarize([{**r, "waited_for": {}} for r in rows(2)][:1])
    assert result.get("waited_for") == [{}]
    assert "waited_for" not in report.summarize(
        [{k: v for k, v in r.items() if k != "waited_for"} for r in rows(2)]
    )


def test_perturbed_cost_is_identity_without_faults():
    cost = lambda r, op: 1.0  # noqa: E731
    assert faults.perturbed_cost(None, cost, "how", 0) == (cost, "how")
    assert math.isclose(
        faults.perturbed_cost(faults.Faults(slow={2: 4.0}), cost, "how", 0)[0](2, None), 4.0
    )
