"""GPT-3 plans without MPI: the C++ proxy's message sizes and times, valid schedules over a
grid of (pp, micro-batches, virtual stages), gradient buckets, memory, bad input, dry run."""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict

import pytest

from proxies.core.cli import UsageError
from proxies.core.plan import Collective, Compute, Wait
from proxies.core.simulate import simulate
from proxies.gpt3.proxy import main, make_job, parser
from proxies.transformer.layout import layer_tensors
from proxies.transformer.runtime import BufferPool
from proxies.transformer.setup import PRESETS

# spcl/DNN-cpp-proxies gpt3.cpp / gpt3_moe.cpp: GPT-3 175B, micro-batch 1, sequence 2048
PIPE_P2P_SIZE = 25_165_824  # B * T * C
MP_ALLREDUCE_SIZE = 25_165_824  # B * T * C, twice forward and twice backward per layer
DP_ALLREDUCE_SIZE = 452_984_832  # one layer's four weight matrices / 4 model shards
MOE_ALL2ALL_SIZE = 25_165_824  # whole array, blocks of MOE_ALL2ALL_SIZE / 16 experts
MHA_SIZE = 603_979_776  # attention weights of a layer (no tensor parallelism)
MLP_SIZE = 1_207_959_552  # MLP weights of a layer, spread over 16 experts
FWD_RT, BWD_RT = 15_915, 31_830  # us per layer shard at tp 4 on A100


def job(argv: list[str], world: int):
    return make_job(parser().parse_args([*argv, "--dry-run"]), world)


def collectives(plan, group: str | None = None) -> list[Collective]:
    return [op for op in plan.ops if isinstance(op, Collective) and group in (None, op.group)]


def test_cpp_proxy_layout_and_message_sizes_175b():
    # The C++ proxy: one layer per stage, 96 stages, 4 model shards, 2 x 96 micro-batches,
    # GPipe order; 768 ranks give DP 2.
    j = job(["96", "96", "--tp", "4", "--micro-batch", "1", "--schedule", "gpipe"], 768)
    grid, S = j.grid, j.setup
    assert (S.m, S.B, S.T, S.dp) == (192, 1, 2048, 2)
    for rank in (0, 95, 96, 383, 384, 767):  # stage = rank % 96, shard = rank // 96 % 4
        assert grid.coords(rank) == {"pp": rank % 96, "tp": rank // 96 % 4, "dp": rank // 384}
    plan = j.plan(grid.rank_of(pp=50, tp=1, dp=1))
    msgs = [m for _, m, _ in plan.messages()]
    assert {m.count for m in msgs} == {PIPE_P2P_SIZE} and len(msgs) == 4 * S.m
    tp = collectives(plan, "tp")
    assert {(op.kind, op.count) for op in tp} == {("allreduce", MP_ALLREDUCE_SIZE)}
    assert len(tp) == 4 * S.m  # 2 forward + 2 backward per micro-batch and layer
    (dp,) = collectives(plan, "dp")
    C = 12288
    weights = sum(math.prod(s) for _, s in layer_tensors(S)[0] if len(s) == 2)
    assert weights == DP_ALLREDUCE_SIZE
    # The C++ constant counts the weight matrices only: biases (7C/4 sharded, 2C
    # replicated) and 2 layernorms (4C) add 95,232 elements (0.02%).
    assert dp.count == DP_ALLREDUCE_SIZE + 7 * C // 4 + 6 * C == 453_080_064
    assert dp.req and dp.category == "dp_allreduce"
    # First and last stage also hold the vocabulary-parallel embedding shard (padded to a
    # multiple of 128 * 4: the C++ source's commented-out 154,389,504 is 50257 * C / 4).
    first = j.plan(grid.rank_of(pp=0))
    (embed,) = collectives(first, "embed")
    assert embed.count == 50688 * C // 4 and S.vocab == 50688


def test_cpp_times_and_parameter_count():
    args = parser().parse_args(["96", "96", "--tp", "4", "--dry-run"])
    j = make_job(args, 384)
    rate = args.device_tflops * 1e12
    plan = j.plan(j.grid.rank_of(pp=50))
    fwd = [op for op in plan.ops if isinstance(op, Compute) and op.mb == 0 and "fwd" in op.name]
    bwd = [op for op in plan.ops if isinstance(op, Compute) and op.mb == 0 and "bwd" in op.name]
    assert sum(op.model_seconds(rate) for op in fwd) == pytest.approx(FWD_RT * 1e-6, rel=1e-9)
    assert sum(op.model_seconds(rate) for op in bwd) == pytest.approx(BWD_RT * 1e-6, rel=1e-9)
    n = PRESETS["gpt3-175b"].num_params
    assert n == 174_604_259_328 and n > 2**32  # the C++ proxy's 32-bit product prints 162


def test_cpp_moe_proxy_sizes():
    # gpt3_moe.cpp: no tensor parallelism, 16 experts each 1/16 of the MLP (width 4C / 16),
    # top-1, all-to-all of B*T*C in blocks of 1/16; 96 stages x 32 data-parallel ranks.
    argv = ["96", "96", "--moe-experts", "16", "--moe-top-k", "1", "--capacity-factor", "1"]
    j = job([*argv, "--moe-ffn-hidden", "3072", "--micro-batches", "4"], 96 * 32)
    S = j.setup
    assert (S.dp, S.moe.ep) == (32, 16)
    plan = j.plan(j.grid.rank_of(pp=50))
    a2a = collectives(plan, "ep")
    assert {(op.kind, op.count) for op in a2a} == {("alltoall", MOE_ALL2ALL_SIZE)}
    assert len(a2a) == 4 * S.m and len(plan.groups["ep"]) == 16
    (edp,) = collectives(plan, "edp")
    assert edp.count == MLP_SIZE // 16 and len(plan.groups["edp"]) == 2
    (dp,) = collectives(plan, "dp")
    C = 12288
    assert dp.count == MHA_SIZE + 4 * C + 4 * C + 16 * C  # + attention biases, LNs, gate
    assert len(plan.groups["dp"]) == 32


def check_plan_invariants(j) -> None:
    S, plans = j.setup, [j.plan(r) for r in range(j.grid.size)]
    simulate(plans, cost=lambda r, op: op.model_seconds(1e12) if isinstance(op, Compute) else 0.0)
    for p in plans:
        names = Counter(op.name for op in p.ops if isinstance(op, Compute))
        for ch in S.chunks(p.coords["pp"]):
            for l in ch.layers:
                assert names[f"fwd_attn:{l}"] == names[f"bwd_attn:{l}"] == S.m
        assert p.ops[-1] == Compute("optimizer")
        # every bucket posted once, waited once, never more than --inflight-buckets at once
        posted: list[str] = []
        live = 0
        for op in p.ops:
            if isinstance(op, Collective) and op.req:
                posted.append(op.req)
                live += 1
                assert live <= S.inflight or not S.inflight
            elif isinstance(op, Wait):
                live -= 1
        assert live == 0 and len(posted) == len(set(posted))


GRID = [
    # (pp, m, v, schedule)
    (1, 1, 1, "1f1b"),
    (1, 3, 2, "interleaved"),
    (2, 1, 1, "1f1b"),
    (2, 3, 1, "gpipe"),
    (2, 4, 2, "interleaved"),
    (2, 2, 4, "interleaved"),
    (4, 3, 1, "1f1b"),
    (4, 8, 1, "gpipe"),
    (4, 4, 2, "interleaved"),
    (4, 8, 2, "interleaved"),
    (8, 16, 1, "1f1b"),
]


@pytest.mark.parametrize("pp,m,v,schedule", GRID)
@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--sequence-parallel"],
        ["--moe-experts", "4", "--ep", "2"],
        ["--moe-experts", "4", "--ep", "2", "--sequence-parallel"],
        ["--dp-bucket", "5000"],
    ],
    ids=["dense", "sp", "moe", "moe-sp", "bucket"],
)
def test_plans_validate(pp, m, v, schedule, extra):
    argv = ["8", str(pp), "--model", "gpt3-tiny", "--seq-len", "16", "--tp", "2"]
    argv += ["--micro-batches", str(m), "--virtual-stages", str(v), "--schedule", schedule]
    j = job([*argv, *extra], 2 * pp * 2)
    check_plan_invariants(j)


@pytest.mark.parametrize("inflight", ["0", "1", "3"])
def test_bucket_limits(inflight):
    j = job(["8", "2", "--model", "gpt3-tiny", "--inflight-buckets", inflight], 4)
    check_plan_invariants(j)
    plan = j.plan(0)
    assert len(collectives(plan, "dp")) == 5  # 4 layers and the embedding, one bucket each


def test_comm_only_memory_is_two_buckets_not_all_gradients():
    j = job(["96", "8", "--tp", "4"], 64)  # 12 layers per stage, DP 2
    plan = j.plan(j.grid.rank_of(pp=3))
    largest = max(op.nbytes for op in collectives(plan))
    assert all(m.nbytes < largest for _, m, _ in plan.messages())
    grads = sum(op.nbytes for op in collectives(plan, "dp"))
    pool = BufferPool(plan, j.setup.inflight)
    assert pool.nbytes <= 2.5 * largest  # 2 buckets + pipeline and TP buffers
    assert grads > 5 * pool.nbytes


BAD = [
    (["96", "8", "--tp", "5"], 80, "--tp 5 does not divide gpt3-175b's 96 attention heads"),
    (["96", "8", "--tp", "4"], 48, "world size 48 is not dp * tp * pp"),
    (["8", "2", "--moe-experts", "6", "--ep", "4"], 8, "--moe-experts 6 cannot be spread"),
    (["8", "2", "--moe-experts", "8", "--ep", "3"], 8, "--ep 3 does not divide"),
    (["12", "2", "--virtual-stages", "4"], 2, "--virtual-stages 4 does not divide the 6 layers"),
    (["8", "2", "--virtual-stages", "2", "--micro-batches", "3"], 2, "multiple of STAGES = 2"),
    (["8", "2", "--virtual-stages", "2", "--schedule", "gpipe"], 2, "interleaved schedule"),
    (["8", "9"], 9, "STAGES = 9 is more than LAYERS = 8"),
    (["8", "2", "--seq-len", "4096"], 2, "context of 2048"),
    (["8", "2", "--tp", "2", "--sequence-parallel", "--seq-len", "7"], 4, "multiple of --tp 2"),
    (["8", "2", "--order", "pp-xx"], 2, "rank order"),
    (["8", "1", "--layers-only", "--compute", "real"], 1, "--layers-only has no loss"),
]


@pytest.mark.parametrize("argv,world,words", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_input_is_a_usage_error(argv, world, words):
    with pytest.raises(UsageError) as e:
        make_job(parser().parse_args(argv), world)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_dry_run_plans_1536_ranks(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["96", "16", "--tp", "8", "--micro-batches", "32", "--virtual-stages", "2"]
    assert main([*argv, "--dry-run", "--world-size", "1536", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "174,604,259,328 parameters" in text and "plan valid" in text
    got = json.loads(out.read_text())
    assert got["params"] == 174_604_259_328 and got["world_size"] == 1536
    assert len(got["bytes"]["pp_send"]) == 1536 and got["simulated_ranks"] == 16
    assert got["grid"] == {"order": "pp-tp-dp", "pp": 16, "tp": 8, "dp": 12}


def test_messages_beyond_2_31_elements_are_planned_in_64_bit():
    # 175B on one stage without TP, buckets of 2 layers: 3.6e9 elements a message (the
    # engine sends it in pieces of 2^30; the pool holds two such buckets).
    j = job(["96", "1", "--dp-bucket", "3000000000"], 2)
    plan = j.plan(0)
    counts = [op.count for op in collectives(plan, "dp")]
    assert len(counts) == 49 and max(counts) == 2 * (12 * 12288**2 + 13 * 12288) > 2**31
    assert BufferPool(plan, 2).size["grad0"] == max(counts)


def _tp_traffic_by_piece(plan) -> dict[tuple[str, object], list[Collective]]:
    """The TP collectives on tp_buf, grouped by the compute piece they belong to: forward
    the piece before (its output), backward the piece after (its input). Pieces "x:l" map
    to layer l, others ("fwd_embed", "bwd_head" ...) to their name without the direction."""
    out: dict[tuple[str, object], list[Collective]] = defaultdict(list)
    prev, pending = "", []

    def key(name: str) -> tuple[str, object]:
        way, _, rest = name.partition("_")
        what, _, layer = rest.partition(":")
        return way, int(layer) if layer else what

    for op in plan.ops:
        if isinstance(op, Compute):
            out[key(op.name)] += pending if op.name.startswith("bwd") else []
            pending = [] if op.name.startswith("bwd") else pending
            prev = op.name
        elif isinstance(op, Collective) and op.group == "tp" and op.buf == "tp":
            if prev.startswith("fwd"):
                out[key(prev)].append(op)
            else:
                pending.append(op)
    assert not pending
    return out


SP13B = ["40", "1", "--model", "gpt3-13b", "--tp", "4", "--sequence-parallel"]


def test_sequence_parallel_per_layer_traffic_13b(capsys):
    # Megatron's sequence parallelism, per layer: forward AG before qkv, RS after proj, AG
    # before fc, RS after fcproj; backward AG of fcproj's d out, AG of fc's input again
    # (its weight gradient), RS of fc's d input, AG of proj's d out, AG of qkv's input
    # again, RS of qkv's d input: 4 AG + 2 RS (the allreduce layout's 2 + 2 carried 80%).
    argv = [*SP13B, "--micro-batches", "1", "--dry-run", "--world-size", "8"]
    j = make_job(parser().parse_args(argv), 8)
    plan = j.plan(0)
    BTC = 1 * 2048 * 5120  # every TP collective is the whole (B,T,C) array, B = 1, T = 2048
    AG, RS = "allgather", "reduce_scatter"
    by = _tp_traffic_by_piece(plan)
    for l in range(40):
        assert [op.kind for op in by[("fwd", l)]] == [AG, RS, AG, RS], l
        assert [op.kind for op in by[("bwd", l)]] == [AG, AG, RS, AG, AG, RS], l
        assert {op.count for op in by[("fwd", l)] + by[("bwd", l)]} == {BTC}
        assert sum(op.nbytes for op in by[("bwd", l)]) == 6 * 4 * 10_485_760 == 251_658_240
    # outside the layers: the embedding's allreduce and its backward's AG, ln_f's AG, and
    # the LM head's (column-parallel, tied to wte) AG of ln_f again and RS of its d input
    rest = {k: [op.kind for op in v] for k, v in by.items() if not isinstance(k[1], int) and v}
    assert rest == {
        ("fwd", "embed"): ["allreduce"],
        ("fwd", "lnf"): [AG],
        ("bwd", "head"): [AG],
        ("bwd", "lnf"): [RS],
        ("bwd", "embed"): [AG],
    }
    # the backward's FLOPs stay twice the forward's, split at the re-gathers: qkv's
    # 2 x 6BTC^2 / tp after ln1's, fc's 2 x 8BTC^2 / tp after ln2's
    flops = {op.name: op.flops for op in plan.ops if isinstance(op, Compute)}
    C, T = 5120, 2048
    assert flops["bwd_attn:7"] == 12 * T * C * C / 4 and flops["bwd_mlp:7"] == 16 * T * C * C / 4
    fwd = flops["fwd_attn:7"] + flops["fwd_mlp:7"]
    bwd = sum(flops[f"bwd_{p}:7"] for p in ("fcproj", "mlp", "proj", "attn"))
    assert bwd == pytest.approx(2 * fwd, rel=1e-12)
    # the dry run prints it: 40 x 6 + 4 allgathers (ln_f, the loss's statistics, the LM
    # head's input, the embedding's d), 40 x 4 + 1 reduce-scatters
    assert main(argv + ["--show-ranks", "0"]) == 0
    text = capsys.readouterr().out
    assert "bwd_fcproj:39 mb 0" in text and "plan valid" in text
    ag = [line for line in text.splitlines() if " allgather " in line and " 244 " in line]
    assert ag and f"{243 * BTC + 4 * 3 * 2048:,}" in ag[0]
    assert any(" reduce_scatter " in line and " 161 " in line for line in text.splitlines())


def test_moe_sequence_parallel_plan_tiny():
    # gpt3-tiny (C 64), T 32, tp 2 x ep 2 (world 4), E 4, k 2, capacity factor 1: a rank
    # routes its shard of Ns = 32 / 2 = 16 tokens, capacity ceil(1 * 2 * 16 / 4) = 8 slots
    # per expert; its dispatch is (E, cap, C) = 4 * 8 * 64 = 2048 floats, the TP gather of
    # every rank's dispatch 2 x 2048.
    argv = ["2", "1", "--model", "gpt3-tiny", "--seq-len", "32", "--tp", "2", "--ep", "2"]
    argv += ["--moe-experts", "4", "--capacity-factor", "1", "--micro-batches", "1"]
    j = job([*argv, "--sequence-parallel"], 4)
    plan = j.plan(0)
    a2a, moe_tp = 4 * 8 * 64, 2 * 4 * 8 * 64
    seq = [
        (op.name if isinstance(op, Compute) else (op.kind, op.buf, op.count))
        for op in plan.ops
        if isinstance(op, Compute) or (isinstance(op, Collective) and op.group in ("tp", "ep"))
    ]
    start = seq.index("fwd_ln1:1")
    BTC = 32 * 64
    assert seq[start : start + 12] == [
        "fwd_ln1:1", ("allgather", "tp", BTC),
        "fwd_attn:1", ("reduce_scatter", "tp", BTC),
        "fwd_gate:1", ("alltoall", "moe", a2a), ("allgather", "moe_tp", moe_tp),
        "fwd_expert:1", ("reduce_scatter", "moe_tp", moe_tp), ("alltoall", "moe", a2a),
        "fwd_combine:1", "fwd_lnf",
    ]  # fmt: skip
    start = seq.index("bwd_combine:1")
    assert seq[start : start + 16] == [
        "bwd_combine:1", ("alltoall", "moe", a2a), ("allgather", "moe_tp", moe_tp),
        "bwd_expert:1", ("reduce_scatter", "moe_tp", moe_tp), ("alltoall", "moe", a2a),
        "bwd_gate:1", "bwd_ln2:1", ("allgather", "tp", BTC),
        "bwd_proj:1", ("allgather", "tp", BTC),
        "bwd_attn:1", ("reduce_scatter", "tp", BTC),
        "bwd_ln1:1", "bwd_combine:0", ("alltoall", "moe", a2a),
    ]  # fmt: skip
    # no d(score) allreduce: with SP a rank's combine has its tokens' complete outputs;
    # the router's gradient is summed over TP with the layernorms' (6C per layer + 4C gate)
    assert not [op for op in collectives(plan) if op.buf == "moe_dscore"]
    (sp_grads,) = [op for op in collectives(plan) if op.buf == "sp_grads"]
    assert sp_grads.count == 2 * (5 * 64 + 4 * 64) + 2 * 64
    # without SP: every rank routes all 32 tokens, capacity 16, one all-to-all of twice that
    plain = job(argv, 4).plan(0)
    assert {op.count for op in collectives(plain, "ep")} == {2 * a2a}
