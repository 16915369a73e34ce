"""The machine file's `cold` figures: what an op costs after its rank moved bulk data.
Written back (its bad values are test_regimes.py's); priced by the predictor as hand
arithmetic says (the engine's share as overhead, MPI's on blocking ops to their category,
compute ops transparent, non-blocking bytes at their Wait, which pays them, nothing on a
crowded node); fitted by calibrate."""

import copy
import math
from dataclasses import replace

import pytest

from proxies.calibrate.caches import fit_cold, with_cold
from proxies.core.machine import load
from proxies.core.machine_file import dumps
from proxies.core.mpi_choice import chooser
from proxies.core.network import Topology
from proxies.core.plan import P2P, Collective, Compute, Msg, Plan, Wait
from proxies.core.predict import predict
from proxies.core.predict_caches import plan_touched

from .test_machine import BASE, write
from .test_regimes import crowded_machine

MIB = 1 << 20
COLD = copy.deepcopy(BASE) | {
    "cold": {"moved": "64 MiB", "engine": "50 us", "latency": "20 us", "exponent": 0.5}
}


def test_cold_loads_round_trips_and_latency_is_optional(tmp_path):
    m = load(write(tmp_path, COLD))
    assert (m.cold_moved, m.cold_engine, m.cold_latency, m.cold_exponent) == (
        64 * MIB, 50e-6, 20e-6, 0.5,
    )  # fmt: skip
    again = load(write(tmp_path, dumps(m), "again.yaml"))
    assert replace(again, source="") == replace(m, source="")
    less = copy.deepcopy(COLD)
    del less["cold"]["latency"]
    m = load(write(tmp_path, less, "less.yaml"))
    assert m.cold_latency == 0.0 and "latency" not in dumps(m).split("cold:")[1].split("\n\n")[0]
    assert load(write(tmp_path, dumps(m), "less2.yaml")).cold_latency == 0.0
    assert load(write(tmp_path, BASE, "base.yaml")).cold_moved is None


def test_touched_bytes_are_twice_what_an_op_sends_and_receives():
    batch = P2P("h", sends=(Msg(1, 0, "a", 0, 1000),), recvs=(Msg(1, 1, "b", 0, 500),))
    assert plan_touched(batch, {}) == 2 * (4000 + 2000)
    groups = {"w": (0, 1, 2, 3), "two": (0, 1)}
    n = 4 * 4096
    # a bandwidth-optimal allreduce moves 2 (p - 1) / p x n each way on each member
    assert plan_touched(Collective("allreduce", "w", "x", 4096), groups) == 2 * 2 * 2 * n * 3 // 4
    assert plan_touched(Collective("allgather", "two", "x", 4096), groups) == 2 * 2 * n // 2
    assert plan_touched(Collective("allreduce", "w", "x", 4096, req="q"), groups) > 0


def pair(ops):
    """The plan on ranks 0 and 1: rank 1's messages mirror rank 0's."""

    def mirror(op):
        if not isinstance(op, P2P):
            return op
        flip = lambda ms: tuple(replace(x, peer=0) for x in ms)  # noqa: E731
        return replace(op, sends=flip(op.sends), recvs=flip(op.recvs))

    return [Plan(0, tuple(ops), {"w": (0, 1)}), Plan(1, tuple(map(mirror, ops)), {"w": (0, 1)})]


def run(m, plans, rpn=2):
    return predict(plans, Topology(m, rpn), lambda r, op: 0.0, chooser(m))


def cold(m, moved=64 * MIB, engine=50e-6, latency=20e-6, exponent=0.5):
    return replace(
        m, cold_moved=moved, cold_engine=engine, cold_latency=latency, cold_exponent=exponent
    )


def test_an_op_after_bulk_data_pays_the_engine_and_its_mpi_calls():
    m = crowded_machine(2, oversub=False)
    each = 4 * MIB  # bytes each way: the batch touches 2 x 8 MiB = 16 MiB
    ops = (
        P2P("bulk", sends=(Msg(1, 0, "a", 0, each // 4),), recvs=(Msg(1, 0, "b", 0, each // 4),),
            category="halo"),  # nothing before it: warm
        Compute("forward"),  # after 16 MiB: the engine's share, nothing else
        P2P("small", sends=(Msg(1, 1, "c", 0, 1),), recvs=(Msg(1, 1, "d", 0, 1),),
            category="pp"),  # the compute op in between touched nothing: still cold
        Collective("allreduce", "w", "x", 1),  # after the small batch's 16 B
    )  # fmt: skip
    plans = pair(ops)
    base, pred = run(m, plans), run(cold(m), plans)
    f = (16 * MIB / (64 * MIB)) ** 0.5
    g = (16 / (64 * MIB)) ** 0.5
    for r in (0, 1):
        b, p = base.breakdown[r], pred.breakdown[r]
        assert math.isclose(p["overhead"], 50e-6 * (f + f + g), rel_tol=1e-9)
        assert math.isclose(p["pp"] - b.get("pp", 0.0), 20e-6 * f, rel_tol=1e-6)
        assert math.isclose(p["halo"], b["halo"], rel_tol=1e-9)  # first op: warm
    assert math.isclose(pred.time - base.time, 50e-6 * (2 * f + g) + 20e-6 * (f + g), rel_tol=1e-6)
    # beyond `moved` the cost holds; exponent 1 is linear in the bytes
    held = run(cold(m, moved=4 * MIB), plans).breakdown[0]["overhead"]
    assert math.isclose(held, 50e-6 * (1 + 1 + (16 / (4 * MIB)) ** 0.5), rel_tol=1e-9)
    linear = run(cold(m, exponent=1.0), plans).breakdown[0]["overhead"]
    assert math.isclose(linear, 50e-6 * (0.25 + 0.25 + 16 / (64 * MIB)), rel_tol=1e-9)


def test_a_nonblocking_ops_bytes_count_at_its_wait_and_its_calls_pay_no_latency():
    m = crowded_machine(2, oversub=False)
    count = MIB  # 4 MiB allreduce over 2: touches 2 x 2 x 2 MiB x 2 = 16 MiB
    ops = (
        P2P("bulk", sends=(Msg(1, 0, "a", 0, MIB),), recvs=(Msg(1, 0, "b", 0, MIB),)),
        Collective("allreduce", "w", "g", count, req="q"),  # after 16 MiB: engine only
        Compute("forward"),  # the start touched nothing yet: warm
        Wait("q"),  # its allreduce's 16 MiB moved while in flight: cold, engine only
        Compute("optimizer"),  # after them too
    )
    plans = pair(ops)
    base, pred = run(m, plans), run(cold(m), plans)
    f = (16 * MIB / (64 * MIB)) ** 0.5
    for r in (0, 1):
        assert math.isclose(pred.breakdown[r]["overhead"], 50e-6 * 3 * f, rel_tol=1e-9)
        for cat, seconds in base.breakdown[r].items():
            if cat == "w_allreduce":  # its Wait starts later, so it blocks less, not more
                assert pred.breakdown[r][cat] <= seconds
            elif cat not in ("overhead", "idle"):
                assert math.isclose(pred.breakdown[r][cat], seconds, rel_tol=1e-9), cat


def test_a_crowded_node_pays_its_one_figure_and_no_cold():
    m = crowded_machine(1)
    m = replace(m, oversub_op_overhead=40e-6)
    ops = (
        P2P("bulk", sends=(Msg(1, 0, "a", 0, MIB),), recvs=(Msg(1, 0, "b", 0, MIB),)),
        Compute("forward"),
    )
    plans = pair(ops)
    assert run(cold(m), plans).breakdown[0] == run(m, plans).breakdown[0]
    # without any engine figure the cold figures alone charge (not crowded)
    calm = crowded_machine(2, oversub=False)
    assert run(cold(calm), plans).breakdown[0]["overhead"] > 0
    assert run(calm, plans).breakdown[0].get("overhead", 0.0) == 0.0


def test_fit_recovers_a_power_law_and_holds_nothing_it_did_not_see():
    law = lambda b, c: c * (b / (64 * MIB)) ** 0.8  # noqa: E731
    points = [[b, law(b, 50e-6), law(b, 20e-6)] for b in (4 * MIB, 16 * MIB, 64 * MIB)]
    got = fit_cold(points)
    assert got["moved"] == 64 * MIB
    assert got["exponent"] == pytest.approx(0.8, rel=1e-9)
    assert got["engine"] == pytest.approx(50e-6, rel=1e-9)
    assert got["latency"] == pytest.approx(20e-6, rel=1e-9)
    # a point lost in noise (<= 0) leaves the exponent to the others; none at the top: none
    noisy = [[4 * MIB, -1e-7, 0.0], *points[1:]]
    assert fit_cold(noisy)["exponent"] == pytest.approx(0.8, rel=1e-9)
    assert fit_cold([[4 * MIB, 1e-6, 0.0], [64 * MIB, -2e-6, 1e-6]]) is None
    # one point: linear; the latency never negative
    one = fit_cold([[64 * MIB, 40e-6, -3e-6]])
    assert one["exponent"] == 1.0 and one["latency"] == 0.0 and one["engine"] == 40e-6


def test_with_cold_writes_the_figures_and_the_points(tmp_path):
    m = load(write(tmp_path, BASE))
    m = replace(m, calibration={})
    assert with_cold(m, None) is m
    points = [[4 * MIB, 3e-6, 1e-6], [64 * MIB, 48e-6, 16e-6]]
    got = with_cold(m, points)
    assert got.cold_moved == 64 * MIB and got.cold_engine > 0 and got.cold_latency > 0
    assert got.calibration["cold"]["points"] == points
    again = load(write(tmp_path, dumps(got), "again.yaml"))
    assert again.cold_engine == got.cold_engine and again.cold_exponent == got.cold_exponent
