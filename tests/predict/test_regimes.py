"""The machine file's regimes and engine costs: `oversubscribed` (ranks outnumbering cores),
`fresh_memory` (MPI's temporaries faulted in), `engine.op_overhead` and `cold` (its pricing
in test_cold.py); validated, written back, and priced by the predictor as hand arithmetic
says."""

import copy
import math
from dataclasses import replace

import pytest
import yaml

from proxies.core.machine import ANY, Level, MachineError, load
from proxies.core.machine_file import dumps
from proxies.core.mpi_choice import chooser
from proxies.core.network import Topology
from proxies.core.plan import P2P, Collective, Compute, Msg, Plan, Wait
from proxies.core.predict import predict
from proxies.core.prediction import collective_seconds

from .test_machine import BASE, write
from .test_network import machine

FULL = copy.deepcopy(BASE) | {
    "oversubscribed": {
        "latency": "300 us",
        "bandwidth": "5 GB/s",
        "node_bandwidth": "4 GB/s",
        "op_overhead": "40 us",
        "unexpected": 1,
    },
    "fresh_memory": {"above": "32 MiB", "rate": "2 GB/s"},
    "engine": {"op_overhead": "2 us", "exchange": "5 us", "nonblocking": "9 us"},
    "cold": {"moved": "64 MiB", "engine": "50 us", "latency": "20 us", "exponent": 0.5},
}


def test_new_sections_load_and_round_trip(tmp_path):
    m = load(write(tmp_path, FULL))
    assert m.oversub == Level(300e-6, 5e9) and m.oversub_node_bandwidth == 4e9
    assert m.oversub_op_overhead == 40e-6 and m.op_overhead == 2e-6
    assert m.op_overheads == {"exchange": 5e-6, "nonblocking": 9e-6}
    assert m.oversub_unexpected == 1.0
    assert m.fresh_above == 32 << 20 and m.fault_rate == 2e9
    again = load(write(tmp_path, dumps(m), "again.yaml"))
    assert replace(again, source="") == replace(m, source="")
    # optional parts of the section may be left out; the sections themselves too
    less = copy.deepcopy(FULL)
    del less["oversubscribed"]["node_bandwidth"], less["oversubscribed"]["op_overhead"]
    del less["oversubscribed"]["unexpected"]
    m = load(write(tmp_path, less, "less.yaml"))
    assert m.oversub_node_bandwidth is None and m.oversub_op_overhead is None
    assert m.oversub_unexpected is None
    m = load(write(tmp_path, BASE, "base.yaml"))
    assert (m.oversub, m.fresh_above, m.fault_rate, m.op_overhead) == (None, None, None, 0.0)


ERRORS = [
    ("oversubscribed.latency", "fast", ["expected a time"]),
    ("oversubscribed.latency", None, ["missing"]),
    ("oversubscribed.bandwidth", "10 us", ["expected a bandwidth"]),
    ("oversubscribed.node_bandwidth", "-1 GB/s", ["not a positive"]),
    ("oversubscribed.op_overhead", "5 GB/s", ["expected a time"]),
    ("oversubscribed.latncy", "1 us", ["unknown key", "did you mean 'latency'?"]),
    ("fresh_memory.above", "32 Mb/s", ["expected a size"]),
    ("fresh_memory.above", None, ["missing"]),
    ("fresh_memory.rate", "2 GFLOP/s", ["expected a bandwidth"]),
    ("oversubscribed.unexpected", -1, ["a plain number >= 0"]),
    ("oversubscribed.unexpected", "1 test", ["a plain number >= 0"]),
    ("engine.op_overhead", "0 us", ["not a positive"]),
    ("engine.overhead", "1 us", ["unknown key", "did you mean 'op_overhead'?"]),
    ("engine.exchange", "-3 us", ["not a positive"]),
    ("engine.nonblocking", "4 GB/s", ["expected a time"]),
    ("engine.colective", "1 us", ["unknown key", "did you mean 'collective'?"]),
    ("cold.engine", None, ["missing"]),
    ("cold.moved", "-4 MiB", ["not a positive"]),
    ("cold.moved", "10 us", ["expected a size"]),
    ("cold.exponent", 0, ["a plain number > 0"]),
    ("cold.latency", "4 GB/s", ["expected a time"]),
    ("cold.latncy", "1 us", ["unknown key", "did you mean 'latency'?"]),
]


@pytest.mark.parametrize("key,value,words", ERRORS, ids=[f"{e[0]}={e[1]}" for e in ERRORS])
def test_bad_values_are_one_line_naming_file_and_key(tmp_path, key, value, words):
    data = copy.deepcopy(FULL)
    section, k = key.split(".")
    if value is None:
        del data[section][k]
    else:
        data[section][k] = value
    path = write(tmp_path, data)
    with pytest.raises(MachineError) as e:
        load(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: {key}: "), msg
    for w in words:
        assert w in msg, msg


@pytest.mark.slow
def test_bad_value_exits_2(tmp_path):
    import sys

    from launch import run

    data = copy.deepcopy(FULL)
    data["fresh_memory"]["rate"] = "fast"
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    argv = ["gpt2", "4", "2", "--dry-run", "--world-size", "4", "--machine", str(path)]
    r = run([sys.executable, "-m", "proxies", *argv], timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{path}: fresh_memory.rate" in lines[0], r.stderr


# -- oversubscribed: which figures a run gets ---------------------------------------------------


def crowded_machine(cores: int, oversub: bool = True):
    m = replace(machine(rpn=2, intra=10e9, lat=1e-6), cores_per_node=cores)
    if oversub:
        m = replace(m, oversub=Level(300e-6, 2e9), oversub_node_bandwidth=None)
    return m


def one_message(m, nbytes: int, rpn: int = 2, wait: str = "spin") -> float:
    msg = lambda peer: Msg(peer, 1, "x", 0, nbytes // 4)  # noqa: E731
    plans = [
        Plan(0, (P2P("pp", sends=(msg(1),)),)),
        Plan(1, (P2P("pp", recvs=(msg(0),)),)),
    ]
    return predict(plans, Topology(m, rpn, wait), lambda r, o: 0.0, chooser(m)).time


def test_oversubscribed_figures_apply_only_when_ranks_outnumber_cores():
    nbytes = 4 << 20
    # 2 ranks on 1 core: the oversubscribed latency and bandwidth
    assert math.isclose(one_message(crowded_machine(1), nbytes), 300e-6 + nbytes / 2e9)
    # 2 ranks on 2 cores: intra_node's
    assert math.isclose(one_message(crowded_machine(2), nbytes), 1e-6 + nbytes / 10e9)
    # a file without the section (a cluster's) is priced as before, crowded or not
    assert math.isclose(one_message(crowded_machine(1, False), nbytes), 1e-6 + nbytes / 10e9)


@pytest.mark.parametrize("detail", ["steps", "coarse"])
def test_a_crowded_core_slows_a_collectives_adds_and_faults_as_its_compute(detail):
    # rhd on 2 ranks of 64 MiB: half the message reduced, half faulted in (fresh memory);
    # 2 ranks on 1 core do that work at half the rate, as they compute and copy
    def seconds(cores):
        m = replace(fresh_machine(), cores_per_node=cores)
        plans = [Plan(r, (Collective("allreduce", "w", "x", 16 << 20),), {"w": (0, 1)})
                 for r in (0, 1)]  # fmt: skip
        pick = chooser(m)
        return predict(plans, Topology(m, 2, "spin"), lambda r, o: 0.0, pick, detail=detail).time

    half = (16 << 20) * 4 / 2
    work = half / 5e9 + half / 2e9  # the adds at compute.reduce, the faults at their rate
    assert math.isclose(seconds(1) - seconds(2), work, rel_tol=1e-9)


def test_yielding_waits_see_their_message_at_their_next_test():
    from proxies.core.waiting import yield_sees

    nbytes = 4 << 20
    moved = 300e-6 + nbytes / 2e9  # 2.4 ms: the waits have long been sleeping 1 ms at a time
    m = crowded_machine(1)
    # tests at 50, 70, 110, 190, 350, 670, 1310, 2310, 3310 us: seen at 3.31 ms
    assert math.isclose(yield_sees(moved), 3.31e-3, rel_tol=1e-9)
    assert math.isclose(one_message(m, nbytes, wait="auto"), 3.31e-3, rel_tol=1e-9)
    assert math.isclose(one_message(m, nbytes, wait="yield"), 3.31e-3, rel_tol=1e-9)
    # each sleep lasting `wake` longer moves the tests: 50, 140, 250, 400, 630, 1020, 1730,
    # then every 1.07 ms: 2800 us
    woken = replace(m, wake=70e-6)
    assert math.isclose(one_message(woken, nbytes, wait="auto"), 2.8e-3, rel_tol=1e-9)
    # while it spins (the first 50 us) a wait sees its message at once; --wait spin always
    assert yield_sees(30e-6) == 30e-6
    assert math.isclose(one_message(m, nbytes, wait="spin"), moved, rel_tol=1e-9)
    # a node with a core per rank spins (auto)
    assert math.isclose(one_message(crowded_machine(2), nbytes, wait="auto"), 1e-6 + nbytes / 10e9)


def test_oversubscribed_node_bandwidth_replaces_the_nodes():
    m = replace(crowded_machine(1), node_bandwidth=8e9, oversub_node_bandwidth=1e9)
    assert Topology(m, 2).bus == 1e9 and Topology(m, 1).bus == 8e9


def test_oversubscribed_inter_node_latency_is_at_least_the_crowded_one():
    m = crowded_machine(1)
    topo = Topology(m, 2)
    assert topo.alpha(0, 2) == 300e-6 and Topology(m, 1).alpha(0, 1) == 1e-6


# -- fresh memory: MPI's reductions of messages above the threshold -----------------------------


def fresh_machine(above=32 << 20, rate=2e9):
    m = replace(machine(rpn=2, intra=10e9, lat=1e-6), reduce_bandwidth=5e9)
    return replace(m, mpi={"allreduce": [(2**63, "rhd")]}, fresh_above=above, fault_rate=rate)


@pytest.mark.parametrize("detail", ["steps", "coarse"])
def test_fresh_temporaries_cost_what_is_reduced_over_the_fault_rate(detail):
    # rhd on 2 ranks: each receives half the message into the temporary and reduces it,
    # so half the message is faulted in: (S / 2) / rate more than without fresh memory
    m, plain = fresh_machine(), replace(fresh_machine(), fresh_above=None, fault_rate=None)
    count = 16 << 20  # 64 MiB of float32
    with_faults = collective_seconds(
        m, "allreduce", "mpi", 2, count, ranks_per_node=2, detail=detail
    )
    without = collective_seconds(
        plain, "allreduce", "mpi", 2, count, ranks_per_node=2, detail=detail
    )
    assert math.isclose(with_faults - without, (count * 4 / 2) / 2e9, rel_tol=1e-9)
    # textbook rhd on 2 ranks: two latencies, half each way twice, half reduced
    half = count * 4 / 2
    assert math.isclose(without, 2 * (1e-6 + half / 10e9) + half / 5e9, rel_tol=1e-9)


def test_no_fresh_cost_below_the_threshold_nor_for_our_own_programs():
    m, plain = fresh_machine(), replace(fresh_machine(), fresh_above=None, fault_rate=None)
    small = (32 << 20) // 4  # exactly the threshold: the heap serves it
    assert collective_seconds(
        m, "allreduce", "mpi", 2, small, ranks_per_node=2
    ) == collective_seconds(plain, "allreduce", "mpi", 2, small, ranks_per_node=2)
    big = 16 << 20
    for alg in ("ring", "rhd"):  # --allreduce ALG: our buffers are kept, never fresh
        assert collective_seconds(
            m, "allreduce", alg, 2, big, ranks_per_node=2
        ) == collective_seconds(plain, "allreduce", alg, 2, big, ranks_per_node=2)
    # the calibrate fit prices MPI's candidates as the library's
    assert collective_seconds(
        m, "allreduce", "rhd", 2, big, ranks_per_node=2, library=True
    ) == collective_seconds(m, "allreduce", "mpi", 2, big, ranks_per_node=2)


@pytest.mark.parametrize("detail", ["steps", "coarse"])
def test_in_place_alltoall_faults_its_block_sized_temporary(detail):
    # MPICH's in-place all-to-all (where a machine file's mpi: table names it) receives each
    # block into a temporary of the block's size and copies it back: above the threshold
    # every copied byte is faulted in first
    m, plain = fresh_machine(), replace(fresh_machine(), fresh_above=None, fault_rate=None)
    inplace = {"alltoall": [(ANY, "inplace")]}
    m, plain = (replace(x, memory_bandwidth=20e9, mpi=inplace) for x in (m, plain))
    for count, faulted in ((32 << 20, True), (16 << 20, False)):  # 64 MiB blocks, 32 MiB
        args = ("alltoall", "mpi", 2, count)
        extra = collective_seconds(m, *args, ranks_per_node=2, detail=detail) - (
            collective_seconds(plain, *args, ranks_per_node=2, detail=detail)
        )
        block = count * 4 / 2
        assert math.isclose(extra, block / 2e9 if faulted else 0.0, abs_tol=1e-12), count
    # the collectives benchmark prices "mpi" as the library's too
    from proxies.collectives.bench_ops import predicted_seconds

    bench = predicted_seconds(m, "alltoall", "mpi", 2, 32 << 20, "float32", 0, 2, detail, "spin")
    assert math.isclose(
        bench, collective_seconds(m, "alltoall", "mpi", 2, 32 << 20, ranks_per_node=2,
                                  detail=detail), rel_tol=1e-12)  # fmt: skip


# -- the engine's own cost per op ---------------------------------------------------------------


def test_op_overhead_is_charged_per_op_and_booked_as_overhead():
    m = replace(crowded_machine(2, oversub=False), op_overhead=5e-6)
    ops = (Compute("forward", flops=1e6), Collective("allreduce", "w", "x", 1), Compute("x"))
    plans = [Plan(r, ops, {"w": (0, 1)}) for r in (0, 1)]

    def run(mach, rpn=2):
        cost = lambda r, op: op.flops / 1e9  # noqa: E731
        return predict(plans, Topology(mach, rpn), cost, chooser(mach))

    base = run(replace(m, op_overhead=0.0))
    pred = run(m)
    assert math.isclose(pred.time - base.time, 3 * 5e-6, rel_tol=1e-9)
    assert all(math.isclose(b["overhead"], 15e-6) for b in pred.breakdown.values())
    assert "overhead" not in base.breakdown[0] or base.breakdown[0]["overhead"] == 0
    # crowded, the oversubscribed figure (when the file has one) replaces it
    crowded = replace(m, cores_per_node=1, oversub=m.intra, oversub_op_overhead=50e-6)
    assert math.isclose(run(crowded).breakdown[0]["overhead"], 150e-6)
    assert math.isclose(
        run(replace(crowded, oversub_op_overhead=None)).breakdown[0]["overhead"], 15e-6
    )


def test_each_kind_of_op_is_charged_its_own_figure_else_op_overhead():
    m = replace(crowded_machine(2, oversub=False), op_overhead=1e-6)
    m = replace(m, op_overheads={"compute": 2e-6, "exchange": 30e-6, "nonblocking": 400e-6})
    ops = (
        Compute("forward"),  # 2
        P2P("x", sends=(Msg(1, 0, "a", 0, 1),), recvs=(Msg(1, 0, "b", 0, 1),)),  # 30
        Collective("allreduce", "w", "x", 1),  # 1: no figure of its kind, op_overhead
        Collective("allreduce", "w", "y", 1, req="q"),  # 400: a start
        P2P("y", sends=(Msg(1, 1, "c", 0, 1),), recvs=(Msg(1, 1, "d", 0, 1),), req="p"),  # 400
        Wait("q"),  # 400
        Wait("p"),  # 400
    )
    mirror = [P2P(o.name, tuple(replace(x, peer=0) for x in o.sends),
                  tuple(replace(x, peer=0) for x in o.recvs), req=o.req)
              if isinstance(o, P2P) else o for o in ops]  # fmt: skip
    plans = [Plan(0, ops, {"w": (0, 1)}), Plan(1, tuple(mirror), {"w": (0, 1)})]

    def run(mach):
        return predict(plans, Topology(mach, 2), lambda r, op: 0.0, chooser(mach))

    pred, base = run(m), run(replace(m, op_overhead=0.0, op_overheads={}))
    want = 2e-6 + 30e-6 + 1e-6 + 4 * 400e-6
    assert all(math.isclose(b["overhead"], want) for b in pred.breakdown.values())
    # the transfers in flight overlap the engine's time on the waits' side: at most their sum
    assert want < pred.time <= want + base.time
    # a crowded node's one figure replaces them all
    crowded = replace(m, cores_per_node=1, oversub=m.intra, oversub_op_overhead=50e-6)
    assert math.isclose(run(crowded).breakdown[0]["overhead"], 7 * 50e-6)


def test_fit_caps_a_flow_bandwidth_no_prediction_sees_at_the_nodes():
    """A flow bandwidth above the node's is invisible (the bus caps every flow): the fit
    caps it there, and every prediction stays what it was."""
    from proxies.calibrate.fit import _unbind

    wild = replace(machine(rpn=4, intra=156e9, lat=4e-6), cores_per_node=4, node_bandwidth=41e9)
    capped = _unbind(wild, "intra.bandwidth", "node_bandwidth")
    assert capped.intra == Level(4e-6, 41e9)
    assert _unbind(capped, "intra.bandwidth", "node_bandwidth") == capped
    for alg in ("ring", "rhd", "tree", "naive"):
        for n in (2, 3, 4):
            a = collective_seconds(wild, "allreduce", alg, n, 1 << 22, ranks_per_node=4)
            b = collective_seconds(capped, "allreduce", alg, n, 1 << 22, ranks_per_node=4)
            assert math.isclose(a, b, rel_tol=1e-12), (alg, n)


def test_exchange_seconds_is_hand_arithmetic():
    from proxies.calibrate.fit import exchange_seconds

    # 2 and 4 ranks in pairs, each sending S and receiving S at once: latency + S over the
    # port's bandwidth, or over the node's shared by every flow where that is lower
    m = replace(machine(rpn=4, intra=10e9, lat=2e-6), cores_per_node=4, node_bandwidth=25e9)
    size = 8 << 20
    assert math.isclose(exchange_seconds(m, size, 2, 4), 2e-6 + size / 10e9, rel_tol=1e-9)
    assert math.isclose(exchange_seconds(m, size, 4, 4), 2e-6 + size / (25e9 / 4), rel_tol=1e-9)


def test_fit_weighs_each_kind_of_evidence_alike():
    """Allreduces of 7 algorithms at 5 sizes, one exchange and MPI's all-to-all: each kind
    counts as much in the fit, so a single exchange measured 2x slower than the allreduces
    imply moves the fitted bandwidth as far as all the allreduces pull it back."""
    from proxies.calibrate.fit import ALLTOALL, EXCHANGE, _cost, exchange_seconds, fit

    truth = replace(machine(rpn=2, intra=20e9, lat=3e-6), cores_per_node=2, node_bandwidth=40e9)
    sizes = [8, 64 << 10, 1 << 20, 16 << 20]
    algs = ("ring", "rhd", "tree", "rd", "naive")
    allreduces = {
        a: [(s, collective_seconds(truth, "allreduce", a, 2, s // 4, ranks_per_node=2))
            for s in sizes] for a in algs
    }  # fmt: skip
    size = 16 << 20
    slow_exchange = {EXCHANGE: [(size, 2 * exchange_seconds(truth, size, 2, 2))]}
    start = replace(truth, intra=Level(3e-6, 5e9), node_bandwidth=10e9)
    alone, _ = fit(start, allreduces, 2, 2)
    both, record = fit(start, allreduces | slow_exchange, 2, 2)
    assert math.isclose(alone.intra.bandwidth, 20e9, rel_tol=0.1)
    assert both.intra.bandwidth < 0.85 * alone.intra.bandwidth  # one point, half the weight
    assert set(record["residuals"]) == set(algs) | {EXCHANGE}
    # the cost: the mean over kinds of each kind's mean squared log error
    one = {EXCHANGE: [(size, exchange_seconds(truth, size, 2, 2) * math.e)]}
    assert math.isclose(_cost(truth, allreduces | one, 2, 2), 0.5, rel_tol=1e-9)

    # MPI's all-to-all is a kind of its own, priced as the library runs it
    def a2a_seconds(s):
        return collective_seconds(truth, "alltoall", "mpi", 2, s // 4, ranks_per_node=2)

    a2a = {f"{ALLTOALL}mpi": [(s, a2a_seconds(s)) for s in sizes[1:]]}
    assert _cost(truth, allreduces | a2a, 2, 2) < 1e-20


def test_mpis_alltoall_is_priced_as_pairwise_out_of_place():
    """The engine calls MPI's all-to-all with separate send and receive buffers: priced as
    MPICH's pairwise exchange whatever the size, not as its in-place order (pairs one after
    another, each block through a temporary: on 4 ranks a chain of 5 exchanges to
    pairwise's 3, and the temporary faults in above fresh_memory.above)."""
    m = replace(machine(rpn=4, intra=20e9, lat=3e-6), cores_per_node=4, node_bandwidth=40e9)
    m = replace(m, fresh_above=1 << 20, fault_rate=1e9)
    named = {alg: replace(m, mpi={"alltoall": [(ANY, alg)]}) for alg in ("pairwise", "inplace")}
    for n in (2, 4):
        for count in (1024, (32 << 20) // 4):

            def a2a(mm, n=n, count=count):
                return collective_seconds(mm, "alltoall", "mpi", n, count, ranks_per_node=4)

            assert a2a(m) == a2a(named["pairwise"])
            if count > 1024:  # blocks above fresh_memory.above: the temporary faults
                assert a2a(m) < a2a(named["inplace"])


def test_slept_compute_lasts_wake_longer():
    # --compute model sleeps each op's time, and a sleep ends engine.wake late (the kernel's
    # timer slack); an op of no time is not slept at all
    from types import SimpleNamespace

    from proxies.core.plan import Compute
    from proxies.core.prediction import compute_cost

    m = replace(crowded_machine(2), wake=70e-6)
    args = SimpleNamespace(compute="model", device_tflops=1.0, ranks_per_node=2)
    cost, _ = compute_cost(args, m, 2)
    assert math.isclose(cost(0, Compute("forward", flops=1e9)), 1e-3 + 70e-6, rel_tol=1e-12)
    assert cost(0, Compute("forward", flops=0.0)) == 0.0
    cost, _ = compute_cost(args, replace(m, wake=0.0), 2)
    assert math.isclose(cost(0, Compute("forward", flops=1e9)), 1e-3, rel_tol=1e-12)
    args.compute = "none"
    assert compute_cost(args, m, 2)[0](0, Compute("forward", flops=1e9)) == 0.0


def test_mpi_latency_prices_the_library_collectives_steps_on_a_crowded_node():
    from proxies.core.prediction import collective_seconds

    m = replace(crowded_machine(1), oversub_mpi_latency=2e-3)
    crowded, spread = Topology(m, 2), Topology(m, 1)
    assert crowded.alpha(0, 1, library=True) == 2e-3 and crowded.alpha(0, 1) == 300e-6
    assert spread.alpha(0, 0, library=True) == 1e-6  # a core per rank: intra_node's
    # an 8-byte allreduce on 2 crowded ranks: one recursive-doubling exchange, at the
    # library's step latency when MPI runs it, at the message latency when ours does
    count = 2
    for detail in ("steps", "coarse"):
        mpi = collective_seconds(m, "allreduce", "mpi", 2, count, ranks_per_node=2, detail=detail)
        ours = collective_seconds(m, "allreduce", "rd", 2, count, ranks_per_node=2, detail=detail)
        assert mpi > 2e-3 > ours
    # a file without the figure: the library's steps cost what any message does
    plain = crowded_machine(1)
    assert math.isclose(
        collective_seconds(plain, "allreduce", "mpi", 2, count, ranks_per_node=2, detail="steps"),
        collective_seconds(plain, "allreduce", "rd", 2, count, ranks_per_node=2, detail="steps"),
    )


def test_a_step_mpi_has_not_taken_holds_back_no_message_on_its_pair():
    # Rank 0 posts a non-blocking allreduce MPI runs (its one exchange waits mpi_latency,
    # 2 ms, on the crowded node until MPI takes it), then sends 8 kB to rank 1 at once: the
    # send moves in its own latency and bytes, not behind the step not yet taken.
    m = replace(crowded_machine(1), oversub_mpi_latency=2e-3)
    ar = Collective("allreduce", "w", "g", 2, "float32", req="a")
    msg = lambda peer: Msg(peer, 1, "x", 0, 2_000)  # noqa: E731
    gap = Compute("gap", seconds=1e-6)  # the allreduce's step is matched first
    plans = [
        Plan(0, (ar, gap, P2P("pp", sends=(msg(1),)), Wait("a")), {"w": (0, 1)}),
        Plan(1, (ar, gap, P2P("pp", recvs=(msg(0),)), Wait("a")), {"w": (0, 1)}),
    ]
    pick = chooser(m, "mpi")
    pick.library = lambda kind: True
    pred = predict(plans, Topology(m, 2), lambda r, o: o.seconds, pick, keep_spans=True)
    sent = [end for _, end, op, _ in pred.spans[1] if isinstance(op, P2P)]
    assert sent and sent[0] < 1e-3  # 300 us latency + 8 kB at 2 GB/s, yielding: well under 2 ms
    assert pred.time > 2e-3  # the allreduce itself still waits its step


def test_hidden_time_is_the_union_of_the_pending_ops_spans_as_a_run_books_it():
    # two allreduces of one category pending at once under a second of compute: a run
    # books the wall time either was in flight (report.union_seconds), not their sum
    m = machine(rpn=2, intra=10e9, lat=1e-6)
    ops = (
        Collective("allreduce", "w", "a", 1_000_000, "float32", category="dp", req="a"),
        Collective("allreduce", "w", "b", 1_000_000, "float32", category="dp", req="b"),
        Compute("forward", seconds=1.0),
        Wait("a"),
        Wait("b"),
    )
    plans = [Plan(r, ops, {"w": (0, 1)}) for r in (0, 1)]
    pick = chooser(m, "mpi")  # MPI's, non-blocking (ours run to completion at their start)
    pick.library = lambda kind: True
    pred = predict(plans, Topology(m, 2), lambda r, o: o.seconds, pick, keep_spans=True)
    spans = [(a, b) for a, b, op, idle in pred.spans[0] if idle is None]
    assert len(spans) == 2 and all(a == 0.0 for a, _ in spans)
    hidden = pred.breakdown[0]["dp_hidden"]
    assert math.isclose(hidden, max(b for _, b in spans), rel_tol=1e-12)
    assert hidden < sum(b - a for a, b in spans)


def test_mpi_latency_is_fitted_to_mpi_over_all_ranks_and_only_reported_for_pairs():
    # every pair at once after one barrier is the slow case (the proxies' small groups run
    # out of step): measured 3x slower than the truth, the pairs leave the fit where it was
    from proxies.calibrate.fit import PAIRS, fit_oversubscribed, pairs

    truth = replace(crowded_machine(2), oversub_mpi_latency=1.5e-3, oversub_wake=1e-4)
    truth = replace(truth, ranks_per_node=4)
    sizes = [8, 64 << 10, 1 << 20]

    def seconds(alg, who):
        return [
            (s, collective_seconds(truth, "allreduce", alg, who, s // 4, ranks_per_node=4))
            for s in sizes
        ]

    measured = {"ring": seconds("ring", 4), "rd": seconds("rd", 4), "mpi": seconds("mpi", 4)}
    slow = {f"mpi{PAIRS}": [(s, 3 * t) for s, t in seconds("mpi", pairs(4))]}
    start = replace(truth, oversub_mpi_latency=None)
    alone, _ = fit_oversubscribed(start, measured, 4, 4)
    both, record = fit_oversubscribed(start, measured | slow, 4, 4)
    assert all(abs(r[3]) < 0.05 for r in record["residuals"]["mpi"])  # MPI's, over all
    assert both.oversub_mpi_latency == alone.oversub_mpi_latency
    assert all(r[3] < -0.5 for r in record["residuals"][f"mpi{PAIRS}"])  # reported: 3x off


def test_a_pending_collective_steps_at_the_tests_of_the_wait_its_rank_is_in():
    # MPI takes a non-blocking collective's next step inside a test: posted and waited for
    # at once, it moves at the wait's tests as a blocking one does; under compute (the
    # progress thread testing every 100 us) it is not held to the wait's backoff
    m = replace(crowded_machine(1), oversub_mpi_latency=2e-3)
    pick = chooser(m, "ring")  # 2 ranks: a reduce-scatter step, then an allgather step
    pick.library = lambda kind: True
    topo = Topology(m, 2, "yield")
    g = {"w": (0, 1)}

    def run(*ops):
        plans = [Plan(r, ops, g) for r in (0, 1)]
        return predict(plans, topo, lambda r, o: o.seconds, pick, keep_spans=True)

    blocking = run(Collective("allreduce", "w", "x", 1000, "float32")).time
    waited = run(Collective("allreduce", "w", "x", 1000, "float32", req="a"), Wait("a")).time
    assert math.isclose(waited, blocking, rel_tol=1e-9)
    under = run(
        Collective("allreduce", "w", "x", 1000, "float32", req="a"),
        Compute("forward", seconds=0.1),
        Wait("a"),
    )
    done = [end for _, end, op, idle in under.spans[0] if idle is None and op.req == "a"]
    assert done and done[0] < blocking - 0.5e-3  # no test quantization between its steps


def test_unexpected_messages_take_the_tests_of_the_wait_they_reach():
    # MPI takes in one arriving message per test: a message for an op its rank has not
    # posted yet takes a test of the rank's backed-off wait (measured: 8 tiny sends into a
    # rank waiting on a 16 MiB all-to-all held it 8 tests of 1 ms). Ranks 1 and 2 run MPI's
    # allreduce, one exchange that arrives after 2 ms (mpi_latency) and is seen at the
    # wait's test at 2.31 ms (tests at 50, 70, 110, 190, 350, 670, 1310, 2310, 3310 us...);
    # rank 0 sends k messages to rank 1, which receives them after the allreduce; they
    # arrive at 300 us (the crowded latency), while the exchange is moving: each one puts
    # the step a test later.
    m = replace(crowded_machine(1), oversub_mpi_latency=2e-3, oversub_unexpected=1.0)
    pick = chooser(m, "rd")
    pick.library = lambda kind: True
    g = {"w": (1, 2)}

    def allreduce_end(k: int, wait: str = "yield", lead=(0.0, 0.0), m=m) -> float:
        msgs = lambda peer: tuple(Msg(peer, t, "x", 0, 2) for t in range(k))  # noqa: E731
        ar = Collective("allreduce", "w", "g", 2, "float32")
        first = [(Compute("forward", seconds=s),) if s else () for s in lead]
        plans = [
            Plan(0, (P2P("pp", sends=msgs(1)),) if k else (), g),
            Plan(1, (*first[0], ar, P2P("pp", recvs=msgs(0))) if k else (*first[0], ar), g),
            Plan(2, (*first[1], ar), g),
        ]
        pred = predict(plans, Topology(m, 3, wait), lambda r, o: o.seconds, pick, keep_spans=True)
        return next(end for _, end, op, _ in pred.spans[1] if isinstance(op, Collective))

    alone = allreduce_end(0)
    assert math.isclose(alone, 2.31e-3, rel_tol=1e-6)
    for k in (1, 3, 5):
        assert math.isclose(allreduce_end(k), alone + k * 1e-3, rel_tol=1e-6)
    # rank 2 joins 5 ms late: nothing of the allreduce moves while the messages come in,
    # they take tests (350 us ... 6.31 ms) that moved nothing; the step, at 7 ms, is seen
    # at the first test left (7.31 ms), as without them; a ninth takes that one too
    late = allreduce_end(0, lead=(0.0, 5e-3))
    assert math.isclose(late, 7.31e-3, rel_tol=1e-6)
    assert math.isclose(allreduce_end(8, lead=(0.0, 5e-3)), late, rel_tol=1e-9)
    assert math.isclose(allreduce_end(9, lead=(0.0, 5e-3)), late + 1e-3, rel_tol=1e-6)
    # spinning waits test back to back; a rank at work takes them in at its next call
    assert math.isclose(allreduce_end(8, "spin"), allreduce_end(0, "spin"), rel_tol=1e-9)
    busy = allreduce_end(0, lead=(5e-3, 5e-3))
    assert math.isclose(allreduce_end(8, lead=(5e-3, 5e-3)), busy, rel_tol=1e-9)
    # the machine's figure: half a test each (every second message takes one), none where
    # the file leaves it out or on a node with a core per rank
    half = replace(m, oversub_unexpected=0.5)
    assert math.isclose(allreduce_end(8, m=half), allreduce_end(4), rel_tol=1e-9)
    assert math.isclose(allreduce_end(8, m=replace(m, oversub_unexpected=None)), alone)
    roomy = replace(m, cores_per_node=3)
    assert math.isclose(allreduce_end(8, m=roomy), allreduce_end(0, m=roomy), rel_tol=1e-9)


# -- where the ranks of a prediction sit ------------------------------------------------------

# A file calibrated with 4 ranks on 2 cores: its own placement is crowded.
CROWDED4 = FULL | {"nodes": {"ranks_per_node": 4, "cores_per_node": 2}}
GPT3 = ["proxies.gpt3", "2", "1", "--model", "gpt3-tiny", "--tp", "2", "--seq-len", "32"]


def test_a_prediction_places_ranks_as_told_as_the_run_did_or_as_the_file_says():
    from types import SimpleNamespace as NS

    from proxies.core.prediction import machine_rpn

    m = replace(crowded_machine(2), ranks_per_node=4)
    assert machine_rpn(NS(), m, 8) == 4  # the file's nodes
    assert machine_rpn(NS(), m, 2) == 2  # 2 ranks on nodes of 4: one node holding 2
    assert machine_rpn(NS(ranks_per_node=None, placed_per_node=2), m, 8) == 2  # the run's
    assert machine_rpn(NS(ranks_per_node=1, placed_per_node=2), m, 8) == 1  # the option's


def predicted(tmp_path, cmd: list[str], name: str) -> dict:
    """The prediction in the --json of a run or dry run: its iteration and its note."""
    import json

    from launch import run

    out = str(tmp_path / f"{name}.json")
    r = run([*cmd, "--json", out, "--quiet"], timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.load(open(out))
    return {"time": got["predicted_iter_time_s"], "note": got["prediction"]}


@pytest.mark.slow
def test_two_ranks_on_a_file_of_four_per_node_are_two_on_one_node(tmp_path):
    # not crowded: 2 ranks on 2 cores, whatever the file's calibration ran with
    import sys

    path = write(tmp_path, CROWDED4)
    dry = [sys.executable, "-m", *GPT3, "--compute", "none", "--dry-run", "--machine", path]
    two = predicted(tmp_path, [*dry, "--world-size", "2"], "two")
    told = predicted(tmp_path, [*dry, "--world-size", "2", "--ranks-per-node", "2"], "told")
    assert "(2 ranks per node, 1 node)" in two["note"]
    assert two["time"] == told["time"]


@pytest.mark.mpi
def test_a_run_is_predicted_as_it_placed_its_ranks(tmp_path):
    # mpiexec -n 2 with a file calibrated at 4 ranks per node on 2 cores: priced as the 2
    # ranks this run has on its node, as the dry run with --ranks-per-node 2 prices it
    import sys

    from launch import mpiexec

    path = write(tmp_path, CROWDED4)
    args = [*GPT3, "--compute", "none", "--machine", path]
    run = [mpiexec(), "-n", "2", sys.executable, "-m", *args, "--iters", "1", "--warmup", "0"]
    ran = predicted(tmp_path, run, "ran")
    dry = [sys.executable, "-m", *args, "--dry-run", "--world-size", "2", "--ranks-per-node"]
    assert "(2 ranks per node, as this run placed them, 1 node)" in ran["note"], ran["note"]
    assert ran["time"] == predicted(tmp_path, [*dry, "2"], "two")["time"]
    assert ran["time"] != predicted(tmp_path, [*dry, "1"], "one")["time"]


@pytest.mark.mpi
def test_the_collectives_benchmark_predicts_the_run_as_placed(tmp_path):
    # its "is my number normal?" column, for the 2 ranks of this run on their node (the
    # file says 4 a node on 2 cores): the dry run's figure with --ranks-per-node 2
    import json
    import sys

    from launch import mpiexec, run

    path = write(tmp_path, CROWDED4)
    args = ["-b", "1M", "-e", "1M", "-a", "mpi", "--machine", path]
    out = str(tmp_path / "rows.json")
    ran = run([mpiexec(), "-n", "2", sys.executable, "-m", "proxies.collectives", *args,
               "-J", out], timeout=120)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert "predicted on test cluster (2 ranks per node)" in ran.stdout
    dry = run([sys.executable, "-m", "proxies.collectives", *args, "--dry-run",
               "--world-size", "2", "--ranks-per-node", "2"], timeout=60)  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    row = json.load(open(out))[0]
    assert f"{row['predicted_time_us']:.1f}" in dry.stdout.splitlines()[-1]
