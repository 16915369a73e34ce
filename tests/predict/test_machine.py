"""Machine files: units, every validation error, presets, overrides, dump/load, the CLI."""

import copy
import dataclasses
import glob
import math
import os

import pytest
import yaml
from launch import ROOT

from proxies.core import cli
from proxies.core.collectives import ALLREDUCE_NAMES
from proxies.core.machine import (
    ANY,
    MPI_KINDS,
    Level,
    Machine,
    MachineError,
    load,
    mpi_algorithms,
    parse_quantity,
)
from proxies.core.machine_file import dump, dumps
from proxies.core.mpi_choice import MPICH_DEFAULTS
from proxies.core.units import format_quantity

PRESETS = sorted(glob.glob(os.path.join(ROOT, "configs", "machines", "*.yaml")))

# -- units -------------------------------------------------------------------------------------

GOOD = [
    ("15 us", "time", 15e-6),
    ("0.5 µs", "time", 0.5e-6),
    ("0.5 μs", "time", 0.5e-6),
    ("2 ms", "time", 2e-3),
    ("1 s", "time", 1.0),
    ("250 ns", "time", 250e-9),
    ("10 Gb/s", "bandwidth", 10e9 / 8),
    ("10 Gbit/s", "bandwidth", 10e9 / 8),
    ("10 gb/s", "bandwidth", 10e9 / 8),  # the b decides: bits
    ("25 GB/s", "bandwidth", 25e9),
    ("1 KiB/s", "bandwidth", 1024),
    ("2 GiB/s", "bandwidth", 2 * 2**30),
    ("3 kB/s", "bandwidth", 3000),
    ("3 KB/s", "bandwidth", 3000),
    ("100 Mb/s", "bandwidth", 100e6 / 8),
    ("1 TB/s", "bandwidth", 1e12),
    ("7 B/s", "bandwidth", 7),
    ("150 TFLOP/s", "rate", 150e12),
    ("100 GFLOP/s", "rate", 100e9),
    ("2 PFLOP/s", "rate", 2e15),
    ("5 FLOP/s", "rate", 5),
    ("2 KiB", "count", 2048),
    ("64 MB", "count", 64e6),
    ("1 MiB", "count", 2**20),
    (4096, "count", 4096),
    ("1e3 ns", "time", 1e-6),
]


@pytest.mark.parametrize("text,kind,value", GOOD, ids=[str(g[0]) for g in GOOD])
def test_parse_quantity(text, kind, value):
    assert math.isclose(parse_quantity(text, kind), value, rel_tol=1e-15)


BAD = [
    (10, "bandwidth", ["bare number 10", "Gb/s or GB/s"]),
    ("10", "time", ["bare number '10'"]),
    (1.5, "rate", ["bare number"]),
    ("10 us", "bandwidth", ["expected a bandwidth like '10 Gb/s' or '25 GB/s', got '10 us'"]),
    ("10 GB/s", "time", ["expected a time", "got '10 GB/s'"]),
    ("10 Gb", "count", ["expected a size", "'10 Gb'"]),
    ("fast", "time", ["expected a time", "'fast'"]),
    ("0 us", "time", ["not a positive, finite time"]),
    ("-1 GB/s", "bandwidth", ["not a positive, finite bandwidth"]),
    ("nan GB/s", "bandwidth", ["not a positive, finite"]),
    ("inf us", "time", ["not a positive, finite"]),
    ("1e400 GB/s", "bandwidth", ["not a positive, finite"]),
    ("1.5 B", "count", ["whole number of bytes"]),
    ("3 PiB/s", "bandwidth", ["expected a bandwidth"]),
    (True, "count", ["expected a size"]),
    ([1], "time", ["expected a time"]),
]


@pytest.mark.parametrize("text,kind,words", BAD, ids=[f"{b[0]!r}-{b[1]}" for b in BAD])
def test_parse_quantity_refuses(text, kind, words):
    with pytest.raises(ValueError) as e:
        parse_quantity(text, kind)
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("kind", ["time", "bandwidth", "rate", "count"])
def test_format_reads_back(kind):
    values = [1, 7, 1000, 2048, 3 * 2**20, 123456789] if kind == "count" else [
        1.234567e-9, 5e-7, 1.5e-5, 0.25, 3.0, 1.175e9, 2**30, 9.87654321e12, 0.3
    ]  # fmt: skip
    for v in values:
        text = format_quantity(v, kind)
        back = parse_quantity(text, kind)
        assert math.isclose(back, v, rel_tol=5e-6), (v, text, back)


def test_format_prefers_short_exact_units():
    assert format_quantity(2**30, "bandwidth") == "1 GiB/s"
    assert format_quantity(1.25e9, "bandwidth") == "1.25 GB/s"
    assert format_quantity(1.426e-6, "time") == "1.426 us"
    assert format_quantity(2048, "count") == "2 KiB"


# -- a valid file, and every way to break it ----------------------------------------------------

BASE = {
    "name": "test cluster",
    "nodes": {"ranks_per_node": 4, "cores_per_node": 8},
    "intra_node": {"latency": "0.5 us", "bandwidth": "10 GB/s"},
    "inter_node": {"latency": "15 us", "bandwidth": "10 Gb/s", "nic_bandwidth": "20 Gb/s"},
    "switch": {"nodes_per_switch": 32, "oversubscription": 2},
    "compute": {
        "matmul": "100 GFLOP/s",
        "memory": "10 GB/s",
        "device": "150 TFLOP/s",
        "reduce": "5 GB/s",
    },
    "mpi": {"allreduce": [["2 KiB", "tree"], ["any", "rhd"]], "bcast": "binomial"},
    "unmeasured": ["compute.device"],
    "calibration": {"note": "hand-made"},
}


def write(tmp_path, data, name="m.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(path)


def test_base_file_loads(tmp_path):
    m = load(write(tmp_path, BASE))
    assert m.name == "test cluster" and m.source.endswith("m.yaml")
    assert (m.ranks_per_node, m.cores_per_node) == (4, 8)
    assert m.intra == Level(0.5e-6, 10e9)
    assert m.inter == Level(15e-6, 1.25e9)
    assert m.nic_bandwidth == 2.5e9
    assert (m.switch_nodes, m.oversubscription) == (32, 2.0)
    assert (m.matmul_flops, m.memory_bandwidth, m.device_flops, m.reduce_bandwidth) == (
        100e9,
        10e9,
        150e12,
        5e9,
    )
    assert m.mpi == {"allreduce": [(2048, "tree"), (ANY, "rhd")], "bcast": [(ANY, "binomial")]}
    assert m.unmeasured == ("compute.device",) and m.calibration == {"note": "hand-made"}
    assert m.node_of(7) == 1


def test_optional_parts(tmp_path):
    data = copy.deepcopy(BASE)
    for key in ("name", "inter_node", "switch", "mpi", "unmeasured", "calibration"):
        del data[key]
    for key in ("matmul", "memory", "device"):
        del data["compute"][key]
    m = load(write(tmp_path, data, "small-box.yaml"))
    assert m.name == "small-box" and m.inter is None and m.nic_bandwidth is None
    assert m.switch_nodes is None and m.oversubscription == 1.0
    assert m.matmul_flops is None and m.device_flops is None and m.mpi == {}


def mutate(path: str, value):
    data = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    node = data
    for p in parents:
        node = node[p]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return data


DELETE = object()

ERRORS = [
    # (dotted key, new value, the key the message names, words)
    ("nam", "x", "nam", ["unknown key", "did you mean 'name'?"]),
    ("intra_node.bandwith", "1 GB/s", "intra_node.bandwith", ["did you mean 'bandwidth'?"]),
    ("nodes.ranks_per_node", 0, "nodes.ranks_per_node", ["positive integer", "0"]),
    ("nodes.cores_per_node", 2.5, "nodes.cores_per_node", ["positive integer", "2.5"]),
    ("nodes.cores_per_node", DELETE, "nodes.cores_per_node", ["missing"]),
    ("intra_node", DELETE, "intra_node", ["missing", "section"]),
    ("intra_node.latency", 0.5, "intra_node.latency", ["bare number 0.5"]),
    ("inter_node.bandwidth", 10, "inter_node.bandwidth", ["bare number 10", "Gb/s or GB/s"]),
    (
        "inter_node.bandwidth",
        "10 us",
        "inter_node.bandwidth",
        ["expected a bandwidth like '10 Gb/s' or '25 GB/s', got '10 us'"],
    ),
    ("inter_node.nic_bandwidth", DELETE, "inter_node.nic_bandwidth", ["missing"]),
    ("inter_node.latency", "-3 us", "inter_node.latency", ["not a positive, finite time"]),
    ("inter_node.latency", ".nan us", "inter_node.latency", ["expected a time"]),
    ("compute.reduce", DELETE, "compute.reduce", ["missing"]),
    ("compute.device", "150 TB/s", "compute.device", ["expected a rate"]),
    ("compute.matmul", "0 GFLOP/s", "compute.matmul", ["not a positive"]),
    ("switch.oversubscription", 0.5, "switch.oversubscription", ["ratio >= 1", "0.5"]),
    ("switch.oversubscription", float("inf"), "switch.oversubscription", ["ratio >= 1"]),
    ("switch.nodes_per_switch", -4, "switch.nodes_per_switch", ["positive integer"]),
    ("inter_node", DELETE, "switch", ["needs inter_node"]),
    ("compute", "fast", "compute", ["expected a mapping"]),
    ("fresh_memory", {"above": "32 MiB", "rate": 9}, "fresh_memory.rate", ["bare number 9"]),
    ("mpi.allreduce", [["2 KiB", "rign"], ["any", "rhd"]], "mpi.allreduce", ["'rign'", "'ring'"]),
    ("mpi.allreduce", [["2 KiB", "tree"]], "mpi.allreduce", ["last entry must be [any, ALG]"]),
    ("mpi.allreduce", [["any", "tree"], ["any", "rhd"]], "mpi.allreduce", ["must be the last"]),
    (
        "mpi.allreduce",
        [["4 KiB", "tree"], ["1 KiB", "ring"], ["any", "rhd"]],
        "mpi.allreduce",
        ["must ascend"],
    ),
    ("mpi.allreduce", [["2 Kb", "tree"], ["any", "rhd"]], "mpi.allreduce", ["expected a size"]),
    ("mpi.allreduce", [["tree"]], "mpi.allreduce", ["expected [SIZE, ALG]"]),
    ("mpi.alltoal", "pairwise", "mpi.alltoal", ["did you mean 'alltoall'?"]),
    ("unmeasured", ["inter_nod"], "unmeasured", ["'inter_nod'", "did you mean 'inter_node'?"]),
    ("unmeasured", "inter_node", "unmeasured", ["expected a list"]),
    ("calibration", [1], "calibration", ["expected a mapping"]),
    ("name", "", "name", ["non-empty string"]),
]


@pytest.mark.parametrize(
    "key,value,named,words", ERRORS, ids=[f"{e[0]}={e[1]!r}"[:50] for e in ERRORS]
)
def test_every_error_is_one_line_naming_file_and_key(tmp_path, key, value, named, words):
    path = write(tmp_path, mutate(key, value))
    with pytest.raises(MachineError) as e:
        load(path)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}: {named}: "), msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize(
    "text,words",
    [
        (None, ["cannot read", "No such file"]),
        ("nodes: [1, 2\n", ["not valid YAML", "line"]),
        ("- 1\n- 2\n", ["expected a mapping"]),
        ("", ["expected a mapping"]),
    ],
    ids=["missing", "not-yaml", "a-list", "empty"],
)
def test_file_level_errors(tmp_path, text, words):
    path = str(tmp_path / "m.yaml") if text is None else write(tmp_path, text)
    with pytest.raises(MachineError) as e:
        load(path)
    assert str(e.value).startswith(path + ": ") and "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_mpi_algorithm_names_are_what_the_predictor_prices():
    # every --allreduce algorithm of ours (not "mpi" itself) and every MPICH default
    assert set(ALLREDUCE_NAMES) - {"mpi"} <= set(mpi_algorithms("allreduce"))
    for kind, table in MPICH_DEFAULTS.items():
        if kind in MPI_KINDS:
            assert {alg for _, alg in table} <= set(mpi_algorithms(kind))


@pytest.mark.parametrize(
    "kind,alg", [("allgather", "bruck"), ("allreduce", "mpi"), ("bcast", "ring")]
)
def test_mpi_table_rejects_what_cannot_be_priced(tmp_path, kind, alg):
    path = write(tmp_path, copy.deepcopy(BASE) | {"mpi": {kind: alg}})
    with pytest.raises(MachineError) as e:
        load(path)
    assert str(e.value).startswith(f"{path}: mpi.{kind}: entry 1: no {kind} algorithm")


# -- overrides -----------------------------------------------------------------------------------


def test_overrides_apply_before_validation(tmp_path):
    path = write(tmp_path, BASE)
    m = load(
        path,
        [
            "inter_node.bandwidth=25 Gb/s",
            "switch.oversubscription=1",
            "mpi.allreduce=[[64 KiB, rd], [any, ring]]",
            "compute.device=null",
        ],
        ranks_per_node=8,
    )
    assert m.inter.bandwidth == 25e9 / 8 and m.oversubscription == 1.0
    assert m.mpi["allreduce"] == [(65536, "rd"), (ANY, "ring")]
    assert m.device_flops is None and m.ranks_per_node == 8
    # removing inter_node and switch: a one-node what-if
    one = load(path, ["inter_node=null", "switch="])
    assert one.inter is None and one.switch_nodes is None


@pytest.mark.parametrize(
    "overrides,rpn,named,words",
    [
        (["inter_node.bandwidth=25"], None, "--machine-set inter_node.bandwidth", ["bare number"]),
        (["inter_node.bandwith=25 Gb/s"], None, "--machine-set inter_node.bandwith", ["did you"]),
        (["intra_node.latency=10 GB/s"], None, "--machine-set intra_node.latency", ["time"]),
        (["inter_node=null"], None, "switch", ["needs inter_node"]),
        ([], 0, "--ranks-per-node", ["positive integer"]),
        (["intra_node.latency.x=1"], None, "--machine-set intra_node.latency.x", ["mapping"]),
        (["latency"], None, "--machine-set latency", ["expected KEY=VALUE"]),
    ],
)
def test_override_errors_name_the_option(tmp_path, overrides, rpn, named, words):
    path = write(tmp_path, BASE)
    with pytest.raises(MachineError) as e:
        load(path, overrides, ranks_per_node=rpn)
    msg = str(e.value)
    assert msg.startswith(f"{path}: {named}"), msg
    for w in words:
        assert w in msg


def test_override_creating_a_section_names_what_it_lacks(tmp_path):
    data = copy.deepcopy(BASE)
    del data["inter_node"], data["switch"]
    with pytest.raises(MachineError) as e:
        load(write(tmp_path, data), ["inter_node.bandwidth=25 Gb/s"])
    assert ": --machine-set inter_node.latency: missing" in str(e.value)


# -- presets and round trips ---------------------------------------------------------------------


def test_presets_are_there_and_load():
    names = {os.path.basename(p) for p in PRESETS}
    assert {"10gbe.yaml", "dgx-a100.yaml", "dgx-h100.yaml", "one-node.yaml"} <= names
    for path in PRESETS:
        m = load(path)
        assert m.reduce_bandwidth > 0 and m.intra.bandwidth > 0


def test_preset_figures():
    a100 = load(os.path.join(ROOT, "configs/machines/dgx-a100.yaml"))
    assert a100.ranks_per_node == 8 and a100.intra.bandwidth == 300e9
    assert a100.inter.bandwidth == 24e9 and a100.nic_bandwidth == 8 * 24e9
    assert a100.device_flops == 163e12  # achieved (Megatron-LM), not the 312 peak
    h100 = load(os.path.join(ROOT, "configs/machines/dgx-h100.yaml"))
    assert h100.intra.bandwidth == 450e9 and h100.nic_bandwidth == 8 * 48e9
    gbe = load(os.path.join(ROOT, "configs/machines/10gbe.yaml"))
    assert gbe.ranks_per_node == 1 and gbe.nic_bandwidth == 9.41e9 / 8
    assert gbe.mpi["allreduce"] == [(2048, "rd"), (ANY, "rhd")]
    one = load(os.path.join(ROOT, "configs/machines/one-node.yaml"))
    assert one.inter is None and "inter_node" in one.unmeasured


def same(a: Machine, b: Machine) -> bool:
    """Equal but for the source, floats to the 6 digits dump writes."""

    def close(x, y):
        if isinstance(x, float) and isinstance(y, float):
            return math.isclose(x, y, rel_tol=5e-6)
        if isinstance(x, Level) and isinstance(y, Level):
            return close(x.latency, y.latency) and close(x.bandwidth, y.bandwidth)
        return x == y

    return all(
        close(getattr(a, f.name), getattr(b, f.name))
        for f in dataclasses.fields(Machine)
        if f.name != "source"
    )


@pytest.mark.parametrize("path", PRESETS, ids=[os.path.basename(p) for p in PRESETS])
def test_presets_round_trip(tmp_path, path):
    m = load(path)
    out = str(tmp_path / "out.yaml")
    dump(m, out)
    assert same(load(out), m)


def test_dump_round_trips_odd_values_with_comments(tmp_path):
    m = Machine(
        name="odd: name # with yaml characters",
        source="",
        ranks_per_node=3,
        cores_per_node=5,
        intra=Level(1.2345678e-6, 2**30 * 3.3),
        inter=Level(2.2e-5, 1.17625e9),
        nic_bandwidth=7.123456789e9,
        switch_nodes=12,
        oversubscription=2.5,
        matmul_flops=123.456e9,
        memory_bandwidth=None,
        device_flops=None,
        reduce_bandwidth=3.21e9,
        mpi={"allreduce": [(2048, "rd"), (3 << 20, "ring"), (ANY, "rhd")]},
        unmeasured=("switch",),
        calibration={"points": [(8, 1.5e-6), (1024, 2e-6)], "fit": {"residual": 0.1}},
        oversub=Level(4.7e-4, 2.7e10),
        oversub_op_overhead=9e-6,
        oversub_wake=2.75e-4,
        oversub_mpi_latency=2.1e-3,
        wake=6.8e-5,
    )
    out = str(tmp_path / "m.yaml")
    comments = {"": "head line\nsecond line", "intra_node.latency": "measured " * 30}
    dump(m, out, comments)
    text = open(out).read()
    assert text.startswith("# head line\n# second line\n")
    assert all(len(line) <= 100 for line in text.splitlines())
    back = load(out)
    assert same(back, dataclasses.replace(m, calibration=back.calibration))
    assert back.calibration == {"points": [[8, 1.5e-6], [1024, 2e-6]], "fit": {"residual": 0.1}}
    assert back.mpi == m.mpi and dumps(back, comments) == text
    assert back.wake == 6.8e-5 and "  wake: 68 us" in text
    assert math.isclose(back.oversub_wake, 2.75e-4)
    assert math.isclose(back.oversub_mpi_latency, 2.1e-3)
    assert "  mpi_latency: 2.1 ms" in text


# -- the command-line options (on a bare parser: the proxies wire them in) ------------------------


def parser():
    p = cli.Parser(prog="t")
    cli.add_machine(p)
    return p


def test_cli_machine_loads_and_overrides():
    path = os.path.join(ROOT, "configs/machines/dgx-a100.yaml")
    args = parser().parse_args(
        [
            "--machine",
            path,
            "--ranks-per-node",
            "4",
            "--machine-set",
            "inter_node.bandwidth=100 Gb/s",
            "--machine-set",
            "compute.device=300 TFLOP/s",
        ]
    )
    m = cli.machine(args)
    assert m.ranks_per_node == 4 and m.inter.bandwidth == 12.5e9 and m.device_flops == 300e12
    assert cli.machine(parser().parse_args([])) is None


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--machine", "/no/such.yaml"], ["/no/such.yaml: cannot read"]),
        (["--machine-set", "a=b"], ["--machine-set goes with --machine"]),
        (["--ranks-per-node", "2"], ["--ranks-per-node goes with --machine"]),
        (["--machine", "{dgx}", "--machine-set", "intra_node.bandwidth=5"], ["bare number"]),
    ],
)
def test_cli_machine_errors_are_usage_errors(argv, words):
    dgx = os.path.join(ROOT, "configs/machines/dgx-a100.yaml")
    args = parser().parse_args([a.replace("{dgx}", dgx) for a in argv])
    with pytest.raises(cli.UsageError) as e:
        cli.machine(args)
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_cli_ranks_per_node_must_be_positive():
    with pytest.raises(cli.UsageError) as e:
        parser().parse_args(["--ranks-per-node", "0"])
    assert "--ranks-per-node" in str(e.value)
