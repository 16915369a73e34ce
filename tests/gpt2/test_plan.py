"""The GPT-2 proxy's plans, without MPI: sizes, layer split, validity for many layouts."""

import pytest

from proxies.core.plan import Collective, Compute
from proxies.core.simulate import simulate
from proxies.gpt2.proxy import make_job, parser, split_layers, stage_params
from proxies.transformer.config import PRESETS


def job(argv, world):
    return make_job(parser().parse_args(argv), world)


def test_megatron_traffic_at_the_cpp_proxy_sizes():
    """GPT-2-large widths, micro-batch 1, sequence 632 in the default (Megatron) mode: the
    C++ proxy's activation size, but one fused allreduce per stage (its per-layer messages:
    tests/gpt2/test_cpp.py)."""
    j = job(
        ["36", "4", "--model", "gpt2-large", "--seq-len", "632", "--micro-batch", "1", "--dry-run"],
        8,
    )
    cfg = PRESETS["gpt2-large"]
    assert cfg.layer_params == 19_677_440
    for rank in range(8):
        plan = j.plan(rank)
        assert {m.count for _, m, _ in plan.messages()} == {808_960}
        stage = plan.coords["pp"]
        (dp,) = [op for op in plan.ops if isinstance(op, Collective) and op.group == "dp"]
        extra = {0: (50257 + 1024) * 1280, 3: 2 * 1280 + 50257 * 1280}.get(stage, 0)
        assert dp.count == 9 * 19_677_440 + extra


@pytest.mark.parametrize("L,pp", [(64, 8), (10, 4), (7, 7), (13, 5), (3, 1)])
def test_layer_split_is_even_and_drops_nothing(L, pp):
    split = split_layers(L, pp)
    assert [i for r in split for i in r] == list(range(L))
    assert max(map(len, split)) - min(map(len, split)) <= (1 if L % pp else 0)


def test_stage_params_sum_to_model_plus_tied_copy():
    cfg = PRESETS["gpt2"]
    split = split_layers(12, 4)
    total = sum(stage_params(cfg, r, s == 0, s == 3) for s, r in enumerate(split))
    assert total == cfg.num_params + cfg.vocab_size * cfg.n_embd  # wte on first and last
    assert stage_params(cfg, range(12), True, True) == cfg.num_params == 124_439_808


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(
    "world,pp,m,order",
    [
        (1, 1, 4, "cpp"),
        (8, 4, 8, "cpp"),
        (12, 3, 2, "megatron"),
        (32, 8, 8, "cpp"),
        (6, 6, 1, "cpp"),
    ],
)
def test_plans_are_valid(schedule, world, pp, m, order):
    j = job([str(2 * pp), str(pp), str(m), "--schedule", schedule, "--order", order], world)
    plans = [j.plan(r) for r in range(world)]
    sim = simulate(plans, cost=lambda r, op: op.flops if isinstance(op, Compute) else 0.0)
    assert sim.time > 0
    for p in plans:
        computes = [op.name for op in p.ops if isinstance(op, Compute)]
        assert computes.count("forward") == computes.count("backward") == m
        assert computes[-1] == "optimizer"


def test_dry_run_plans_thousands_of_ranks_quickly():
    j = job(["96", "16", "--model", "gpt2-xl", "--dry-run"], 1024)
    plans = [j.plan(r) for r in range(1024)]
    simulate(plans)
    assert plans[0].coords == {"pp": 0, "dp": 0}
