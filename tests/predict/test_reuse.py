"""Reused buffers: the machine's `reuse` figures, which collectives they reach (an LRU stack
distance over the rank's buffers), what they cost, and calibrate's reread."""

import copy
import math
from dataclasses import replace

import pytest

from proxies.core.machine import MachineError, load
from proxies.core.machine_file import dumps
from proxies.core.network import Topology
from proxies.core.plan import P2P, Collective, Compute, Msg, Plan
from proxies.core.predict import predict, reused_ops
from proxies.core.prediction import chooser, collective_seconds

from .test_machine import BASE, write
from .test_network import machine

MIB = 1 << 20
FLOAT = 4


def test_reuse_section_loads_round_trips_and_rejects_bad_values(tmp_path):
    data = copy.deepcopy(BASE) | {"reuse": {"cache": "16 MiB", "reread": 1.5}}
    m = load(write(tmp_path, data))
    assert (m.reuse_cache, m.reread) == (16 * MIB, 1.5)
    again = load(write(tmp_path, dumps(m), "again.yaml"))
    assert replace(again, source="") == replace(m, source="")
    assert load(write(tmp_path, BASE, "base.yaml")).reread is None
    for key, value, words in [
        ("reread", 0, "a plain number > 0"),
        ("reread", "2x", "a plain number > 0"),
        ("cache", "16 MB/s", "expected a size"),
        ("cache", None, "missing"),
    ]:
        bad = copy.deepcopy(data)
        if value is None:
            del bad["reuse"][key]
        else:
            bad["reuse"][key] = value
        path = write(tmp_path, bad, "bad.yaml")
        with pytest.raises(MachineError) as e:
            load(path)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{path}: reuse.{key}: ") and words in msg


def coll(buf: str, nbytes: int) -> Collective:
    return Collective("allreduce", "g", buf, nbytes // FLOAT)


def halo(buf: str, nbytes: int) -> P2P:
    return P2P("x", (Msg(1, 0, buf, 0, nbytes // FLOAT),), (Msg(1, 0, buf, 0, nbytes // FLOAT),))


def key(name, mb):
    return name


def test_reused_ops_is_an_lru_stack_distance_over_the_ranks_buffers():
    # one 2 MiB buffer reduced again and again: every use within 16 MiB, the first one
    # too (it follows the previous iteration's last)
    ops = (coll("a", 2 * MIB), Compute("f"), coll("a", 2 * MIB))
    assert reused_ops(Plan(0, ops, {}), key, 16 * MIB) == {0, 2}
    # 15 MiB of other buffers between two uses of a: 2 + 15 > 16, cold; the halo buffer
    # touched twice since b's last use counts once: 10 + 5 + 2, cold below 17 MiB
    ops = (coll("a", 2 * MIB), halo("h", 5 * MIB), coll("b", 10 * MIB), halo("h", 5 * MIB))
    assert reused_ops(Plan(0, ops, {}), key, 16 * MIB) == set()
    assert reused_ops(Plan(0, ops, {}), key, 17 * MIB) == {0, 2}
    # only collectives are priced: a message's buffer is never in the set; a buffer used
    # once per iteration with a larger one between is cold, as is one beyond the cache
    ops = (halo("h", MIB), coll("a", MIB), coll("a", MIB))
    assert reused_ops(Plan(0, ops, {}), key, 16 * MIB) == {1, 2}
    ops = (halo("h", MIB), coll("big", 20 * MIB), coll("a", MIB))
    assert reused_ops(Plan(0, ops, {}), key, 16 * MIB) == set()
    # the runtime's buffer, not the plan's name, decides: two names on one array
    ops = (coll("x", MIB), coll("y", MIB))
    assert reused_ops(Plan(0, ops, {}), lambda name, mb: (name, mb), 16 * MIB) == {0, 1}
    ops = (coll("x", MIB), coll("big", 20 * MIB), coll("y", MIB))
    assert reused_ops(Plan(0, ops, {}), lambda name, mb: "pool", 16 * MIB) == {0, 1, 2}


def reuse_machine(reread: float | None):
    m = replace(machine(rpn=2, intra=10e9, lat=1e-6), reduce_bandwidth=5e9)
    m = replace(m, mpi={"allreduce": [(2**63, "rhd")]}, reuse_cache=16 * MIB, reread=reread)
    return m


def iteration(m, ops, buffers) -> float:
    groups = {"g": (0, 1)}
    plans = [Plan(r, ops, groups) for r in (0, 1)]
    return predict(plans, Topology(m, 2), lambda r, o: 0.0, chooser(m, "mpi"), buffers=buffers).time


def test_a_reused_buffers_mpi_collective_costs_reread_per_byte_moved_and_added():
    n = 4 * MIB
    ops = (coll("a", n),)
    same = lambda plan: key  # noqa: E731
    plain = iteration(reuse_machine(None), ops, same)
    # textbook rhd on 2 ranks: two latencies, half each way twice, half added
    assert math.isclose(plain, 2 * (1e-6 + n / 2 / 10e9) + n / 2 / 5e9, rel_tol=1e-6)
    twice = iteration(reuse_machine(2.0), ops, same)
    assert math.isclose(twice, 2 * (1e-6 + n / 10e9) + n / 5e9, rel_tol=1e-6)
    # not where the runtime does not say which buffers it reuses (real compute), not on a
    # buffer used cold, not for our own point-to-point programs
    assert iteration(reuse_machine(2.0), ops, None) == plain
    cold = (coll("a", n), coll("big", 20 * MIB))
    assert iteration(reuse_machine(2.0), cold, same) == iteration(reuse_machine(None), cold, same)
    ours = replace(reuse_machine(2.0), mpi={})
    groups = {"g": (0, 1)}
    plans = [Plan(r, ops, groups) for r in (0, 1)]
    topo = Topology(ours, 2)
    assert predict(plans, topo, lambda r, o: 0.0, chooser(ours, "rhd"), buffers=same).time == (
        predict(plans, topo, lambda r, o: 0.0, chooser(ours, "rhd")).time
    )


def test_calibrate_sets_reread_so_the_model_prices_the_measured_reused_allreduce():
    from proxies.calibrate.caches import with_reuse

    m = reuse_machine(None)
    cold = collective_seconds(m, "allreduce", "mpi", 2, MIB // FLOAT, ranks_per_node=2)
    state = {"bytes": MIB, "cold_s": cold * 0.7, "same_s": cold * 1.3, "reread": 1.3 / 0.7}
    got = with_reuse(m, state)
    assert math.isclose(got.reread, 1.3, rel_tol=1e-3) and got.reuse_cache > 0
    assert got.calibration["reuse"]["measured_same_s"] == state["same_s"]
    assert with_reuse(m, None) is m and with_reuse(m, {"bytes": MIB}) is m


# -- zero_pages.alltoall: MPI's all-to-all from a send buffer never written -------------------


def test_zero_pages_section_loads_round_trips_and_rejects_bad_values(tmp_path):
    data = copy.deepcopy(BASE) | {"zero_pages": {"alltoall": 0.55}}
    m = load(write(tmp_path, data))
    assert m.zero_page_alltoall == 0.55
    again = load(write(tmp_path, dumps(m), "again.yaml"))
    assert replace(again, source="") == replace(m, source="")
    assert load(write(tmp_path, BASE, "base.yaml")).zero_page_alltoall is None
    for value in (0, -1, "half", None):
        bad = copy.deepcopy(data)
        bad["zero_pages"]["alltoall"] = value
        path = write(tmp_path, bad, "bad.yaml")
        with pytest.raises(MachineError) as e:
            load(path)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{path}: zero_pages.alltoall: ")


def a2a_iteration(m, untouched: bool, buffers=lambda plan: key) -> float:
    ops = (Collective("alltoall", "g", "emb", 32 * MIB // FLOAT),)
    plans = [Plan(r, ops, {"g": (0, 1)}) for r in (0, 1)]
    topo = Topology(m, 2)
    pick = chooser(m, "mpi")
    return predict(
        plans, topo, lambda r, o: 0.0, pick, buffers=buffers, untouched_sends=untouched
    ).time


def test_an_alltoall_from_a_never_written_buffer_costs_zero_pages_per_byte():
    """Runs without real compute and --check never write their all-to-alls' send buffers:
    the pairwise exchange's bytes and its own block's copy cost zero_pages.alltoall x the
    cold price (latencies unchanged); nothing without the flag or the figure, nothing for
    allreduces; it prices the buffer even where reuse.reread would (zero pages)."""
    base = replace(machine(rpn=2, intra=10e9, lat=1e-6), memory_bandwidth=20e9)
    m = replace(base, zero_page_alltoall=0.5)
    cold = a2a_iteration(m, False)
    assert a2a_iteration(base, True) == cold == a2a_iteration(m, False, buffers=None)
    half = a2a_iteration(m, True)
    assert math.isclose(half - 1e-6, (cold - 1e-6) / 2, rel_tol=1e-3), (half, cold)
    reused = replace(m, reuse_cache=64 * MIB, reread=3.0)
    assert math.isclose(a2a_iteration(reused, True), half, rel_tol=1e-9)
    ar = (coll("a", 4 * MIB),)
    plans = [Plan(r, ar, {"g": (0, 1)}) for r in (0, 1)]
    times = {
        flag: predict(plans, Topology(m, 2), lambda r, o: 0.0, chooser(m, "mpi"),
                      buffers=lambda plan: key, untouched_sends=flag).time
        for flag in (False, True)
    }  # fmt: skip
    assert times[False] == times[True]


def test_calibrate_sets_zero_pages_so_the_model_prices_the_measured_untouched_alltoall():
    from proxies.calibrate.caches import with_zero_pages

    m = replace(machine(rpn=2, intra=10e9, lat=1e-6), memory_bandwidth=20e9)
    sizes = (32 * MIB, 64 * MIB)
    cold = [
        collective_seconds(m, "alltoall", "mpi", 2, s // FLOAT, ranks_per_node=2) for s in sizes
    ]
    m.calibration["alltoall"] = {
        "untouched": [[s, 0.5 * c] for s, c in zip(sizes, cold, strict=True)]
    }
    got = with_zero_pages(m, 2, 2)
    assert math.isclose(got.zero_page_alltoall, 0.5, rel_tol=1e-3)
    assert got.calibration["alltoall"]["untouched_over_predicted_cold"] == [0.5, 0.5]
    bare = replace(m, calibration={})
    assert with_zero_pages(bare, 2, 2) is bare
