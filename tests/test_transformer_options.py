"""transformer/options.py: the GPT front ends' shared rules, and gpt3's --bucket-mb (the
bucket size in gpt2's unit) against --dp-bucket (the same size in elements)."""

from __future__ import annotations

import pytest

from proxies.core.cli import UsageError
from proxies.core.plan import Collective
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
