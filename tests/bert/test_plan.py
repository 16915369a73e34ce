"""BERT's plans without MPI: the C++ preset's sizes by hand arithmetic and its order, the
GPT-style plan's messages, the dry run and the usage errors."""

from __future__ import annotations

import json

import pytest

from proxies.bert import cpp
from proxies.bert.proxy import main, make_job, parser
from proxies.core.cli import UsageError
from proxies.core.plan import P2P, Collective, Compute, Span
from proxies.transformer.encoder import PRESETS

LARGE = PRESETS["bert-large"]
C, V = 1024, 30522


def test_cpp_sizes_by_hand():
    assert cpp.activation(C) == 1_049_600 == 8 * 128 * 1024 + 8 * 128
    layer = cpp.layer_sizes(C)
    assert len(layer) == 16 and sum(layer) == 12 * C * C + 13 * C == 12_596_224
    first, last = cpp.first_layer_sizes(LARGE), cpp.last_layer_sizes(LARGE)
    assert len(first) == 21 and sum(first) == 44_379_136  # the C++ BEGINSIZE
    assert len(last) == 26 and sum(last) == 45_984_572  # ENDSIZE
    # word, position, token-type embeddings and the embedding LayerNorm on top of a layer
    assert sum(first) - sum(layer) == V * C + 512 * C + 2 * C + 2 * C
    # pooler and MLM dense (2 (C^2 + C)), MLM LayerNorm, decoder V C + V, NSP 2C + 2
    assert sum(last) - sum(layer) == 2 * (C * C + C) + 2 * C + V * C + V + 2 * C + 2
    # the C++ total_params line: BEGINSIZE + ENDSIZE + INTERSIZE (L - 2)
    stages = [cpp.stage_sizes(LARGE, 6, s == 0, s == 3) for s in range(4)]
    assert sum(map(sum, stages)) == 44_379_136 + 45_984_572 + 12_596_224 * 22
    assert [len(s) for s in stages] == [21 + 5 * 16, 6 * 16, 6 * 16, 5 * 16 + 26]


def cpp_job(world: int, *args: str):
    return make_job(parser().parse_args(["--model", "dnn-cpp-proxies", *args]), world)


def test_cpp_plan_order():
    job = cpp_job(8)  # 24 layers, 4 stages, dp 2, 8 micro-batches
    middle = job.plan(1)  # stage 1 (cpp order: stage = rank % 4)
    p2p = [op for op in middle.ops if isinstance(op, P2P)]
    coll = [op for op in middle.ops if isinstance(op, Collective)]
    assert middle.ops[: len(p2p)] == tuple(p2p)  # the pipeline, then the allreduces
    assert len(p2p) == 16 and [op.sends[0].mb for op in p2p[:8]] == list(range(8))
    fwd = p2p[0]
    assert [m.peer for m in fwd.sends] == [2] and [m.peer for m in fwd.recvs] == [0]
    assert {m.count for op in p2p for m in op.sends + op.recvs} == {1_049_600}
    assert [m.peer for m in p2p[8].sends] == [0] and [m.peer for m in p2p[8].recvs] == [2]
    assert [op.count for op in coll] == cpp.layer_sizes(C) * 6
    lo = 0
    for op in coll:  # consecutive ranges of the stage's gradients, over dp
        assert op.group == "dp" and op.buf == Span("grads", lo, lo + op.count)
        lo += op.count
    first, last = job.plan(0), job.plan(3)
    assert [op.count for op in first.ops if isinstance(op, Collective)][:3] == [
        V * C,
        512 * C,
        2 * C,
    ]
    assert [op.count for op in last.ops if isinstance(op, Collective)][-1] == 2
    assert not any(isinstance(op, P2P) and op.recvs for op in first.ops[:8])  # sends only


def test_cpp_without_dp_allreduces_nothing():
    plan = cpp_job(4).plan(0)
    assert not any(isinstance(op, Collective) for op in plan.ops)


def test_gpt_style_plan_messages():
    job = make_job(parser().parse_args(["4", "2", "--model", "bert-tiny", "--tp", "2"]), 8)
    plan = job.plan(0)  # stage 0, tp rank 0: defaults B 8, T 128, m 8
    tp = [op for op in plan.ops if isinstance(op, Collective) and op.group == "tp"]
    # per micro-batch: the embedding's allreduce, then 2 per layer forward and backward
    assert len(tp) == 8 * (1 + 2 * 2 * 2) and {op.count for op in tp} == {8 * 128 * 64}
    names = [op.name for op in plan.ops if hasattr(op, "name")]
    assert "fwd_embed" in names and "fwd_head" not in names
    # the last stage's head: the decoder's slice (2 N C V/tp, V padded to 30,720) plus the
    # replicated MLM transform (2 N C^2); backward twice each
    last = make_job(parser().parse_args(["4", "2", "--model", "bert-tiny", "--tp", "2"]), 8).plan(1)
    N, Vp = 8 * 128, 30720
    head = {op.name: op.flops for op in last.ops if isinstance(op, Compute) and op.mb == 0}
    assert head["fwd_head"] == 2 * N * 64 * Vp / 2 + 2 * N * 64 * 64
    assert head["bwd_head"] == 2 * head["fwd_head"]


def test_dry_run_json(tmp_path, capsys):
    out = tmp_path / "d.json"
    rc = main(["--dry-run", "--world-size", "16", "--tp", "2", "--json", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["config"]["model"] == "bert-large" and d["config"]["compute"] == "model"
    assert d["config"]["stages"] == 1 and d["config"]["dp"] == 8
    assert d["params"] == LARGE.num_params


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--cp", "2"], "no context parallelism"),
        (["--model", "dnn-cpp-proxies", "--tp", "2"], "--tp does not apply"),
        (["--model", "bert-tiny", "--seq-len", "1"], "at least 2 tokens"),
        (["--model", "bert-tiny", "3", "4"], "more than LAYERS"),
    ],
)
def test_usage_errors(argv, words):
    with pytest.raises(UsageError) as e:  # exit status 2, one line (test_mpi.py runs it)
        main(["--dry-run", "--world-size", "4", *argv])
    assert words in str(e.value) and "\n" not in str(e.value)


def test_cpp_preset_takes_micro_batch_and_seq_len():
    plan = cpp_job(8, "--seq-len", "64", "--micro-batch", "2").plan(1)
    sizes = {m.count for op in plan.ops if isinstance(op, P2P) for m in op.sends + op.recvs}
    assert sizes == {2 * 64 * 1025}  # B T (C + 1)
