"""--fsdp's plans on LLaMA (untied head), BERT, and with tp + sequence parallelism and cp,
checked by hand: the units and their sizes, which group each collective runs on, the
sequence-parallel sum's size, every piece running with its units gathered; bad input is
one UsageError (cli.run_main: one line, exit status 2). Real-compute equalities:
test_fsdp_fronts_mpi.py."""

from __future__ import annotations

import pytest

from proxies.bert import proxy as bert
from proxies.core.cli import UsageError
from proxies.core.plan import Collective, Compute, Wait
from proxies.gpt3 import proxy as gpt3
from proxies.llama import proxy as llama
from proxies.transformer import fsdp
from proxies.transformer.layout import Layout

LLAMA = ["--model", "llama-tiny", "--seq-len", "16", "--fsdp"]
BERT = ["--model", "bert-tiny", "--seq-len", "16", "--micro-batch", "2", "--fsdp"]
GPT3 = ["--model", "gpt3-tiny", "--seq-len", "16", "--fsdp"]
SP = ["--tp", "2", "--sequence-parallel"]


def job(mod, argv: list[str], world: int):
    return mod.make_job(mod.parser().parse_args([*argv, "--dry-run"]), world)


def test_llama_units_by_hand():
    """llama-tiny (C 64, V 256, no biases): stage 0 holds wte (256 x 64) and layers 0-1,
    stage 1 layers 2-3 and the head unit (ln_f's 64 and lm_head's 256 x 64), both
    sharded over dp 2; at tp 2 the vocabulary rows are halved."""
    S = job(llama, ["4", "2", *LLAMA], 4).setup
    first = [(u.key, u.size) for u, _, _ in fsdp.shard_units(Layout(S, 0))]
    last = [(u.key, u.size) for u, _, _ in fsdp.shard_units(Layout(S, 1))]
    layer = first[0][1]
    assert first == [("h.1", layer), ("h.0", layer), ("wte", 256 * 64)]
    assert last == [("head", 64 + 256 * 64), ("h.3", layer), ("h.2", layer)]
    S = job(llama, ["4", "1", *LLAMA, "--tp", "2"], 4).setup
    keys = {u.key: u.size for u, _, _ in fsdp.shard_units(Layout(S, 0))}
    assert keys["wte"] == 128 * 64 and keys["head"] == 64 + 128 * 64
    assert fsdp.unit_sides(S, set(keys)) == (("wte",), ("head",))


def walk(plan, S, stage: int) -> None:
    """A piece naming a unit runs between the unit's unshard and reshard, after its
    gather's Wait; nothing stays gathered at the end."""
    ch = S.chunks(stage)[0]
    sides = fsdp.unit_sides(S, {u.key for u, _, _ in fsdp.shard_units(Layout(S, stage))})
    live: set[str] = set()
    waited: set[str] = set()
    for op in plan.ops:
        if isinstance(op, Compute) and op.name.startswith("fsdp_unshard:"):
            key = op.name.split(":")[1]
            assert any(w.endswith(f":{key}") for w in waited), key
            live.add(key)
        elif isinstance(op, Compute) and op.name.startswith("fsdp_reshard:"):
            live.remove(op.name.split(":")[1])
        elif isinstance(op, Compute) and not op.name.startswith(("fsdp_sp", "optimizer")):
            need = set(fsdp._units_of(op.name, ch, sides))
            assert need <= live, (op.name, need - live)
        elif isinstance(op, Wait) and op.req.startswith("fsdp_ag:"):
            waited.add(op.req)
    assert not live


CASES = [
    (llama, ["2", "1", *LLAMA], 2),
    (llama, ["4", "2", *LLAMA, "--micro-batches", "4"], 4),
    (llama, ["2", "1", *LLAMA, *SP], 4),
    (llama, ["2", "2", *LLAMA, "--cp", "2", "--micro-batches", "2"], 8),
    (gpt3, ["2", "2", *GPT3, *SP, "--micro-batches", "2"], 8),
    (gpt3, ["2", "1", *GPT3, "--cp", "2"], 4),
    (bert, ["2", "2", *BERT, "--micro-batches", "2"], 4),
    (bert, ["2", "1", *BERT, "--tp", "2"], 4),
]


@pytest.mark.parametrize("mod,argv,world", CASES, ids=lambda x: getattr(x, "__name__", None))
def test_every_piece_runs_with_its_units_gathered(mod, argv, world):
    j = job(mod, argv, world)
    for rank in range(world):
        walk(j.plan(rank), j.setup, j.grid.coords(rank)["pp"])


def test_sequence_parallel_sums_the_shards_layernorms_over_tp():
    """tp 2 + SP x dp 2: after the reduce-scatters, one tp allreduce of the rank's shard
    elements of the sequence-parallel partial tensors (llama-tiny: ln_1, ln_2 per layer, 64
    each, and ln_f: 2 x 128 + 64 = 320 over the two shard blocks), then AdamW."""
    j = job(llama, ["2", "1", *LLAMA, *SP], 4)
    counts = {}
    for rank in range(4):
        ops = j.plan(rank).ops
        sp = [op for op in ops if isinstance(op, Collective) and op.buf == "fsdp_sp"]
        assert len(sp) == 1 and sp[0].group == "tp" and sp[0].category == "tp_allreduce"
        names = [op.name for op in ops[-4:] if isinstance(op, Compute)]
        assert names == ["fsdp_sp_pack", "fsdp_sp_unpack", "optimizer"]
        counts[j.grid.coords(rank)["dp"], j.grid.coords(rank)["tp"]] = sp[0].count
    assert counts[0, 0] == counts[0, 1] and counts[1, 0] == counts[1, 1]  # tp peers agree
    assert counts[0, 0] + counts[1, 0] == 2 * 2 * 64 + 64 == Layout(j.setup, 0).sp_size
    assert counts[1, 0] == 0  # ln_1 and ln_2 lie in a layer's first half, ln_f leads "head"


def test_context_parallel_shards_over_dp_times_cp():
    """cp 2 x dp 2 (x pp 2): each unit is gathered and reduce-scattered over the 4 ranks of
    the rank's stage (the whole padded unit gathered from quarters)."""
    j = job(llama, ["2", "2", *LLAMA, "--cp", "2", "--micro-batches", "2"], 8)
    S = j.setup
    assert S.fsdp == 4
    for rank in range(8):
        plan = j.plan(rank)
        stage = j.grid.coords(rank)["pp"]
        same = sorted(r for r in range(8) if j.grid.coords(r)["pp"] == stage)
        assert sorted(plan.groups["fsdp"]) == same
        units = [u for u, _, _ in fsdp.shard_units(Layout(S, stage))]
        gathers = [
            op for op in plan.ops if isinstance(op, Collective) and op.buf.startswith("fsdp_ag")
        ]
        assert {op.group for op in gathers} == {"fsdp"}
        assert {op.count for op in gathers} == {u.padded(4) for u in units}


BAD = [
    (
        llama,
        ["2", "1", "--model", "mixtral-tiny", "--fsdp"],
        2,
        "--fsdp does not combine with --moe-experts",
    ),
    (
        llama,
        ["2", "1", *LLAMA, "--cp", "2", "--fsdp-shard-size", "3"],
        4,
        "divide the dp x cp ranks 4",
    ),
    (bert, ["2", "1", *BERT], 1, "its degree is 1"),
    (bert, ["2", "1", *BERT, "--bucket-mb", "1"], 2, "--fsdp does not combine with --bucket-mb"),
    (bert, ["2", "2", "--model", "dnn-cpp-proxies", "--fsdp"], 4, "with --model dnn-cpp-proxies"),
    (bert, ["2", "1", "--model", "bert-tiny", "--fsdp-shard-size", "2"], 4, "needs --fsdp"),
]


@pytest.mark.parametrize("mod,argv,world,words", BAD, ids=[b[3][-24:] for b in BAD])
def test_bad_input_is_a_usage_error(mod, argv, world, words):
    """The job builder's UsageError: cli.run_main's one line on stderr and exit status 2."""
    with pytest.raises(UsageError, match=words):
        job(mod, argv, world)


def test_runtime_packs_what_the_plan_sums():
    """Each rank's runtime (real compute) packs as many sequence-parallel elements as its
    plan's tp allreduce sends, and the memory estimate counts that buffer."""
    from proxies.transformer.memory import estimate

    j = job(llama, ["2", "1", *LLAMA, *SP, "--compute", "real"], 4)
    for rank in range(4):
        plan = j.plan(rank)
        (sp,) = [op for op in plan.ops if isinstance(op, Collective) and op.buf == "fsdp_sp"]
        rt = j.runtime(rank, None, None, "real")
        assert rt.fsdp.sp_buf.size == sp.count
        assert rt.fsdp.buffer("fsdp_sp", 0) is rt.fsdp.sp_buf
        without = plan.__class__(
            plan.rank, tuple(op for op in plan.ops if op is not sp), plan.groups, plan.coords
        )
        est = estimate(j.setup, 0, 0, "real", plan)["gradients"]
        assert est - estimate(j.setup, 0, 0, "real", without)["gradients"] == 4 * sp.count
