"""GPT-2's C++-parity mode (--schedule cpp, --model dnn-cpp-proxies): the C++ proxy's
messages in its order, its refusals, and 4-rank comm-only runs with --check.

The constants below are the C++ proxy's own #defines (spcl/DNN-cpp-proxies,
proxies/comm_only/gpt2_large.cpp): P2PSIZE, BEGINSIZE, INTERSIZE, ENDSIZE."""

from __future__ import annotations

import json
import re
import sys

import pytest
from launch import mpirun, run

from proxies.core.plan import P2P, Collective, Compute
from proxies.core.simulate import simulate
from proxies.gpt2.proxy import PROG, make_job, parser, stage_params
from proxies.transformer.config import PRESETS

P2PSIZE = 808_960  # 1 x 632 x 1280
BEGINSIZE = 85_317_120  # layer + wte + wpe
INTERSIZE = 19_677_440  # one layer
ENDSIZE = 84_008_960  # layer + wte + ln_f


def job(argv, world):
    return make_job(parser().parse_args(argv), world)


def trace(plan) -> list[tuple]:
    """A plan as the C++ proxy's calls: one tuple per step, (sends, recvs) of a P2P batch as
    (peer, count) tuples, ("allreduce", count) for a collective."""
    out = []
    for op in plan.ops:
        if isinstance(op, P2P):
            out.append(
                (
                    tuple((m.peer, m.count) for m in op.sends),
                    tuple((m.peer, m.count) for m in op.recvs),
                )
            )
        else:
            assert isinstance(op, Collective), op
            out.append((op.kind, op.group, op.count))
    return out


def test_widths_are_the_cpp_proxys():
    cfg = PRESETS["gpt2-large"]
    C, V = cfg.n_embd, cfg.vocab_size
    assert 632 * C == P2PSIZE
    assert cfg.layer_params == INTERSIZE
    assert INTERSIZE + V * C + cfg.max_seq_len * C == BEGINSIZE
    assert INTERSIZE + V * C + 2 * C == ENDSIZE


def test_stage_first_middle_last_send_the_cpp_messages_in_order():
    """36 layers, 4 stages, 8 micro-batches, 2 replicas (world 8, stage = rank % 4): every
    message of ranks 0 (stage 0), 1 (a middle stage) and 3 (the last), in order."""
    j = job(["36", "4", "8", "--model", "dnn-cpp-proxies", "--dry-run"], 8)
    m, a = 8, P2PSIZE
    want = {
        # stage 0: Isend to stage 1 per micro-batch; Irecv from it per micro-batch; then
        # wte + wpe + layer 0, and layers 1..8 one by one.
        0: [(((1, a),), ())] * m
        + [((), ((1, a),))] * m
        + [("allreduce", "dp", BEGINSIZE)]
        + [("allreduce", "dp", INTERSIZE)] * 8,
        # a middle stage sends micro-batch i on while it receives micro-batch i (Waitall).
        1: [(((2, a),), ((0, a),))] * m
        + [(((0, a),), ((2, a),))] * m
        + [("allreduce", "dp", INTERSIZE)] * 9,
        3: [((), ((2, a),))] * m
        + [(((2, a),), ())] * m
        + [("allreduce", "dp", INTERSIZE)] * 8
        + [("allreduce", "dp", ENDSIZE)],
    }
    for rank, ops in want.items():
        plan = j.plan(rank)
        assert trace(plan) == ops, rank
        # Micro-batches 0..7 forward, then 0..7 backward; both messages of a step the same.
        mbs = [{g.mb for g in (*op.sends, *op.recvs)} for op in plan.ops if isinstance(op, P2P)]
        assert mbs == [{i} for i in range(m)] * 2
        assert "embed" not in plan.groups  # no tied-embedding allreduce
        assert not any(isinstance(op, Compute) for op in plan.ops)  # it computes nothing
    # The allreduces cover each stage's whole flat buffer once, in consecutive ranges.
    for rank in range(4):
        plan, s = j.plan(rank), rank
        colls = [op for op in plan.ops if isinstance(op, Collective)]
        bounds = [(op.buf.lo, op.buf.hi) for op in colls]  # Spans of the flat gradients
        assert [lo for lo, _ in bounds] == [0] + [hi for _, hi in bounds[:-1]]
        cfg = PRESETS["gpt2-large"]
        assert bounds[-1][1] == stage_params(cfg, range(9 * s, 9 * s + 9), s == 0, s == 3)


def test_uneven_split_keeps_every_layer():
    """38 layers over 4 stages: 10-10-9-9 (the C++ proxy would run 9 per stage, dropping 2)."""
    j = job(["38", "4", "--model", "dnn-cpp-proxies", "--dry-run"], 8)
    counts = [[op.count for op in j.plan(r).ops if isinstance(op, Collective)] for r in range(4)]
    assert list(map(len, counts)) == [10, 10, 9, 9]
    assert counts[0] == [BEGINSIZE] + [INTERSIZE] * 9
    assert counts[3] == [INTERSIZE] * 8 + [ENDSIZE]


def test_one_stage_and_one_replica():
    """One stage: no messages, wte + wpe in the first allreduce, ln_f in the last, wte once.
    One replica per stage: no allreduce (the C++ proxy's allreduce_group_size > 1 test)."""
    cfg = PRESETS["gpt2-tiny"]
    C, V = cfg.n_embd, cfg.vocab_size
    one = job(["3", "1", "--schedule", "cpp", "--dry-run"], 2).plan(0)
    layer = cfg.layer_params
    assert trace(one) == [
        ("allreduce", "dp", layer + V * C + cfg.max_seq_len * C),
        ("allreduce", "dp", layer),
        ("allreduce", "dp", layer + 2 * C),
    ]
    (single,) = job(["1", "1", "--schedule", "cpp", "--dry-run"], 2).plan(0).ops
    assert single.count == cfg.with_layers(1).num_params
    alone = job(["4", "4", "--model", "dnn-cpp-proxies", "--dry-run"], 4)
    for r in range(4):
        assert not any(isinstance(op, Collective) for op in alone.plan(r).ops)


@pytest.mark.parametrize(
    "argv,world",
    [
        (["36", "4", "8", "--model", "dnn-cpp-proxies"], 8),
        (["36", "8", "8", "--model", "dnn-cpp-proxies"], 64),
        (["8", "4", "1", "--schedule", "cpp"], 8),
        (["6", "3", "5", "--schedule", "cpp", "--order", "megatron"], 12),
        (["7", "2", "3", "--schedule", "cpp"], 2),
    ],
)
def test_plans_are_valid(argv, world):
    plans = [job([*argv, "--dry-run"], world).plan(r) for r in range(world)]
    simulate(plans)


def test_defaults_of_the_preset_and_the_schedule():
    args = parser().parse_args(["--model", "dnn-cpp-proxies", "--dry-run"])
    j = make_job(args, 1)
    c = j.config
    assert (c["layers"], c["seq_len"], c["micro_batch"], c["micro_batches"]) == (36, 632, 1, 8)
    assert (c["schedule"], c["compute"], c["grad_sync"], c["data"]) == (
        "cpp",
        "none",
        "per-layer",
        "none",
    )
    # The same sizes with Megatron's traffic: the fused allreduce and the embedding group.
    meg = job(["36", "4", "--model", "dnn-cpp-proxies", "--schedule", "gpipe", "--dry-run"], 8)
    assert meg.config["compute"] == "none" and meg.config["grad_sync"] == "fused"
    assert "embed" in meg.plan(0).groups
    tiny = job(["4", "2", "--schedule", "cpp", "--dry-run"], 4).config
    assert (tiny["model"], tiny["seq_len"], tiny["compute"]) == ("gpt2-tiny", 64, "none")
    assert job(["--dry-run"], 1).config["compute"] == "real"  # the default mode is unchanged


@pytest.mark.slow
def test_dry_run_lists_the_cpp_messages_in_order():
    r = run(
        [sys.executable, "-m", "proxies.gpt2", "36", "4", "8", "--model", "dnn-cpp-proxies",
         "--dry-run", "--world-size", "8", "--show-ranks", "0,3"],
        timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "plan valid: 8 ranks" in r.stdout
    sections = r.stdout.split("ops in order")
    assert len(sections) == 3  # ranks 0 and 3

    def elements(text: str) -> list[int]:
        rows = [row.split("│") for row in text.splitlines() if re.match(r"│\s+\d+ │", row)]
        return [int(cols[6].strip().replace(",", "")) for cols in rows]

    a = P2PSIZE
    assert elements(sections[1]) == [a] * 16 + [BEGINSIZE] + [INTERSIZE] * 8
    assert elements(sections[2]) == [a] * 16 + [INTERSIZE] * 8 + [ENDSIZE]


BAD = [
    (["--schedule", "cpp", "--compute", "real"], ["computes and sleeps nothing", "real"]),
    (["--model", "dnn-cpp-proxies", "--compute", "model"], ["--compute model needs"]),
    (["--model", "dnn-cpp-proxies", "--compute", "replay"], ["--compute replay needs"]),
    (["--model", "dnn-cpp-proxies", "--grad-sync", "buckets"], ["--grad-sync does not apply"]),
    (["--schedule", "cpp", "--grad-sync", "fused"], ["--grad-sync does not apply"]),
    (["--schedule", "cpp", "--bucket-mb", "1"], ["--bucket-mb does not apply"]),
    (["--model", "dnn-cpp-proxies", "--zero", "1"], ["--zero does not apply"]),
    (["--schedule", "cpp", "--data", "x.bin"], ["--data does not apply"]),
    (["--model", "dnn-cpp-proxies", "--seq-len", "2048"], ["--seq-len 2048 is longer"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("argv,words", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_combinations_are_one_line_and_exit_2(argv, words):
    cmd = [sys.executable, "-m", PROG, "4", "2", *argv, "--dry-run", "--world-size", "4"]
    r = run(cmd, timeout=60)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{PROG}: error: "), r.stderr
    for w in words:
        assert w in lines[0]


@pytest.mark.mpi
def test_bad_combination_ends_every_rank():
    r = mpirun(2, "proxies.gpt2", "2", "2", "--model", "dnn-cpp-proxies", "--compute", "real",
               "--timeout", "20", timeout=60)  # fmt: skip
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "--schedule cpp" in r.stderr
    assert r.stdout == ""


def comm_only(tmp_path, *argv) -> dict:
    out = tmp_path / "run.json"
    r = mpirun(4, "proxies.gpt2", *argv, "--check", "--iters", "1", "--warmup", "1", "--quiet",
               "--json", str(out), timeout=180)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


@pytest.mark.mpi
def test_four_ranks_at_the_cpp_sizes_with_check(tmp_path):
    """4 stages of one replica at the C++ proxy's sizes (its `./gpt2 4 4 4`), every
    message verified: stage 0 and 3 move 4 activations each way, the middle stages 8."""
    got = comm_only(tmp_path, "4", "4", "4", "--model", "dnn-cpp-proxies")
    assert got["config"]["schedule"] == "cpp" and got["config"]["check"] is True
    assert got["bytes"]["pp_send"] == [4 * P2PSIZE * 4, 8 * P2PSIZE * 4, 8 * P2PSIZE * 4,
                                       4 * P2PSIZE * 4]  # fmt: skip
    assert "dp_allreduce" not in got["bytes"] and "embed_allreduce" not in got["bytes"]


@pytest.mark.mpi
def test_four_ranks_per_layer_allreduces_with_check(tmp_path):
    """2 stages x 2 replicas (small widths: the same plan code, seconds on 2 cores): one
    verified allreduce per layer, no embedding allreduce, no compute."""
    got = comm_only(tmp_path, "4", "2", "4", "--schedule", "cpp")
    cfg = PRESETS["gpt2-tiny"]
    C, V, L = cfg.n_embd, cfg.vocab_size, cfg.layer_params
    first = 2 * L + V * C + cfg.max_seq_len * C
    last = 2 * L + V * C + 2 * C
    assert got["bytes"]["dp_allreduce"] == [4 * first, 4 * last] * 2
    assert "embed_allreduce" not in got["bytes"]
    assert got["breakdown_s"].get("compute", [0.0]) == [0.0]
