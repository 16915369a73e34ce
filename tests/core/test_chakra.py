"""--chakra: Chakra execution traces written from the plan (dry runs, no MPI), read back with
Chakra's own decoder, compared with the plan, and the validator (core/chakra_check.py)
passing on them and failing on one broken file per pitfall."""

import importlib
import json
import sys

import pytest

pytest.importorskip("chakra.schema.protobuf.et_def_pb2")

from proxies.core import chakra, chakra_check, cli, exits  # noqa: E402
from proxies.core.plan import P2P, Collective, Compute, Wait  # noqa: E402

WORLD = 64
CASES = {
    "gpt2": ["12", "4"],  # pipeline and data parallel
    "gpt3-tp-pp": ["--model", "gpt3-tiny", "4", "4", "--tp", "2"],
    "gpt3-moe": ["--model", "gpt3-tiny", "4", "2", "--tp", "2", "--moe-experts", "4", "--ep", "2"],
    # context parallel: the ring's non-blocking key/value exchanges
    "gpt3-cp-ring": ["--model", "gpt3-tiny", "4", "2", "--tp", "2", "--cp", "4", "--seq-len", "64"],
    "cosmoflow": ["--model", "dnn-cpp-proxies"],
    "dlrm": ["--model", "mlperf"],
}


def export(case: str, out) -> tuple:
    """Dry run of `case` at 64 ranks with --chakra out: (its job, its exit status)."""
    proxy = importlib.import_module(f"proxies.{case.split('-')[0]}.proxy")
    argv = [*CASES[case], "--dry-run", "--world-size", str(WORLD), "--quiet", "--chakra", str(out)]
    code = proxy.main(argv)
    job = proxy.make_job(proxy.parser().parse_args(argv), WORLD)
    return job, code


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Every case exported once for the module."""
    out = {}
    for case in CASES:
        d = tmp_path_factory.mktemp(case)
        out[case] = (d, *export(case, d))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_matches_the_plan(written, case):
    d, job, code = written[case]
    assert code == exits.OK
    pb = chakra.load()
    paths = chakra_check.traces(str(d))
    assert sorted(paths) == list(range(WORLD))
    rate = job.config.get("device_tflops", 150.0) * 1e12
    for r in (0, WORLD // 2 + 1, WORLD - 1):
        plan = job.plan(r)
        meta, nodes = chakra_check.read_trace(paths[r])
        assert meta.version == chakra.SCHEMA
        by = {k: [n for n in nodes if n.type == getattr(pb, k)] for k in chakra_check.COMM}
        comp = [n for n in nodes if n.type == pb.COMP_NODE]
        computes = [op for op in plan.ops if isinstance(op, Compute)]
        waits = [op for op in plan.ops if isinstance(op, Wait)]
        colls = [op for op in plan.ops if isinstance(op, Collective)]
        sends = [m for _, m, w in plan.messages() if w == "send"]
        recvs = [m for _, m, w in plan.messages() if w == "recv"]
        assert len(comp) == len(computes) + len(waits)
        assert len(by["COMM_SEND_NODE"]) == len(sends)
        assert len(by["COMM_RECV_NODE"]) == len(recvs)
        assert len(by["COMM_COLL_NODE"]) == len(colls)

        def size(n):
            return chakra_check.attrs(n)["comm_size"].int64_val

        assert [size(n) for n in by["COMM_SEND_NODE"]] == [m.nbytes for m in sends]
        assert [size(n) for n in by["COMM_RECV_NODE"]] == [m.nbytes for m in recvs]
        assert [size(n) for n in by["COMM_COLL_NODE"]] == [c.nbytes for c in colls]
        kinds = [chakra_check.attrs(n)["comm_type"].int64_val for n in by["COMM_COLL_NODE"]]
        want = [pb.CollectiveCommType.Value(chakra.COMM_TYPES[c.kind]) for c in colls]
        assert kinds == want
        # compute durations: the modelled time, in whole microseconds
        work = [n for n in comp if not n.name.startswith("wait ")]
        assert [n.duration_micros for n in work] == [
            round(op.model_seconds(rate) * 1e6) for op in computes
        ]
        assert sum(chakra_check.attrs(n)["num_ops"].int64_val for n in work) == sum(
            int(op.flops) for op in computes
        )
    assert chakra_check.check(str(d)) == []


def test_groups_file_lists_every_group_as_the_plans_do(written):
    d, job, _ = written["gpt3-tp-pp"]
    groups = json.loads((d / chakra.GROUP_FILE).read_text())
    for r in range(WORLD):
        plan = job.plan(r)
        for name in {op.group for op in plan.ops if isinstance(op, Collective)}:
            gid = chakra.group_id(tuple(job.group_names), WORLD, name, plan.groups[name])
            assert groups[gid] == list(plan.groups[name])


def test_waits_keep_the_overlap(written):
    """A non-blocking collective: nothing but its wait depends on it, and the op after the
    wait depends on the wait (cosmoflow's gradient buckets overlap the backward)."""
    d, job, _ = written["cosmoflow"]
    plan = job.plan(0)
    assert any(isinstance(op, Collective) and op.req for op in plan.ops)
    _, nodes = chakra_check.read_trace(chakra_check.traces(str(d))[0])
    by_id = {n.id: n for n in nodes}
    for n in nodes:
        if n.name.startswith("wait "):
            started = [
                by_id[i] for i in n.data_deps if by_id[i].type == chakra.load().COMM_COLL_NODE
            ]
            assert len(started) == 1
            users = [m for m in nodes if started[0].id in m.data_deps]
            assert users == [n]  # only the wait: the compute in between overlaps it
            after = [m for m in nodes if n.id in m.data_deps]
            assert after or n is nodes[-1]


def test_non_blocking_exchanges_overlap_until_their_wait(written):
    """The cp ring's exchanges are non-blocking P2P batches: their send/recv nodes are
    depended on only by their wait, so the block computed meanwhile overlaps them."""
    d, job, _ = written["gpt3-cp-ring"]
    assert any(isinstance(op, P2P) and op.req for op in job.plan(0).ops)
    pb = chakra.load()
    _, nodes = chakra_check.read_trace(chakra_check.traces(str(d))[0])
    p2p = {pb.COMM_SEND_NODE, pb.COMM_RECV_NODE}
    waited = 0
    for n in nodes:
        if n.name.startswith("wait cp_ring"):
            exchange = [m for m in nodes if m.id in n.data_deps and m.type in p2p]
            assert exchange
            for m in exchange:
                assert [u for u in nodes if m.id in u.data_deps] == [n]
            waited += 1
    assert waited


def rewrite(path, nodes):
    """Write `nodes` back with Chakra's own encoder."""
    pb, lib = chakra.load(), chakra.protolib()
    with open(path, "wb") as f:
        lib.encodeMessage(f, pb.GlobalMetadata(version=chakra.SCHEMA))
        for n in nodes:
            lib.encodeMessage(f, n)


def first(nodes, kind):
    pb = chakra.load()
    return next(n for n in nodes if n.type == getattr(pb, kind))


def set_attr(node, name, **value):
    for a in node.attr:
        if a.name == name:
            a.Clear()
            a.name = name
            for k, v in value.items():
                setattr(a, k, v)


def _int32_size(nodes):
    n = first(nodes, "COMM_COLL_NODE")
    set_attr(n, "comm_size", int32_val=chakra_check.attrs(n)["comm_size"].int64_val)


def _cpu_comm(nodes):
    set_attr(first(nodes, "COMM_SEND_NODE"), "is_cpu_op", bool_val=True)


def _duplicate_id(nodes):
    nodes[3].id = nodes[2].id


def _outside_dep(nodes):
    nodes[5].data_deps.append(10**9)


def _cycle(nodes):
    nodes[0].data_deps.append(nodes[4].id)


def _send_size(nodes):
    n = first(nodes, "COMM_SEND_NODE")
    set_attr(n, "comm_size", int64_val=chakra_check.attrs(n)["comm_size"].int64_val + 4)


def _coll_type(nodes):
    n = first(nodes, "COMM_COLL_NODE")
    set_attr(n, "comm_type", int64_val=chakra.load().ALL_TO_ALL)


BREAKS = {
    "comm_size not int64": (_int32_size, "comm_size must be a non-negative int64"),
    "is_cpu_op on communication": (_cpu_comm, "is_cpu_op must be the bool false"),
    "duplicate node id": (_duplicate_id, "appears twice"),
    "dependency outside the file": (_outside_dep, "not in the file"),
    "cycle": (_cycle, "dependency cycle"),
    "send/recv sizes differ": (_send_size, "sent sizes"),
    "group members disagree": (_coll_type, "differ from rank"),
}


@pytest.mark.parametrize("pitfall", list(BREAKS))
def test_validator_catches(tmp_path, pitfall):
    """gpt2 at 8 ranks (pipeline sends, dp collectives), rank 2's file broken one way."""
    from proxies.gpt2 import proxy

    argv = ["4", "2", "--dry-run", "--world-size", "8", "--quiet", "--chakra", str(tmp_path)]
    assert proxy.main(argv) == exits.OK
    assert chakra_check.check(str(tmp_path)) == []
    path = chakra_check.traces(str(tmp_path))[2]
    _, nodes = chakra_check.read_trace(path)
    brk, words = BREAKS[pitfall]
    brk(nodes)
    rewrite(path, nodes)
    problems = chakra_check.check(str(tmp_path))
    assert problems and any(words in p for p in problems), problems
    assert chakra_check.main([str(tmp_path)]) == exits.CHECK


def test_validator_cli(tmp_path, capsys):
    assert chakra_check.main([str(tmp_path)]) == exits.USAGE  # no traces
    assert "no <prefix>.<rank>.et" in capsys.readouterr().err


def test_missing_package_is_exit_2(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "chakra", None)  # import chakra -> ImportError
    monkeypatch.delitem(sys.modules, "chakra.schema.protobuf.et_def_pb2", raising=False)
    monkeypatch.delitem(sys.modules, "chakra.schema.protobuf", raising=False)
    monkeypatch.delitem(sys.modules, "chakra.schema", raising=False)
    from proxies.gpt2 import proxy

    with pytest.raises(cli.UsageError, match="mlc-chakra"):
        proxy.main(["4", "2", "--dry-run", "--world-size", "8", "--chakra", str(tmp_path)])


def test_bad_directory_is_exit_2(tmp_path):
    from proxies.gpt2 import proxy

    afile = tmp_path / "f"
    afile.write_text("")
    for bad, words in ((str(afile), "not a directory"), ("", "empty path")):
        with pytest.raises(cli.UsageError, match=words):
            proxy.main(["4", "2", "--dry-run", "--world-size", "8", "--chakra", bad])


# -- a measured run (mpiexec): compute nodes carry the run's own per-op times --------------

RUNS = {  # 4 ranks each: (module, argv, the categories compute ops book their time to)
    "gpt2": (
        "proxies.gpt2",
        ["8", "4", "4", "--compute", "model", "--device-tflops", "1"],
        ("compute",),
    ),
    "cosmoflow": (  # real kernels: nothing like the modelled 150 TFLOP/s times
        "proxies.cosmoflow",
        ["--model", "cosmoflow-tiny", "--global-batch", "2", "--compute", "real"],
        ("compute", "data"),
    ),
}


def nodes_by_rank(d) -> list[list]:
    paths = chakra_check.traces(str(d))  # rank -> file
    return [chakra_check.read_trace(paths[r])[1] for r in sorted(paths)]


@pytest.mark.mpi
@pytest.mark.parametrize("case", list(RUNS))
def test_measured_run_carries_the_measured_compute(tmp_path, case):
    """A 4-rank run with --chakra: the traces read back and validate, have exactly the dry
    run's nodes (the plan's; checked against the plan above), and each rank's compute nodes
    add up to the compute the run measured per iteration (--json), within the rounding of
    each node to whole microseconds plus 3%."""
    from launch import mpirun

    module, argv, cats = RUNS[case]
    d, res = tmp_path / "run", tmp_path / "r.json"
    timed = ["--iters", "2", "--warmup", "1", "--quiet"]
    r = mpirun(4, module, *argv, *timed, "--chakra", str(d), "--json", str(res), timeout=240)
    assert r.returncode == 0, r.stderr
    result = json.loads(res.read_text())
    s = result["chakra"]
    assert (s["files"], s["durations"], s["statistic"], s["iterations"]) == (
        4,
        "measured",
        "mean",
        2,
    )
    assert chakra_check.check(str(d)) == []
    assert not [p for p in d.iterdir() if ".tmp" in p.name]  # written atomically, all renamed

    proxy = importlib.import_module(f"{module}.proxy")  # the same job, dry: modelled times
    plan_dir = tmp_path / "plan"
    assert (
        proxy.main([*argv, "--dry-run", "--world-size", "4", "--quiet", "--chakra", str(plan_dir)])
        == 0
    )
    pb = chakra.load()
    measured, planned = nodes_by_rank(d), nodes_by_rank(plan_dir)
    assert s["nodes"] == sum(len(n) for n in planned)
    per_rank = result["breakdown_per_rank_s"]
    differ = 0
    for rank, (got, want) in enumerate(zip(measured, planned, strict=True)):
        assert [(n.id, n.name, n.type, list(n.data_deps), list(n.ctrl_deps)) for n in got] == [
            (n.id, n.name, n.type, list(n.data_deps), list(n.ctrl_deps)) for n in want
        ]
        comp = [n for n in got if n.type == pb.COMP_NODE and not n.name.startswith("wait ")]
        assert comp and all(n.duration_micros == 0 for n in got if n.type != pb.COMP_NODE)
        total = sum(n.duration_micros for n in comp) * 1e-6
        run_s = sum(per_rank[c][rank] for c in cats if c in per_rank)
        assert total == pytest.approx(run_s, rel=0.03, abs=0.5e-6 * len(comp)), rank
        pairs = zip(got, want, strict=True)
        differ += sum(a.duration_micros != b.duration_micros for a, b in pairs)
    assert differ  # the run's times, not the plan's


@pytest.mark.mpi
def test_measured_run_bad_directory_is_exit_2(tmp_path):
    """A DIR that is a file: one line, exit 2, before any MPI work, on every rank."""
    from launch import mpirun

    afile = tmp_path / "f"
    afile.write_text("")
    r = mpirun(2, "proxies.gpt2", "4", "2", "--chakra", str(afile), "--timeout", "20", timeout=60)
    assert r.returncode == exits.USAGE, (r.returncode, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "not a directory" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
