"""The predictor against textbook costs, the seed's congestion case, itself (steps vs coarse,
folded vs full) and the proxies' command lines (pure or one process, no MPI)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest

from proxies.core import prediction
from proxies.core.machine import load

from .test_network import GBIT, machine

TEN_GBE = "configs/machines/10gbe.yaml"
MIB = 1 << 20


def one_collective(m, alg, n, nbytes, detail, kind="allreduce", rpn=None):
    return prediction.collective_seconds(
        m, kind, alg, n, nbytes // 4, ranks_per_node=rpn, detail=detail
    )


# -- textbook costs (Thakur, Rabenseifner and Gropp 2005) -----------------------------------
# One rank per node, interfaces never the bottleneck (each flow at the link's bandwidth):
# the model the formulas assume. a latency, b seconds per byte, g seconds per byte reduced.
A, B, G = 20e-6, 1 / (10 * GBIT), 1 / 4e9


def textbook(alg: str, p: int, n: int) -> float:
    lg = math.ceil(math.log2(p))
    if alg == "ring":
        return 2 * (p - 1) * A + 2 * (p - 1) / p * n * B + (p - 1) / p * n * G
    if alg == "tree":  # binomial reduce, then binomial broadcast
        return 2 * lg * (A + n * B) + lg * n * G
    if alg == "rhd":  # Rabenseifner; a non-power of two folds first and unfolds last
        q = 1 << (p.bit_length() - 1)
        extra = 0.0 if q == p else 2 * (A + n * B) + n * G
        return 2 * math.log2(q) * A + 2 * (q - 1) / q * n * B + (q - 1) / q * n * G + extra
    raise ValueError(alg)


def textbook_machine():
    m = machine(nic=1e30, link=1 / B, lat=A)
    return replace(m, reduce_bandwidth=1 / G)


@pytest.mark.parametrize("alg", ["ring", "tree", "rhd"])
@pytest.mark.parametrize("detail", ["steps", "coarse"])
def test_textbook_costs(alg, detail):
    m = textbook_machine()
    for p in (2, 3, 4, 5, 8, 13, 16, 32, 64):
        if detail == "steps" and p > 32 and alg == "ring":
            continue  # 4000 messages: fine, but the point is made
        nbytes = 64 * MIB - (64 * MIB) % (4 * p)  # whole blocks: the formulas' assumption
        got = one_collective(m, alg, p, nbytes, detail)
        want = textbook(alg, p, nbytes)
        if alg == "tree" and p & (p - 1):
            # the root sends to all its children at once: the broadcast is as deep as the
            # tree (fewer than ceil(log2 p) rounds when p is not a power of two)
            assert got < want
            continue
        assert got == pytest.approx(want, rel=1e-6), (alg, p, detail)


# -- the seed's case: 5 nodes on 10 GbE, 1 Gb each ------------------------------------------


def test_naive_allreduce_congests_one_node():
    """Rank 0 receives 4 x 1 Gb through one 10 Gb/s interface (0.4 s) and sends it back
    (0.4 s); ring moves 2(n-1)/n Gb per link in parallel."""
    m = load(TEN_GBE)
    size = 125 * MIB
    naive = one_collective(m, "naive", 5, size, "steps")
    ring = one_collective(m, "ring", 5, size, "steps")
    wire = size / m.inter.bandwidth  # one buffer over one link
    adds = 4 * size / m.reduce_bandwidth
    assert naive == pytest.approx(8 * wire + adds, rel=0.01)
    assert 0.8 < naive < 1.0
    assert ring == pytest.approx(1.6 * wire + 0.8 * size / m.reduce_bandwidth, rel=0.01)
    assert 0.16 < ring < 0.2


def test_steps_and_coarse_agree():
    """Coarse phases are the steps aggregated: on an idle network they give the same time
    (dbtree within its pipelining bound)."""
    m = machine(rpn=2, lat=5e-6)
    for alg in ("ring", "tree", "rhd", "naive", "hier", "rd"):
        for n in (2, 3, 4, 6, 8):
            steps = one_collective(m, alg, n, 8 * MIB, "steps")
            coarse = one_collective(m, alg, n, 8 * MIB, "coarse")
            assert coarse == pytest.approx(steps, rel=0.05), (alg, n, steps, coarse)


def test_bandwidth_lowers_predictions():
    base = load(TEN_GBE)
    times = []
    for gbit in (1, 10, 100):
        m = replace(
            base, inter=type(base.inter)(base.inter.latency, gbit * GBIT), nic_bandwidth=gbit * GBIT
        )
        times.append(one_collective(m, "ring", 8, 64 * MIB, "coarse"))
    assert times[0] > times[1] > times[2]


# -- folding: identical ranks once gives the full simulation's answer -----------------------


def _job_prediction(module: str, argv: list[str], world: int, fold: str, m):
    mod = __import__(f"proxies.{module}.proxy", fromlist=["x"])
    args = mod.parser().parse_args(argv + ["--dry-run", "--world-size", str(world)])
    job = mod.make_job(args, world)
    pred, note = prediction.run_prediction(job, args, m, fold=fold, detail="coarse")
    return pred, note


@pytest.mark.parametrize(
    "module,argv,world,rpn",
    [
        # data-parallel groups across nodes that hold no simulated rank; a symmetric and an
        # asymmetric algorithm
        ("gpt2", ["8", "2", "2", "--model", "gpt2", "--seq-len", "64", "--compute", "none"], 16, 2),
        (
            "gpt2",
            ["8", "2", "2", "--model", "gpt2", "--allreduce", "tree", "--compute", "none"],
            24,
            2,
        ),
        (
            "gpt2",
            ["8", "2", "4", "--model", "gpt2", "--seq-len", "64", "--compute", "model"],
            16,
            4,
        ),
        (
            "gpt2",
            ["8", "4", "4", "--model", "gpt2", "--grad-sync", "buckets", "--compute", "none"],
            32,
            8,
        ),
        ("gpt3", ["4", "2", "--model", "gpt3-medium", "--tp", "2", "--micro-batches", "4"], 16, 4),
        (
            "gpt3",
            [
                "4",
                "2",
                "--model",
                "gpt3-medium",
                "--tp",
                "2",
                "--order",
                "megatron",
                "--micro-batches",
                "4",
            ],
            32,
            8,
        ),
    ],
)
def test_folded_equals_full(module, argv, world, rpn):
    m = replace(load(TEN_GBE), ranks_per_node=rpn)
    full, _ = _job_prediction(module, argv, world, "never", m)
    folded, note = _job_prediction(module, argv, world, "always", m)
    assert "identical ranks once" in note
    assert len(folded.breakdown) < len(full.breakdown)
    assert folded.time == pytest.approx(full.time, rel=1e-9)
    for r in range(world):
        for c, v in full.breakdown[r].items():
            assert folded.of(r).get(c, 0.0) == pytest.approx(v, rel=1e-6, abs=1e-9), (r, c)


# -- the command line -----------------------------------------------------------------------


def run_cmd(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_gpt2_dry_run_predicts_the_seed_layout(tmp_path):
    """GPT-2 124M data-parallel over 9 ranks on 5 nodes (2 per node): naive allreduce
    through rank 0's node vs ring."""
    times = {}
    for alg in ("naive", "ring"):
        out = tmp_path / f"{alg}.json"
        r = run_cmd(
            [
                sys.executable,
                "-m",
                "proxies.gpt2",
                "12",
                "1",
                "--model",
                "gpt2",
                "--compute",
                "none",
                "--dry-run",
                "--world-size",
                "9",
                "--ranks-per-node",
                "2",
                "--machine",
                TEN_GBE,
                "--allreduce",
                alg,
                "--json",
                str(out),
            ]
        )
        assert r.returncode == 0, r.stderr
        assert "predicted time per iteration" in r.stdout
        res = json.loads(out.read_text())
        times[alg] = res["predicted_iter_time_s"]
        assert sum(res["predicted_breakdown_s"].values()) == pytest.approx(times[alg])
    # 124M x 4 B ~ 0.5 GB per replica; naive funnels 8 copies through one interface each way
    assert times["naive"] > 3 * times["ring"]


@pytest.mark.slow
def test_bad_machine_file_exits_2(tmp_path):
    bad = tmp_path / "m.yaml"
    bad.write_text(open(TEN_GBE).read().replace("bandwidth: 9.41 Gb/s", "bandwidth: -9.41 Gb/s", 1))
    r = run_cmd(
        [
            sys.executable,
            "-m",
            "proxies.gpt2",
            "4",
            "2",
            "--dry-run",
            "--world-size",
            "4",
            "--machine",
            str(bad),
        ]
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and "bandwidth" in lines[0], r.stderr
