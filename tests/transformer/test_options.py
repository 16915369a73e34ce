"""transformer/options.py: the GPT front ends' shared rules, and gpt3's --bucket-mb (the
bucket size in gpt2's unit) against --dp-bucket (the same size in elements)."""

from __future__ import annotations

import pytest

from proxies.core.cli import UsageError
from proxies.core.plan import P2P, Collective
from proxies.gpt3.proxy import make_job, parser
from proxies.transformer.options import bucket_elements, split_layers

GPT3 = ["4", "1", "--model", "gpt3-tiny", "--seq-len", "16", "--compute", "none"]


def gpt3_plan(extra: list[str], world: int = 2):
    job = make_job(parser().parse_args(GPT3 + extra), world)
    return job.plan(0), job.config


def test_bucket_elements_is_mib_of_float32():
    assert bucket_elements(1) == 262144  # 2**20 bytes / 4
    assert bucket_elements(0) == 0
    assert bucket_elements(0.3) == 78644  # a bucket closes at >= 78643.2 elements


def test_split_layers():
    assert split_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]


def test_gpt3_bucket_mb_is_dp_bucket_in_mib():
    # gpt3-tiny's layers hold 49,984 gradients each, the embedding unit 3,227,776: 0.2 MiB =
    # 52,429 elements closes a bucket every two layers (4 layers + embedding: 3 buckets; the
    # default, one per layer: 5); the same plan as --dp-bucket 52429
    by_mb, cfg_mb = gpt3_plan(["--bucket-mb", "0.2"])
    by_elems, cfg_elems = gpt3_plan(["--dp-bucket", "52429"])
    default, _ = gpt3_plan([])
    assert cfg_mb["dp_bucket"] == cfg_elems["dp_bucket"] == 52429
    assert by_mb.ops == by_elems.ops

    def posted(plan) -> list[int]:
        return [op.count for op in plan.ops if isinstance(op, Collective) and op.req]

    assert posted(by_mb) == [2 * 49984, 2 * 49984, 3227776]
    assert posted(default) == [49984] * 4 + [3227776]


def test_gpt3_bucket_units_refuse_both():
    with pytest.raises(UsageError, match="--bucket-mb and --dp-bucket"):
        gpt3_plan(["--bucket-mb", "1", "--dp-bucket", "5"])


# -- Megatron-LM's names: the same plan as the native option, conflicts refused -----------

import proxies.gpt2.proxy as gpt2  # noqa: E402
import proxies.gpt3.proxy as gpt3  # noqa: E402


def plans(module, argv: list[str], world: int) -> tuple[list, dict]:
    job = module.make_job(module.parser().parse_args(argv), world)
    ranks = sorted({0, world // 2, world - 1})
    return [job.plan(r).ops for r in ranks], job.config


GPT2_TINY = ["--compute", "none", "--seq-len", "16"]
GPT3_TINY = ["--model", "gpt3-tiny", "--compute", "none", "--seq-len", "16"]

ALIASES = [
    # (module, world, native argv, Megatron argv)
    (gpt2, 4, ["8", "2"], ["--num-layers", "8", "--pipeline-model-parallel-size", "2"]),
    (gpt2, 4, ["8", "2", "4"], ["8", "2", "--global-batch-size", "8"]),  # 4 x 1 x dp 2
    (gpt2, 4, ["8", "2", "--micro-batch", "2"], ["8", "2", "--micro-batch-size", "2"]),
    (gpt2, 4, ["8", "2", "--seq-len", "8"], ["8", "2", "--seq-length", "8"]),
    (
        gpt3,
        8,
        ["4", "2", "--tp", "2"],
        [
            "--num-layers",
            "4",
            "--pipeline-model-parallel-size",
            "2",
            "--tensor-model-parallel-size",
            "2",
        ],
    ),
    (gpt3, 8, ["4", "2", "--tp", "2"], ["4", "--pipeline-model-parallel-size", "2", "--tp", "2"]),
    (gpt3, 8, ["4", "2", "--micro-batches", "6"], ["4", "2", "--global-batch-size", "24"]),
    (
        gpt3,
        4,
        ["4", "2", "--virtual-stages", "2", "--micro-batches", "4"],
        ["4", "2", "--num-layers-per-virtual-pipeline-stage", "1", "--micro-batches", "4"],
    ),
    (
        gpt3,
        4,
        ["2", "1", "--moe-experts", "4", "--ep", "2"],
        ["2", "1", "--num-experts", "4", "--expert-model-parallel-size", "2"],
    ),
]


@pytest.mark.parametrize(
    "module,world,native,alias",
    ALIASES,
    ids=[" ".join(a[3]) for a in ALIASES],
)
def test_megatron_name_gives_the_native_plan(module, world, native, alias):
    tiny = GPT2_TINY if module is gpt2 else GPT3_TINY
    ops, config = plans(module, native + tiny, world)
    ops_alias, config_alias = plans(module, alias + tiny, world)
    assert ops_alias == ops and config_alias == config


CONFLICTS = [
    (gpt2, 4, ["8", "2", "--num-layers", "6"], "--num-layers 6 and LAYERS = 8 differ"),
    (gpt2, 4, ["8", "2", "--pipeline-model-parallel-size", "4"], "and STAGES = 2 differ"),
    (gpt2, 4, ["8", "2", "--global-batch-size", "7"], "not a multiple of micro-batch 1 x"),
    (gpt2, 4, ["8", "2", "3", "--global-batch-size", "8"], "not MICROBATCHES 3"),
    (gpt3, 4, ["4", "2", "--micro-batches", "3", "--global-batch-size", "8"], "not --micro-"),
    (gpt3, 4, ["4", "2", "--num-layers-per-virtual-pipeline-stage", "3"], "does not divide"),
    (gpt3, 4, ["5", "2", "--num-layers-per-virtual-pipeline-stage", "1"], "multiple of STAGES"),
    (
        gpt3,
        4,
        ["4", "2", "--virtual-stages", "1", "--num-layers-per-virtual-pipeline-stage", "1"],
        "2 virtual stages, not --virtual-stages 1",
    ),
]


@pytest.mark.parametrize(
    "module,world,argv,words", CONFLICTS, ids=[" ".join(c[2]) for c in CONFLICTS]
)
def test_megatron_name_conflicts_are_usage_errors(module, world, argv, words):
    tiny = GPT2_TINY if module is gpt2 else GPT3_TINY
    with pytest.raises(UsageError, match=words.replace("-", "\\-")) as e:
        module.make_job(module.parser().parse_args(argv + tiny), world)
    assert "\n" not in str(e.value)


def test_megatron_names_in_help():
    for module, names in (
        (gpt2, ["--num-layers", "--pipeline-model-parallel-size", "--global-batch-size"]),
        (
            gpt3,
            [
                "--tensor-model-parallel-size",
                "--num-layers-per-virtual-pipeline-stage",
                "--num-experts",
                "--expert-model-parallel-size",
                "--make-vocab-size-divisible-by",
                "--sequence-parallel",
            ],
        ),
    ):
        text = module.parser().format_help()
        for name in names + ["--micro-batch-size", "--seq-length"]:
            assert name in text, name


# -- --micro-batches: one option on both front ends (gpt2 also keeps its positional) --------


def test_gpt2_micro_batches_option_is_the_positional():
    by_option, cfg_option = plans(gpt2, ["8", "4", "--micro-batches", "3"], 8)
    by_positional, cfg_positional = plans(gpt2, ["8", "4", "3"], 8)
    assert cfg_option["micro_batches"] == cfg_positional["micro_batches"] == 3
    assert by_option == by_positional
    same, _ = plans(gpt2, ["8", "4", "3", "--micro-batches", "3"], 8)
    assert same == by_positional


def test_gpt2_micro_batches_option_and_positional_differ():
    with pytest.raises(UsageError, match="--micro-batches 3 and MICROBATCHES = 2 differ"):
        plans(gpt2, ["8", "4", "2", "--micro-batches", "3"], 8)


# -- --context: long sequences past the preset's position embedding (context parallelism) ---


def test_context_lengthens_the_position_embedding():
    argv = ["48", "1", "--model", "gpt2-xl", "--seq-len", "16384", "--compute", "none"]
    with pytest.raises(UsageError, match="longer than gpt2-xl's context of 1024 .--context N"):
        plans(gpt2, argv + ["--cp", "8"], 8)
    ops, config = plans(gpt2, argv + ["--context", "16384", "--cp", "8"], 8)
    # the ring's key/value block: B x T/cp x 2C = 1 x 2048 x 3200
    sizes = {
        m.count for op in ops[0] if isinstance(op, P2P) for m in op.sends if m.buf == "cp_kv_out"
    }
    assert sizes == {2048 * 3200}
    # wpe has 16384 rows: 15360 x 1600 more parameters than the preset's 1,557,611,200
    assert config["params"] == 1_557_611_200 + 15360 * 1600
