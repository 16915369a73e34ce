"""core/fsdp.py: the FSDP lowering of a pass, by hand: gathers posted one unit ahead and
waited just before the unit's first step, frees after its last, reduce-scatters after the
step that completes it (at most `inflight` in flight), HSDP's replica allreduces, padding
and the traffic it adds up to; anonymous memory whose released pages leave the resident
set."""

from __future__ import annotations

import numpy as np
import pytest

from proxies.core import fsdp
from proxies.core.fsdp import FSDP, ShardUnit, Step, hsdp_groups
from proxies.core.plan import Collective, Compute, Wait

UNITS = [ShardUnit("a", 10), ShardUnit("b", 8), ShardUnit("c", 5)]


def names(ops) -> list[str]:
    out = []
    for op in ops:
        if isinstance(op, Collective):
            out.append(f"{op.kind}:{op.req}")
        elif isinstance(op, Wait):
            out.append(f"wait:{op.req}")
        else:
            out.append(op.name)
    return out


def forward() -> list[Step]:
    return [Step(Compute(f"f{k}"), (k,)) for k in "abc"]


def test_padding_makes_equal_shards():
    assert [u.padded(4) for u in UNITS] == [12, 8, 8]
    assert [u.shard(4) for u in UNITS] == [3, 2, 2]
    fs = FSDP(UNITS, 4)
    assert fs.shard_elements == 7 and fs.largest == 12


def test_forward_prefetches_one_unit_ahead_and_waits_where_needed():
    ops = FSDP(UNITS, 4).pass_ops(forward())
    assert names(ops) == [
        "allgather:fsdp_ag:0:a",
        "allgather:fsdp_ag:0:b",  # b's gather posted before a computes
        "wait:fsdp_ag:0:a",
        "fsdp_unshard:a",
        "fa",
        "fsdp_reshard:a",
        "allgather:fsdp_ag:0:c",
        "wait:fsdp_ag:0:b",
        "fsdp_unshard:b",
        "fb",
        "fsdp_reshard:b",
        "wait:fsdp_ag:0:c",
        "fsdp_unshard:c",
        "fc",
        "fsdp_reshard:c",
    ]
    gathers = [op for op in ops if isinstance(op, Collective)]
    # two slots alternate; the collective's mb names the unit; counts are padded
    assert [(g.buf, g.mb, g.count) for g in gathers] == [
        ("fsdp_ag0", 0, 12),
        ("fsdp_ag1", 1, 8),
        ("fsdp_ag0", 2, 8),
    ]
    assert {g.group for g in gathers} == {"fsdp"} and all(g.req for g in gathers)


def test_a_unit_used_by_several_steps_stays_gathered_until_its_last():
    steps = [
        Step(Compute("s0"), ("a", "b")),
        Step(Compute("s1"), ("b",)),
        Step(Compute("s2"), ("a",)),
    ]
    got = names(FSDP(UNITS[:2], 2).pass_ops(steps))
    assert got.index("fsdp_reshard:b") == got.index("s1") + 1
    assert got.index("fsdp_reshard:a") == got.index("s2") + 1
    assert got.index("fsdp_unshard:b") < got.index("s0")


def test_backward_reduce_scatters_after_completion_with_a_cap_then_end():
    fs = FSDP(UNITS, 4, inflight=2)
    steps = [Step(Compute(f"b{k}"), (k,), (k,)) for k in "cba"]
    ops = fs.pass_ops(steps, reduce=True)
    got = names(ops)
    assert got.index("reduce_scatter:fsdp_rs:c") == got.index("bc") + 1 + 1  # after reshard
    # the third reduce-scatter waits for the first (two in flight at most)
    assert got.index("wait:fsdp_rs:c") < got.index("reduce_scatter:fsdp_rs:a")
    end = names(fs.end([Compute("extra")]))
    assert end == ["wait:fsdp_rs:b", "wait:fsdp_rs:a", "extra", "optimizer"]
    rs = [op for op in ops if isinstance(op, Collective) and op.kind == "reduce_scatter"]
    assert [(r.buf, r.count) for r in rs] == [("fsdp_rs1", 8), ("fsdp_rs0", 8), ("fsdp_rs1", 12)]


def test_hsdp_allreduces_each_reduced_shard_over_the_replicas():
    fs = FSDP(UNITS, 2, replicas=3)
    fs.pass_ops([Step(Compute("b"), tuple("abc"), tuple("abc"))], reduce=True)
    ops = fs.end()
    ars = [op for op in ops if isinstance(op, Collective)]
    assert [(a.group, a.buf, a.mb, a.count) for a in ars] == [
        ("hsdp", "fsdp_rshard", 1, 4),  # b, c were still in flight (a was retired earlier)
        ("hsdp", "fsdp_rshard", 2, 3),
    ]
    assert names(ops)[-4:] == ["wait:hsdp:a", "wait:hsdp:b", "wait:hsdp:c", "optimizer"]


def test_traffic_is_three_times_the_padded_parameters_per_iteration():
    """One micro-batch: a forward and a backward pass; each unit gathered twice and
    reduce-scattered once."""
    fs = FSDP(UNITS, 4)
    ops = fs.pass_ops(forward())
    ops += fs.pass_ops([Step(Compute(f"b{k}"), (k,), (k,)) for k in "cba"], reduce=True)
    ops += fs.end()
    colls = [op for op in ops if isinstance(op, Collective)]
    padded = sum(u.padded(4) for u in UNITS)
    assert sum(c.count for c in colls if c.kind == "allgather") == 2 * padded
    assert sum(c.count for c in colls if c.kind == "reduce_scatter") == padded


def test_every_unit_reduced_exactly_once():
    fs = FSDP(UNITS, 2)
    fs.pass_ops([Step(Compute("b"), ("a",), ("a",))], reduce=True)
    with pytest.raises(ValueError, match="never reduce-scattered: b, c"):
        fs.end()
    fs = FSDP(UNITS, 2)
    with pytest.raises(ValueError, match="twice"):
        fs.pass_ops([Step(Compute("b"), ("a",), ("a", "a"))], reduce=True)
    with pytest.raises(ValueError, match="unknown unit"):
        FSDP(UNITS, 2).pass_ops([Step(Compute("x"), ("z",))])


def test_hsdp_groups_are_consecutive_shards_and_strided_replicas():
    dp = (10, 11, 12, 13, 14, 15)
    assert hsdp_groups(dp, 4, 2) == ((14, 15), (10, 12, 14))
    assert hsdp_groups(dp, 4, 3) == ((13, 14, 15), (11, 14))
    assert hsdp_groups(dp, 1, 6) == (dp, (11,))


def resident(a: np.ndarray) -> int:
    """Bytes of the pages under `a` present in memory now (/proc/self/pagemap: one 64-bit
    entry per page, bit 63 set when present; smaps would not do, the kernel merges
    neighbouring anonymous mappings)."""
    page = fsdp.PAGE
    start = a.__array_interface__["data"][0] // page
    end = -(-(a.__array_interface__["data"][0] + a.nbytes) // page)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(8 * start)
        entries = np.frombuffer(f.read(8 * (end - start)), dtype=np.uint64)
    return int(np.count_nonzero(entries >> np.uint64(63))) * page


def test_release_gives_whole_pages_back():
    """anonymous memory: a released range reads zeros, except the partial pages at its ends,
    and those pages leave the resident set; a plain array is refused."""
    page = fsdp.PAGE // 4  # float32 elements per page
    a = fsdp.anonymous(64 * page, np.float32)
    assert resident(a) == 0 and not a.any()
    a[...] = 1
    assert resident(a) == a.nbytes
    view = a[3:]
    lo, hi = fsdp.release(view, 10, 40 * page + 5)  # a[13 : 40 page + 8]
    assert (lo, hi) == (page - 3, 40 * page - 3)  # the whole pages: a[page : 40 page]
    assert resident(a) == a.nbytes - 39 * fsdp.PAGE
    assert (a[page : 40 * page] == 0).all()
    assert (a[:page] == 1).all() and (a[40 * page :] == 1).all()
    assert fsdp.release(a, 5, page - 1) == (5, 5)  # no whole page: nothing given back
    with pytest.raises(ValueError, match="fsdp.anonymous"):
        fsdp.release(np.ones(4 * page, np.float32), 0, 4 * page)
