"""python -m proxies calibrate: the fit, refusals before measuring, and quick runs whose file
loads back."""

import json
import math
import os
import shutil
import sys
from dataclasses import replace

import pytest
from launch import mpirun, run

from proxies.calibrate import fit_hockney
from proxies.calibrate.main import output_problem
from proxies.core.collectives import ALGORITHMS
from proxies.core.machine import load


def test_fit_recovers_exact_hockney_times():
    latency, bandwidth = 2.5e-6, 12e9
    points = [(s, latency + s / bandwidth) for s in (8, 512, 32768, 1 << 20, 64 << 20)]
    a, b, residuals = fit_hockney(points)
    assert math.isclose(a, latency, rel_tol=1e-9) and math.isclose(b, bandwidth, rel_tol=1e-9)
    assert max(abs(r) for r in residuals) < 1e-9


def test_fit_weighs_small_and_large_sizes_alike():
    # +-5% on every time: both figures stay within 10%. An absolute least squares would
    # let the 64 MiB time decide: its 5% is 670 us, hundreds of times the latency.
    latency, bandwidth = 1e-6, 5e9
    sizes = [8 * 4**k for k in range(12)] + [64 << 20]
    points = [
        (s, (latency + s / bandwidth) * (1.05 if k % 2 else 0.95)) for k, s in enumerate(sizes)
    ]
    a, b, residuals = fit_hockney(points)
    assert math.isclose(a, latency, rel_tol=0.1) and math.isclose(b, bandwidth, rel_tol=0.1)
    assert len(residuals) == len(points) and max(abs(r) for r in residuals) < 0.12


def test_arena_hands_out_slices_the_caches_have_lost():
    from proxies.calibrate.measure import Arena, cache_bytes

    assert cache_bytes() >= 1 << 16
    arena = Arena(1 << 20)
    assert arena.data.nbytes >= 2 * cache_bytes()
    size = 1 << 20
    per_lap = arena.data.nbytes // size
    slices = [arena.take(size) for _ in range(per_lap + 1)]
    starts = [s.__array_interface__["data"][0] for s in slices]
    # every slice of a lap is new (an arena of 2 x the caches between two uses of one)...
    assert len(set(starts[:per_lap])) == per_lap and all(s.nbytes == size for s in slices)
    # ...then it starts over at the beginning; a size above the arena gets the whole arena
    assert starts[per_lap] == starts[0]
    big = Arena(1 << 20).take(arena.data.nbytes * 2)
    assert big.nbytes <= arena.data.nbytes
    # small sizes advance by a page, so no two share a cache line
    tiny = Arena(1 << 20)
    a, b = tiny.take(8), tiny.take(8)
    assert b.__array_interface__["data"][0] - a.__array_interface__["data"][0] == 4096


def test_the_node_exchange_record_keeps_every_size_and_the_fit_answers_to_each():
    from proxies.calibrate.exchange import exchange_record
    from proxies.calibrate.fit import EXCHANGE, exchange_target

    points = [(1 << 20, 1e-4), (4 << 20, 3e-4), (16 << 20, 1.6e-3)]
    record = exchange_record(points, 2)
    assert record["bytes_each"] == 16 << 20 and record["seconds"] == 1.6e-3
    assert math.isclose(record["bandwidth"], 2 * (16 << 20) / 1.6e-3, rel_tol=1e-3)
    assert exchange_target(record) == {EXCHANGE: points}
    old = {k: record[k] for k in ("flows", "bytes_each", "seconds", "bandwidth")}
    assert exchange_target(old) == {EXCHANGE: [(16 << 20, 1.6e-3)]}  # a file from before
    none = exchange_record([], 0)
    assert none["flows"] == 0 and none["points"] == [] and exchange_target(none) == {}


def test_mpi_table_takes_the_nearer_measured_size():
    """A size between two measured ones is priced as the nearer one (on a log scale), not
    as the larger: MPI's 2 MiB allreduce follows what it did at 1 MiB, not at 16 MiB."""
    from proxies.calibrate.fit import mpi_table
    from proxies.core.machine import ANY
    from proxies.core.mpi_choice import mpi_algorithm
    from proxies.core.prediction import collective_seconds

    m = load(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "machines",
                          "one-node.yaml"))  # fmt: skip

    def t(alg, size):
        return collective_seconds(m, "allreduce", alg, 2, size // 4, "float32", 2, library=True)

    # measured: ring's times at 1 MiB and 64 MiB, tree's at 16 MiB
    points = [(1 << 20, t("ring", 1 << 20)), (16 << 20, t("tree", 16 << 20)),
              (64 << 20, t("ring", 64 << 20))]  # fmt: skip
    table = mpi_table(m, points, 2, 2)
    assert table == [(4 << 20, "ring"), (32 << 20, "tree"), (ANY, "ring")]
    pick = replace(m, mpi={"allreduce": table})
    assert [mpi_algorithm(pick, "allreduce", s) for s in (2 << 20, 8 << 20, 40 << 20)] == [
        "ring", "tree", "ring"]  # fmt: skip


def test_output_problems(tmp_path):
    assert output_problem(str(tmp_path / "m.yaml")) is None
    assert "no such directory" in output_problem("/nonexistent/dir/x.yaml")
    assert "is a directory" in output_problem(str(tmp_path))


def one_error_line(r, words):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("proxies.calibrate: error: ")
    for w in words:
        assert w in lines[0]
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_bad_output_path_exits_2_before_measuring():
    r = run([sys.executable, "-m", "proxies", "calibrate", "-o", "/nonexistent/dir/x.yaml"], 60)
    one_error_line(r, ["-o /nonexistent/dir/x.yaml: no such directory /nonexistent/dir"])
    assert "ping-pong" not in r.stdout


@pytest.mark.mpi
@pytest.mark.parametrize(
    "ranks,args,words",
    [
        (4, ["--ranks-per-node", "3"], ["--ranks-per-node 3 does not divide the 4 ranks"]),
        (2, ["--ranks-per-node", "1"], ["every node has one rank"]),
        (2, ["--ranks-per-node", "0"], ["--ranks-per-node", "positive integer"]),
    ],
)
def test_impossible_layouts_exit_2(tmp_path, ranks, args, words):
    out = str(tmp_path / "m.yaml")
    r = mpirun(ranks, "proxies", "calibrate", "-o", out, "--quick", *args, timeout=60)
    one_error_line(r, words)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "ranks,args,words",
    [
        (1, [], "needs 2 or more ranks"),
        (2, ["--machine", "/nonexistent.yaml"], "/nonexistent.yaml: cannot read"),
        (2, ["--json", "/nonexistent/dir/p.json"], "--json /nonexistent/dir/p.json"),
        (2, ["--machine", "configs/machines/10gbe.yaml"], "calibration.state: missing"),
    ],
)
def test_probe_refuses_before_measuring(ranks, args, words):
    r = mpirun(ranks, "proxies.calibrate.probe", *args, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines == [f"proxies.calibrate.probe: error: {lines[0].split('error: ', 1)[1]}"]
    assert words in lines[0] and r.stdout == ""


@pytest.mark.mpi
def test_quick_run_on_one_node(tmp_path):
    out = str(tmp_path / "m.yaml")
    r = mpirun(2, "proxies", "calibrate", "-o", out, "--quick", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "not measured: inter_node" in r.stdout and f"wrote {out}" in r.stdout
    m = load(out)
    assert m.inter is None and m.nic_bandwidth is None and "inter_node" in m.unmeasured
    assert m.ranks_per_node == 2 and m.cores_per_node >= 1 and m.name == "m"
    assert m.intra.latency > 0 and m.intra.bandwidth > 0
    assert m.matmul_flops > 0 and m.memory_bandwidth > 0 and m.reduce_bandwidth > 0
    cal = m.calibration
    assert set(cal["allreduce"]) == set(ALGORITHMS)
    assert all(len(rows) == 2 and rows[0][0] == 8 for rows in cal["allreduce"].values())
    assert len(cal["intra_node"]["points"]) == 7 and cal["intra_node"]["ranks"] == [0, 1]
    # the fit also answers to MPI's in-place all-to-all and the node exchange's messages
    assert [s for s, _ in cal["alltoall"]["mpi"]] == [64 << 10]
    assert {"alltoall:mpi", "exchange", "ring"} <= set(cal["fit"]["residuals"])
    # MPI's temporaries: page faults per call at the quick sizes (16 and 48 MiB), the rate
    faulted = cal["fresh_memory"]["faulted_per_call"]
    assert [s for s, _ in faulted] == [16 << 20, 48 << 20] and cal["fresh_memory"]["fault_rate"] > 0
    if m.fresh_above is not None:  # 48 MiB is above glibc's mmap threshold where glibc is used
        assert m.fresh_above == 16 << 20 and m.fault_rate > 0
        # timed again with the mmap threshold raised: MPI's temporary no longer faults
        assert cal["fresh_memory"]["from_mpi"]["heap_faulted"] < (48 << 20) / 8
    # reused buffers: the same-buffer allreduce over the fitted model's cold price of it
    assert m.reuse_cache > 0 and m.reread > 0
    assert m.reread == pytest.approx(
        cal["state"]["same_s"] / cal["reuse"]["predicted_cold_s"], rel=1e-3
    )
    # the engine's own cost per op, measured through the engine; 2 ranks: not crowded
    assert cal["engine"]["ops"] == 40 and cal["engine"]["op_overhead"] >= 0
    # and per kind of op, as the file gives them to the predictor
    for kind, seconds in m.op_overheads.items():
        assert kind in ("compute", "exchange", "collective", "nonblocking") and seconds > 0
        assert math.isclose(seconds, cal["engine"][kind], rel_tol=1e-3)
    assert {"exchange", "nonblocking"} <= set(m.op_overheads)  # never free: MPI calls
    # small ops after bulk exchanges: a point per quick size; the file's figures fit them
    cold = cal["cold"]["points"]
    assert [b for b, _, _ in cold] == [4 << 20, 64 << 20]
    assert m.cold_moved == 64 << 20 and m.cold_engine > 0 and 0.1 <= m.cold_exponent <= 3
    assert "  cold        after 64 MiB moved: engine +" in r.stdout
    # a sleep lasts longer than asked (Linux's timer slack alone is 50 us by default)
    assert cal["engine"]["wake"] > 0 and math.isclose(m.wake, cal["engine"]["wake"], rel_tol=1e-3)
    if m.cores_per_node >= 2:
        assert m.oversub is None and "oversubscribed_allreduce" not in cal
    text = open(out).read()
    assert "# not measured: inter_node" in text and "inter_node:" not in text.split("calib")[0]
    # the machine's state figures, on the ping-pong's two ranks
    state = cal["state"]
    assert state["bytes"] == 1 << 20 and state["same_s"] > 0 and state["cold_s"] > 0
    assert math.isclose(state["reread"], state["same_s"] / state["cold_s"], rel_tol=1e-3)
    assert state["copy"] > 0
    assert "  state       1 MiB allreduce " in r.stdout
    # ... and the probe measures them again, beside the file's
    j = str(tmp_path / "probe.json")
    p = mpirun(2, "proxies.calibrate.probe", "--machine", out, "--json", j, timeout=60)
    assert p.returncode == 0, p.stderr
    first, second = p.stdout.splitlines()
    assert f"(x{state['reread']:.2g} calibrated)" in first and " GB/s calibrated)" in first
    assert second.startswith("moved most: ") and f"from {out}'s" in second
    got = json.load(open(j))
    assert got["bytes"] == 1 << 20 and got["reread"] > 0 and got["calibrated"] == state
    assert set(got["drift"]) == {"cold_s", "reread", "copy"}


@pytest.mark.mpi
def test_quick_run_on_emulated_nodes(tmp_path):
    out = str(tmp_path / "m.yaml")
    r = mpirun(
        4, "proxies", "calibrate", "-o", out, "--quick", "--ranks-per-node", "2", timeout=120
    )
    assert r.returncode == 0, r.stderr
    m = load(out)
    assert m.ranks_per_node == 2 and m.inter is not None and m.nic_bandwidth > 0
    assert "inter_node" not in m.unmeasured
    assert m.calibration["nic"]["flows"] == 2  # both ranks of node 1 into node 0
    assert m.calibration["inter_node"]["ranks"] == [0, 2]


@pytest.mark.mpi
@pytest.mark.skipif(
    not shutil.which("taskset") or not hasattr(os, "sched_getaffinity"), reason="needs taskset"
)
def test_quick_run_with_ranks_outnumbering_cores(tmp_path):
    """2 ranks pinned to one core: the first regime measures one rank per node (so no
    allreduce, the ping-pong figures stand), the oversubscribed one both, yielding."""
    from launch import mpiexec

    out = str(tmp_path / "m.yaml")
    core = str(min(os.sched_getaffinity(0)))  # one core this test may use
    cmd = ["taskset", "-c", core, mpiexec(), "-n", "2", sys.executable, "-m", "proxies"]
    r = run([*cmd, "calibrate", "-o", out, "--quick"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "ranks outnumber cores: 1 rank(s) per node measure first" in r.stdout
    m = load(out)
    assert m.cores_per_node == 1 and m.ranks_per_node == 2
    assert m.oversub is not None and m.oversub.latency > 0 and m.oversub.bandwidth > 0
    assert m.oversub_node_bandwidth > 0 and m.oversub_op_overhead is not None
    cal = m.calibration
    assert set(cal["oversubscribed_allreduce"]) == set(ALGORITHMS) and cal["allreduce"] == {}
    assert "alltoall" not in cal and [s for s, _ in cal["oversubscribed_alltoall"]["mpi"]] == [
        64 << 10
    ]
    assert "alltoall:mpi" in cal["oversubscribed_fit"]["residuals"]
    assert (
        cal["oversubscribed_fit"]["rms_log_error_after"]
        <= cal["oversubscribed_fit"]["rms_log_error_before"]
    )
    assert cal["node"]["flows"] == 0 and cal["oversubscribed_node"]["flows"] == 2
    assert cal["compute"]["ranks"] == 1  # kernel rates with a rank per core, the other parked
    assert "# Ranks outnumber cores (2 per node on 1)" in open(out).read()
    assert m.oversub_unexpected is None and "oversubscribed_unexpected" not in cal  # 3+ ranks


@pytest.mark.mpi
@pytest.mark.skipif(
    not shutil.which("taskset") or not hasattr(os, "sched_getaffinity"), reason="needs taskset"
)
def test_crowded_run_of_three_measures_what_an_unexpected_message_costs(tmp_path):
    """3 ranks on one core: ranks 1 and 2 run MPI's all-to-all, rank 0 sends 8 messages
    into rank 1's wait; the figure is the delay over their tests, written and loadable."""
    from launch import mpiexec

    from proxies.calibrate.unexpected import MESSAGES, MOST_TESTS, fitted

    out = str(tmp_path / "m.yaml")
    core = str(min(os.sched_getaffinity(0)))
    cmd = ["taskset", "-c", core, mpiexec(), "-n", "3", sys.executable, "-m", "proxies"]
    r = run([*cmd, "calibrate", "-o", out, "--quick"], timeout=120)
    assert r.returncode == 0, r.stderr
    m = load(out)
    odd = m.calibration["oversubscribed_unexpected"]
    assert odd["messages"] == MESSAGES and odd["alone_s"] > 0 and odd["with_s"] > 0
    assert m.oversub_unexpected is not None and m.oversub_unexpected >= 0
    assert 0 <= m.oversub_unexpected <= MOST_TESTS
    assert math.isclose(m.oversub_unexpected, fitted(odd, m, 3, 3), rel_tol=0.01)
    assert "test(s) per unexpected message" in r.stdout


def test_tests_taken_is_the_delay_over_the_messages_backed_off_tests():
    from proxies.calibrate.unexpected import tests_taken

    record = {"messages": 8, "alone_s": 0.010, "with_s": 0.018}
    assert math.isclose(tests_taken(record, 0.0), 1.0)  # 8 ms over 8 tests of 1 ms
    assert math.isclose(tests_taken(record, 1e-3), 0.5)  # each test 2 ms apart
    assert tests_taken(record | {"with_s": 0.009}, 0.0) == 0.0  # faster: none


def test_unexpected_is_fitted_so_the_predictor_delays_the_measured_layout_as_measured():
    from proxies.calibrate.unexpected import _plan, fitted
    from proxies.core.network import Topology
    from proxies.core.predict import predict
    from proxies.core.prediction import chooser

    from .test_regimes import crowded_machine

    m = replace(crowded_machine(1), oversub_mpi_latency=1e-3, ranks_per_node=4)
    n, nbytes = 4, 12 << 20  # the all-to-all alone: 7.7 ms, steps due among the tests
    plans = [_plan(q, n, nbytes, True) for q in range(n)]

    def rank1(x):
        mx = replace(m, oversub_unexpected=x)
        topo, pick = Topology(mx, 4, "yield"), chooser(mx, "mpi")
        return predict(plans, topo, lambda r, o: o.seconds or 0.0, pick).finish[1]

    base = rank1(0.0)
    one = rank1(1.0) - base
    assert one > 2e-3  # the messages' tests hold rank 1's all-to-all back
    record = {"messages": 8, "bytes": nbytes, "alone_s": 0.0, "with_s": one}
    x = fitted(record, m, n, 4)
    assert x <= 1.0 and math.isclose(rank1(x) - base, one, rel_tol=1e-9)
    assert fitted(record | {"alone_s": 0.01, "with_s": 0.009}, m, n, 4) == 0.0  # none
