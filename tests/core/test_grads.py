"""core/grads.py, the gradient-sync lowering: buckets against hand arithmetic, the in-flight
cap, every policy."""

from __future__ import annotations

import pytest

from proxies.core.grads import POLICIES, Flat, GradSync, Unit, buckets, merge_ranges
from proxies.core.plan import Collective, Compute, Span, Wait

# Four units in backward order over one flat array of 100 elements: sizes 10, 30, 20, 40,
# laid out top-down (the last unit of the backward at offset 0), as the GPT layouts are.
UNITS = [
    Unit(0, (("g", 90, 100),)),
    Unit(1, (("g", 60, 90),)),
    Unit(2, (("g", 40, 60),)),
    Unit(3, (("g", 0, 40),)),
]


def test_merge_ranges_joins_adjacent_only():
    assert merge_ranges([(5, 9), (0, 5), (10, 12)]) == [(0, 9), (10, 12)]


def test_buckets_close_at_the_size():
    # 10 < 35, 10+30 = 40 >= 35: close; 20 < 35, 20+40 = 60: close
    got = buckets(UNITS, 35)
    assert [[u.key for u in b.units] for b in got] == [[0, 1], [2, 3]]
    assert [b.ranges for b in got] == [{"g": [(60, 100)]}, {"g": [(0, 60)]}]
    assert [len(b.units) for b in buckets(UNITS, 0)] == [1, 1, 1, 1]  # 0: every unit
    assert [len(b.units) for b in buckets(UNITS, 10**9)] == [4]  # the last unit closes it


def test_buckets_never_span_segments():
    units = [Unit(k, u.ranges, segment=k // 3) for k, u in enumerate(UNITS)]
    assert [[u.key for u in b.units] for b in buckets(units, 10**9)] == [[0, 1, 2], [3]]


def test_span_buckets_one_allreduce_per_contiguous_range():
    # a unit with two separate ranges (GPT-2's head: ln_f and the tied wte)
    units = [Unit("head", (("g", 0, 8), ("g", 50, 60))), Unit("h0", (("g", 8, 50),))]
    sync = GradSync("buckets", [Flat("g", "dp", 60)], units, bucket=10**9)
    assert sync.after(["head"]) == []  # the bucket is not complete yet
    posted = sync.after(["h0"])
    assert posted == [
        Collective("allreduce", "dp", Span("g", 0, 60), 60, req="dp0"),
    ]
    sync = GradSync("buckets", [Flat("g", "dp", 60)], units, bucket=1)
    assert sync.after(["head"]) == [
        Collective("allreduce", "dp", Span("g", 0, 8), 8, req="dp0"),
        Collective("allreduce", "dp", Span("g", 50, 60), 10, req="dp1"),
    ]
    assert [str(c.buf) for c in sync.after(["h0"])] == ["g:8:50"]
    assert sync.end() == [Wait("dp0"), Wait("dp1"), Wait("dp2"), Compute("optimizer")]


def test_indexed_buckets_and_the_inflight_cap():
    flat = Flat("g", "dp", 100, span=False)
    sync = GradSync("buckets", [flat], UNITS, bucket=0, inflight=2)
    ops = []
    for k in range(4):
        ops += sync.after([k])
    ops += sync.end()
    colls = [op for op in ops if isinstance(op, Collective)]
    assert [(c.buf, c.mb, c.count, c.req) for c in colls] == [
        ("g", 0, 10, "dp0"),
        ("g", 1, 30, "dp1"),
        ("g", 2, 20, "dp2"),
        ("g", 3, 40, "dp3"),
    ]
    # never more than two in flight: the third and fourth wait for the oldest first
    names = [op.req if isinstance(op, Wait | Collective) else op.name for op in ops]
    assert names == ["dp0", "dp1", "dp0", "dp2", "dp1", "dp3", "dp2", "dp3", "optimizer"]
    assert [type(op).__name__ for op in ops[:4]] == [
        "Collective",
        "Collective",
        "Wait",
        "Collective",
    ]


def test_two_groups_and_empty_ranges():
    # dense over dp, experts over edp; the extra unit has no expert gradients
    units = [Unit("l0", (("d", 0, 5), ("e", 0, 7))), Unit("x", (("d", 5, 9),))]
    flats = [Flat("d", "dp", 9, span=False), Flat("e", "edp", 7, span=False)]
    sync = GradSync("buckets", flats, units, bucket=0)
    assert [(c.group, c.count, c.req) for c in sync.after(["l0"])] == [
        ("dp", 5, "dp0"),
        ("edp", 7, "edp0"),
    ]
    assert [(c.group, c.count, c.req) for c in sync.after(["x"])] == [("dp", 4, "dp1")]


def test_fused_per_tensor_and_zero1_end_ops():
    flat = Flat("g", "dp", 100, tensors=(("grad:a", 60), ("grad:b", 40)))
    extra = [Collective("allreduce", "embed", "grad:wte", 7)]
    fused = GradSync("fused", [flat], UNITS)
    assert not fused.overlaps and fused.after([3]) == []
    assert fused.end(extra) == [
        Collective("allreduce", "dp", "g", 100),
        extra[0],
        Compute("optimizer"),
    ]
    per = GradSync("per-tensor", [flat]).end(extra)
    assert [(c.buf, c.count) for c in per[:2]] == [("grad:a", 60), ("grad:b", 40)]
    assert per[2:] == [extra[0], Compute("optimizer")]
    # ZeRO-1: the other reductions first (the shards split what they write)
    assert GradSync("zero1", [flat]).end(extra) == [
        extra[0],
        Collective("reduce_scatter", "dp", "g", 100),
        Compute("optimizer"),
        Collective("allgather", "dp", "params", 100),
    ]


def test_no_group_to_reduce_over():
    for policy in ("fused", "per-tensor", "buckets", "zero1"):
        sync = GradSync(policy, [], UNITS)
        assert not sync.overlaps
        assert sync.after([0, 1, 2, 3]) == []
        assert sync.end() == [Compute("optimizer")]


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown gradient sync policy"):
        GradSync("ring", [])


def test_whole_arrays_one_per_unit_named_requests():
    # CosmoFlow / DLRM: an array per layer, each unit posted on its own (size 0), keyed by
    # the array's name alone (mb -1), with the front end's request names and category
    flats = [
        Flat(f"conv{l}.grads", "world", 10 * (l + 1), "conv_allreduce", whole=True, req=f"conv{l}")
        for l in range(3)
    ]
    units = [Unit(l, ((f"conv{l}.grads", 0, 10 * (l + 1)),)) for l in (2, 1, 0)]
    sync = GradSync("buckets", flats, units, bucket=0)
    assert sync.overlaps
    assert sync.after([2]) == [
        Collective("allreduce", "world", "conv2.grads", 30, req="conv2", category="conv_allreduce")
    ]
    assert sync.after([1]) + sync.after([0]) == [
        Collective(
            "allreduce", "world", f"conv{l}.grads", n, req=f"conv{l}", category="conv_allreduce"
        )
        for l, n in ((1, 20), (0, 10))
    ]
    step = Compute("optimizer", flops=12.0)
    assert sync.end(optimizer=step) == [Wait("conv2"), Wait("conv1"), Wait("conv0"), step]


def test_whole_array_bucketed_and_numbered_requests():
    # whole with a bucket: the units' ranges summed into one allreduce of the array (DLRM
    # without --overlap: one MLP's layers, posted after the last); "{group}{n}" numbering
    units = [Unit(k, (("g", 4 * k, 4 * k + 4),)) for k in (2, 1, 0)]
    sync = GradSync("buckets", [Flat("g", "dp", 12, whole=True)], units, bucket=10**9)
    assert sync.after([2]) == sync.after([1]) == []
    assert sync.after([0]) == [Collective("allreduce", "dp", "g", 12, req="dp0")]
    named = Flat("g", "dp", 12, whole=True, req="mlp{n}")
    sync = GradSync("buckets", [named], units, bucket=0)
    assert [c.req for k in (2, 1, 0) for c in sync.after([k])] == ["mlp0", "mlp1", "mlp2"]


def test_category_on_span_and_index_keys():
    units = [Unit(0, (("g", 0, 5),))]
    for span in (True, False):
        sync = GradSync("buckets", [Flat("g", "dp", 5, "grads_ar", span=span)], units)
        assert [c.category for c in sync.after([0])] == ["grads_ar"]


def test_a_fixed_request_name_posted_twice_is_an_error():
    units = [Unit(k, (("g", k, k + 1),)) for k in range(2)]
    sync = GradSync("buckets", [Flat("g", "dp", 2, whole=True, req="g")], units, bucket=0)
    sync.after([0])
    with pytest.raises(ValueError, match="posted twice"):
        sync.after([1])


def test_the_front_ends_optimizer_op_in_every_policy():
    step = Compute("optimizer", flops=3.0)
    flat = Flat("g", "dp", 4, tensors=(("grad:a", 4),))
    for policy in POLICIES:
        ops = GradSync(policy, [flat], [Unit(0, (("g", 0, 4),))]).end(optimizer=step)
        assert [op for op in ops if isinstance(op, Compute)] == [step]
        assert GradSync(policy, []).end(optimizer=step) == [step]
