"""LLaMA / Mixtral plans without MPI: parameter counts, message sizes and FLOPs by hand
(GQA's qkv width and k,v exchanges, SwiGLU), valid plans over the parallelisms, every
gradient reduced once, bad input, the 8,192-rank dry run."""

from __future__ import annotations

import math
import subprocess
import sys
from collections import Counter

import pytest

from proxies.core.cli import UsageError
from proxies.core.plan import Collective, Compute, Wait
from proxies.core.simulate import simulate
from proxies.llama.proxy import main, make_job, parser
from proxies.transformer.layout import Layout
from proxies.transformer.llama import PRESETS


def job(argv: list[str], world: int):
    return make_job(parser().parse_args([*argv, "--dry-run"]), world)


def colls(plan, group: str | None = None) -> list[Collective]:
    return [op for op in plan.ops if isinstance(op, Collective) and group in (None, op.group)]


def test_parameter_counts():
    # Meta's and Mistral's published totals
    assert PRESETS["llama3-8b"].num_params == 8_030_261_248
    assert PRESETS["llama3-70b"].num_params == 70_553_706_496
    assert PRESETS["mixtral-8x7b"].num_params == 46_702_792_704
    # by hand: 8B's layer = qkv (32 + 2 * 8) * 128 * 4096 + wo 4096^2 + 3 * 4096 * 14336 + 2C
    assert PRESETS["llama3-8b"].layer_params == 6144 * 4096 + 4096**2 + 3 * 4096 * 14336 + 8192


def test_llama3_8b_message_sizes_and_flops():
    # tp 2, pp 2, dp 2: B 1, T 8192, C 4096, KVH 8, hs 128, F 14336
    j = job(["32", "2", "--model", "llama3-8b", "--tp", "2", "--micro-batches", "4"], 8)
    S, B, T, C, F = j.setup, 1, 8192, 4096, 14336
    assert (S.dp, S.T, S.tp) == (2, T, 2)
    plan = j.plan(j.grid.rank_of(pp=1, tp=1, dp=0))
    assert {m.count for _, m, _ in plan.messages()} == {B * T * C}  # pipeline: B T C
    tp = colls(plan, "tp")
    assert {op.count for op in tp if op.kind == "allreduce"} == {B * T * C}
    # 2 forward + 2 backward per layer and micro-batch; the head's loss allgathers 3 N per rank
    assert sum(op.kind == "allreduce" for op in tp) == 4 * 16 * 4 + 4  # + the head's dlnf
    assert "embed" not in plan.groups  # untied head: no embedding allreduce
    # the qkv shard: (NH + 2 KVH) hs / tp rows = (32 + 16) * 128 / 2
    lay = Layout(S, 1)
    shapes = {n: s for n, s, _ in lay.dense}
    assert shapes["h.16.attn.c_attn.weight"] == (3072, C)
    assert shapes["h.16.mlp.c_fc.weight"] == (F, C)  # [gate; up] / tp = 2F / 2
    assert shapes["h.16.mlp.c_proj.weight"] == (C, F // 2)
    assert shapes["lm_head"] == (128256 // 2, C)  # 128,256 = 501 x 128 tp: no padding
    assert "wpe" not in shapes and "ln_f.bias" not in shapes
    # dp: every gradient once; one bucket per layer plus the head's (ln_f + lm_head)
    dp = colls(plan, "dp")
    assert sum(op.count for op in dp) == lay.dense_size
    layer = (3072 * C + C * C // 2 + 3 * C * F // 2) + 2 * C
    assert Counter(op.count for op in dp)[layer] == 16
    assert lay.dense_size == 16 * layer + C + Vp_rows(2) * C
    # FLOPs: attention 2BTC(C + 2 KVH hs) + 2BTC^2 + 4BT^2C, MLP 6BTCF, per tp shard
    ops = {op.name: op.flops for op in plan.ops if isinstance(op, Compute)}
    assert ops["fwd_attn:20"] == (2 * B * T * C * 6144 + 2 * B * T * C * C + 4 * B * T * T * C) / 2
    assert ops["fwd_mlp:20"] == 6 * B * T * C * F / 2
    assert ops["fwd_head"] == 2 * B * T * C * Vp_rows(2)


def Vp_rows(tp: int) -> int:
    return -(-128256 // (128 * tp)) * 128 * tp // tp


@pytest.mark.parametrize("comm", ["ring", "allgather", "alltoall"])
def test_cp_exchanges_are_sized_by_the_kv_heads(comm):
    # llama3-8b, tp 2, cp 2: a rank's k,v = B T/cp 2 KVH hs / tp = 4096 * 2 * 8 * 128 / 2
    argv = ["32", "1", "--model", "llama3-8b", "--tp", "2", "--cp", "2", "--cp-comm", comm]
    j = job([*argv, "--micro-batches", "1"], 4)
    plan = j.plan(0)
    kv = 4096 * 2 * 8 * 128 // 2
    if comm == "ring":
        sizes = {m.count for _, m, _ in plan.messages()}
        assert sizes == {kv}  # cp 2: k,v forward; k,v then dk,dv backward
    elif comm == "allgather":
        assert {op.count for op in colls(plan, "cp")} == {2 * kv}
    else:  # Ulysses: qkv (NH + 2 KVH) hs / tp, the output C / tp, per token
        assert {op.count for op in colls(plan, "cp")} == {4096 * 6144 // 2, 4096 * 4096 // 2}


def test_mixtral_ep8_sizes():
    # 32 layers, pp 4, tp 2, dp 8 = ep 8: experts spread one per ep rank
    argv = ["32", "4", "--model", "mixtral-8x7b", "--tp", "2", "--seq-len", "4096"]
    j = job([*argv, "--ep", "8", "--micro-batches", "4"], 64)
    S, C, F, E, N = j.setup, 4096, 14336, 8, 4096
    assert (S.moe.experts, S.moe.top_k, S.moe.ep, S.moe.ffn_hidden) == (E, 2, 8, F)
    plan = j.plan(j.grid.rank_of(pp=2, tp=0, ep=3, dp=0))
    cap = math.ceil(2 * N / E)  # capacity factor 1, top-2
    assert {op.count for op in colls(plan, "ep")} == {E * cap * C}
    ops = {op.name: op.flops for op in plan.ops if isinstance(op, Compute)}
    assert ops["fwd_expert:16"] == 6 * E * cap * C * F / 2  # SwiGLU experts, tp shards
    lay = Layout(S, 2)
    assert lay.expert_size == 8 * 3 * C * F // 2  # one expert's shard per layer
    assert "edp" not in plan.groups or not colls(plan, "edp")  # edp = dp / ep = 1


def check_plan(j) -> None:
    S, plans = j.setup, [j.plan(r) for r in range(j.grid.size)]
    simulate(plans, cost=lambda r, op: op.model_seconds(1e12) if isinstance(op, Compute) else 0.0)
    for p in plans:
        assert p.ops[-1] == Compute("optimizer")
        lay = Layout(S, p.coords["pp"])
        dp = [op for op in colls(p) if op.req and op.group == "dp"]
        if S.dp * S.cp > 1:  # every dense gradient reduced exactly once
            assert sum(op.count for op in dp) == lay.dense_size
        posted = [op.req for op in colls(p) if op.req]
        waits = [op.req for op in p.ops if isinstance(op, Wait)]
        assert sorted(posted) == sorted(set(posted)) and set(posted) <= set(waits) | set()


@pytest.mark.parametrize(
    "pp,m,v,extra",
    [
        (1, 2, 1, []),
        (2, 4, 1, []),
        (2, 4, 2, []),
        (2, 4, 1, ["--sequence-parallel"]),
        (2, 4, 2, ["--sequence-parallel"]),
        (2, 4, 1, ["--dp-bucket", "20000"]),
        (1, 2, 1, ["--cp", "2"]),
        (2, 2, 1, ["--cp", "2", "--sequence-parallel"]),
        (2, 4, 1, ["--model", "mixtral-tiny", "--ep", "2"]),
        (2, 4, 2, ["--model", "mixtral-tiny", "--ep", "2", "--sequence-parallel"]),
    ],
)
def test_plans_validate(pp, m, v, extra):
    argv = ["4", str(pp), "--model", "llama-tiny", "--seq-len", "16", "--tp", "2"]
    argv += ["--micro-batches", str(m), "--virtual-stages", str(v), *extra]
    cp = int(extra[extra.index("--cp") + 1]) if "--cp" in extra else 1
    check_plan(job(argv, 2 * pp * 2 * cp))


BAD = [
    (["32", "1", "--model", "llama3-8b", "--tp", "16"], 16, "does not divide llama3-8b's 8 key"),
    (["4", "1", "--model", "llama-tiny", "--tp", "4"], 4, "--tp 4 does not divide"),
    (
        ["4", "1", "--model", "llama-tiny", "--tp", "2", "--cp", "2", "--cp-comm", "alltoall"],
        4,
        "splits the 1 key/value heads",
    ),
]


@pytest.mark.parametrize("argv,world,words", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_input_is_a_usage_error(argv, world, words):
    with pytest.raises(UsageError) as e:
        make_job(parser().parse_args(argv), world)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2():
    argv = ["32", "1", "--model", "llama3-8b", "--tp", "16", "--dry-run", "--world-size", "16"]
    r = subprocess.run(
        [sys.executable, "-m", "proxies.llama", *argv], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and "8 key/value heads" in r.stderr


def test_dry_run_llama3_70b_8192_ranks(capsys):
    argv = ["80", "8", "--model", "llama3-70b", "--tp", "8", "--cp", "2"]
    assert main([*argv, "--dry-run", "--world-size", "8192"]) == 0
    out = capsys.readouterr().out
    assert "pp 8 x dp 64" in out and "plan valid" in out
    assert "70,553,706,496 parameters" in out
    # the ring's k,v block: T/cp 4096 tokens x 2 KVH hs / tp = 2 * 8 * 128 / 8
    assert "cp ring 1 x 1,048,576 floats" in out
