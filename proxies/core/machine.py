"""Machine models: one YAML file describing a cluster, on which the predictor prices plans.

    name: 10 GbE cluster
    nodes: {ranks_per_node: 1, cores_per_node: 16}
    intra_node: {latency: 0.5 us, bandwidth: 10 GB/s}       # each rank's port, each way
    inter_node: {latency: 15 us, bandwidth: 10 Gb/s, nic_bandwidth: 10 Gb/s}   # optional
    switch: {nodes_per_switch: 32, oversubscription: 2}     # optional
    compute: {matmul: 100 GFLOP/s, memory: 10 GB/s, device: 150 TFLOP/s, reduce: 5 GB/s}
    mpi: {allreduce: [[2 KiB, tree], [any, rhd]]}           # optional
    oversubscribed: {latency: 300 us, bandwidth: 10 GB/s, node_bandwidth: 8 GB/s,
                     op_overhead: 400 us, wake: 1 ms,
                     mpi_latency: 3 ms, unexpected: 1}       # optional: ranks > cores
    fresh_memory: {above: 32 MiB, rate: 4 GB/s}              # optional: MPI temporaries
    reuse: {cache: 16 MiB, reread: 1.3}                      # optional: reused buffers
    zero_pages: {alltoall: 0.55}                             # optional: untouched sends
    engine: {op_overhead: 20 us, wake: 70 us,                # optional
             compute: 1 us, exchange: 5 us, collective: 4 us, nonblocking: 8 us}
    cold: {moved: 64 MiB, engine: 60 us, latency: 30 us, exponent: 1}   # optional
    unmeasured: [inter_node]                                 # optional (calibrate)
    calibration: {...}                                       # optional (calibrate)

`oversubscribed` holds what a node does when its ranks outnumber its cores (a message waits
for its peer to be scheduled, waits sleep and wake late, copies share cores): the predictor
uses it instead of intra_node's latency and bandwidth, node_bandwidth and the engine's
op_overhead only when a run places more ranks on a node than cores_per_node, so a cluster
file (never oversubscribed) is unaffected. `fresh_memory`: MPI's temporary buffers above
`above` bytes are fresh mappings (glibc's mmap threshold) faulted in on every call at
`rate` bytes/s; the predictor charges that on the reductions of MPI's own collectives.
`reuse`: a collective MPI runs itself on a buffer its rank used again within `cache` bytes
(the distinct bytes of the rank's buffers touched since; its share of the caches) costs
`reread` x per byte moved, added and copied, over the price of the cold buffers the other
figures were measured on (calibrate sets it so the model's 1 MiB MPI allreduce on two
ranks takes what it measured on the buffer the previous one wrote: 0.8 to 1.9 on the VM
this was developed on, whose caches made that call 1.3 to 2.8 x a cold one's). The
predictor applies it where the proxy says which buffers its runtime reuses (compute none
and model); with real compute the kernels' own traffic passes through the caches between.
`zero_pages.alltoall`: MPI's all-to-all from a send buffer never written (every page the
kernel's one zero page: reading it moves no memory) costs this x per byte moved and copied
of the cold buffer's price; the proxies' all-to-all send buffers are such without real
compute and --check (calibrate measures the ratio: 0.5 - 0.6 at 16 - 64 MiB on 2 ranks of
the VM this was developed on).
`engine.op_overhead`: the engine's own cost per plan op (Python, mpi4py, polling: finding
and staging an op's buffers, what the watchdog is told, the work between ops), booked as
the measured run books it (`overhead`); `engine.compute`, `.exchange` (a blocking
point-to-point batch), `.collective` (a blocking collective) and `.nonblocking` (a
non-blocking op's start, and its Wait, each) replace it for their kind of op where given
(calibrate measures each: a non-blocking op's start and Wait hand the interpreter to and
from the progress thread, several times what a computing op costs).
`cold`: after a communication op that touched B bytes on its rank (read and written: twice
what it sent and received; plan_touched in proxies.core.predict_caches) the interpreter's,
mpi4py's and MPI's code and data are out of the caches. Every op up to and including the
next communication op (a non-blocking op's bytes count at its Wait, which pays them) costs
the engine `engine` x min(1, B / moved) ** exponent more (overhead), and a blocking
exchange's or collective's MPI calls `latency` x the same (booked to the op). Not on a
crowded node (oversubscribed.op_overhead holds it all there). Calibrate measures both
after bulk exchanges (proxies.calibrate.caches): on the VM this was developed on, 2 ranks,
+34 .. +50 us of the engine's own time and +9 .. +25 us in MPI after 64 MiB.
`engine.wake`: how much longer than asked a sleep lasts (the kernel's timer slack and the
wake-up): a modelled or replayed compute op's, and a yielding
wait's between its tests (waiting.py), both of which the predictor follows;
`oversubscribed.wake` replaces it for the waits of runs that crowd a node (a woken rank
also waits for a core). `oversubscribed.mpi_latency`: on a crowded node, the latency of each
message of a collective the MPI library runs itself (its non-blocking schedule advances
only inside the waits' tests: ms per step where our point-to-point programs take 100s of us).
`oversubscribed.unexpected`: on a crowded node, the tests of a yielding wait that each
message arriving for an op its rank has not posted yet takes from the collectives MPI runs
for that rank (MPICH takes in one arrival per test: 1; a library that takes in all of them
at once: about 0; left out: 0).

Every figure carries its unit (proxies.core.units). `load` validates everything and raises
MachineError "<file>: <key>: <what is wrong>" (one line); `cli.machine` turns it into a
usage error (exit 2). Overrides "dotted.key=value" (--machine-set) are applied to the YAML
mapping before validation, so they are checked the same way, and errors name them.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import yaml

from proxies.core.units import parse_quantity

__all__ = ["Level", "Machine", "MachineError", "load", "parse_quantity"]


class MachineError(Exception):
    """A bad machine file or override; str(e) is one line: '<file>: <key>: <what>'."""


@dataclass(frozen=True)
class Level:
    latency: float  # seconds per message (Hockney alpha)
    bandwidth: float  # bytes/s one flow can reach on this level's link (each direction)


@dataclass(frozen=True)
class Machine:
    name: str
    source: str  # file path it was read from ("" if built in code)
    ranks_per_node: int  # default placement: ranks k*R .. k*R+R-1 form node k
    cores_per_node: int  # ranks beyond this share cores: compute slows by R / cores
    intra: Level  # between two ranks of one node; bandwidth is each rank's port
    inter: Level | None  # between nodes; None for a one-node machine
    nic_bandwidth: float | None  # bytes/s of each node's interface(s), each direction, shared
    switch_nodes: int | None  # nodes per leaf switch (None: one non-blocking switch)
    oversubscription: float  # leaf uplink = switch_nodes * nic_bandwidth / this (1.0 = none)
    matmul_flops: float | None  # FLOP/s per rank of the real NumPy kernels (compute=real)
    memory_bandwidth: float | None  # bytes/s per rank, read + written, memory-bound kernels
    device_flops: float | None  # FLOP/s per rank for compute=model
    reduce_bandwidth: float  # bytes/s per rank at which a reduction adds received data
    # per collective kind: [(up_to_bytes, alg), ...] ascending, the last up_to = ANY;
    # a message of s bytes runs the first alg whose up_to >= s. {} = MPICH's defaults apply.
    mpi: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    unmeasured: tuple[str, ...] = ()  # figures calibrate could not measure
    calibration: dict = field(default_factory=dict)  # what calibrate measured (fits, residuals)
    # bytes/s all of a node's intra-node flows together can reach (CPU nodes: what the
    # cores can copy at once); None: no such limit (a non-blocking switch such as NVSwitch)
    node_bandwidth: float | None = None
    # ranks outnumbering cores (None: never measured; then the figures above serve)
    oversub: Level | None = None  # a message's latency and one flow's bandwidth
    oversub_node_bandwidth: float | None = None  # a node's flows together
    oversub_op_overhead: float | None = None  # the engine's cost per op
    oversub_wake: float | None = None  # a yielding wait's sleep lasts this much longer
    oversub_mpi_latency: float | None = None  # a message of a collective MPI runs itself
    # tests of a yielding wait an unexpected message takes (None: none)
    oversub_unexpected: float | None = None
    # MPI's temporaries above fresh_above bytes are faulted in at fault_rate bytes/s
    fresh_above: int | None = None
    fault_rate: float | None = None
    # a collective MPI runs on a buffer reused within reuse_cache bytes costs reread x per byte
    reuse_cache: int | None = None
    reread: float | None = None
    # MPI's all-to-all from a never-written (zero-page) send buffer costs this x per byte
    zero_page_alltoall: float | None = None
    op_overhead: float = 0.0  # seconds: the engine's own cost per plan op
    # per kind of op (OVERHEAD_KINDS) where measured, else op_overhead
    op_overheads: dict[str, float] = field(default_factory=dict)
    wake: float = 0.0  # seconds a sleep (slept compute, a yielding wait's) lasts longer
    # an op after its rank moved B bytes costs the engine cold_engine x min(1, B /
    # cold_moved) ** cold_exponent more, its blocking MPI calls cold_latency x that
    cold_moved: int | None = None
    cold_engine: float = 0.0
    cold_latency: float = 0.0
    cold_exponent: float = 1.0

    def node_of(self, rank: int) -> int:
        """The node of `rank` under the default placement (consecutive blocks)."""
        return rank // self.ranks_per_node


ANY = 2**63  # "and above" in mpi thresholds
MPI_KINDS = ("allreduce", "allgather", "reduce_scatter", "alltoall", "bcast", "reduce")


def mpi_algorithms(kind: str) -> tuple[str, ...]:
    """The algorithm names an `mpi:` entry of `kind` may give: those the predictor has a
    program for (proxies.core.collectives.steps), so a table it cannot price fails here, naming
    the file and key, not late inside a prediction."""
    from proxies.core.collectives.steps import algorithms

    return algorithms(kind)


# section -> {key: kind}; kind is a units kind, "int" (positive integer), "ratio" (>= 1) or
# "factor" (a plain number > 0), "number" (a plain number >= 0)
SECTIONS: dict[str, dict[str, str]] = {
    "nodes": {"ranks_per_node": "int", "cores_per_node": "int"},
    "intra_node": {"latency": "time", "bandwidth": "bandwidth", "node_bandwidth": "bandwidth"},
    "inter_node": {"latency": "time", "bandwidth": "bandwidth", "nic_bandwidth": "bandwidth"},
    "switch": {"nodes_per_switch": "int", "oversubscription": "ratio"},
    "compute": {"matmul": "rate", "memory": "bandwidth", "device": "rate", "reduce": "bandwidth"},
    "oversubscribed": {
        "latency": "time",
        "bandwidth": "bandwidth",
        "node_bandwidth": "bandwidth",
        "op_overhead": "time",
        "wake": "time",
        "mpi_latency": "time",
        "unexpected": "number",
    },
    "fresh_memory": {"above": "count", "rate": "bandwidth"},
    "reuse": {"cache": "count", "reread": "factor"},
    "zero_pages": {"alltoall": "factor"},
    "engine": {
        "op_overhead": "time",
        "wake": "time",
        "compute": "time",
        "exchange": "time",
        "collective": "time",
        "nonblocking": "time",
    },
    "cold": {"moved": "count", "engine": "time", "latency": "time", "exponent": "factor"},
}
# the kinds of plan op whose engine cost a machine file may give apart (engine.<kind>)
OVERHEAD_KINDS = ("compute", "exchange", "collective", "nonblocking")
REQUIRED_SECTIONS = ("nodes", "intra_node", "compute")
OPTIONAL = {
    "intra_node.node_bandwidth",
    "switch.oversubscription",
    "compute.matmul",
    "compute.memory",
    "compute.device",
    "oversubscribed.node_bandwidth",
    "oversubscribed.op_overhead",
    "oversubscribed.wake",
    "oversubscribed.mpi_latency",
    "oversubscribed.unexpected",
    "engine.op_overhead",
    "engine.wake",
    *(f"engine.{kind}" for kind in OVERHEAD_KINDS),
    "cold.latency",
}
TOP_KEYS = ("name", *SECTIONS, "mpi", "unmeasured", "calibration")
FIGURES = tuple(f"{s}.{k}" for s, keys in SECTIONS.items() for k in keys)


def _nearest(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else f"known: {', '.join(choices)}"


class _Checker:
    """Validation state: the file name for messages, and which keys came from where."""

    def __init__(self, path: str, overridden: Sequence[str], rpn_key: str | None):
        self.path, self.overridden, self.rpn_key = path, tuple(overridden), rpn_key

    def label(self, key: str) -> str:
        if key == self.rpn_key:
            return "--ranks-per-node"
        if any(key == k or key.startswith(k + ".") for k in self.overridden):
            return f"--machine-set {key}"
        return key

    def fail(self, key: str, what: str):
        where = f"{self.path}: {self.label(key)}: " if key else f"{self.path}: "
        raise MachineError(where + what)

    def mapping(self, value: object, key: str, known: Sequence[str]) -> dict:
        if not isinstance(value, dict):
            self.fail(key, f"expected a mapping with keys {', '.join(known)}, got {value!r}")
        for k in value:
            if k not in known:
                sub = f"{key}.{k}" if key else str(k)
                self.fail(sub, f"unknown key ({_nearest(str(k), known)})")
        return value

    def figure(self, name: str, section: dict, key: str, kind: str) -> float | int | None:
        full = f"{name}.{key}"
        value = section.get(key)
        if value is None:
            if full in OPTIONAL:
                return None
            self.fail(full, f"missing: a required figure ({_KIND_WORDS[kind]})")
        if kind == "int":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                self.fail(full, f"expected a positive integer, got {value!r}")
            return value
        if kind == "ratio":
            if isinstance(value, str) and value.strip().endswith(":1"):  # "2:1"
                value = value.strip()[:-2].strip()
                try:
                    value = float(value)
                except ValueError:
                    pass
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or value < 1:
                self.fail(full, f"expected a ratio >= 1 like 2 or '2:1' (1 = none), got {value!r}")
            return float(value)
        if kind == "factor":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or value <= 0:
                self.fail(full, f"expected a plain number > 0 like 1.5 (1 = none), got {value!r}")
            return float(value)
        if kind == "number":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or value < 0:
                self.fail(full, f"expected a plain number >= 0 like 1 (0 = none), got {value!r}")
            return float(value)
        try:
            return parse_quantity(value, kind)
        except ValueError as e:
            self.fail(full, str(e))


_KIND_WORDS = {
    "int": "a positive integer",
    "ratio": "a ratio >= 1",
    "factor": "a plain number > 0",
    "number": "a plain number >= 0",
    "time": "a time like '15 us'",
    "bandwidth": "a bandwidth like '10 Gb/s' or '25 GB/s'",
    "rate": "a rate like '150 TFLOP/s'",
    "count": "a size like '32 MiB'",
}


def _mpi_table(c: _Checker, value: object) -> dict[str, list[tuple[int, str]]]:
    table = c.mapping(value, "mpi", MPI_KINDS)
    out: dict[str, list[tuple[int, str]]] = {}
    for kind, rows in table.items():
        key = f"mpi.{kind}"
        if isinstance(rows, str):  # one algorithm at every size
            rows = [["any", rows]]
        if not isinstance(rows, list) or not rows:
            c.fail(key, f"expected [[SIZE, ALG], ..., [any, ALG]] or one ALG, got {rows!r}")
        entries: list[tuple[int, str]] = []
        for i, row in enumerate(rows, 1):
            if not (isinstance(row, list) and len(row) == 2):
                c.fail(key, f"entry {i}: expected [SIZE, ALG] like [2 KiB, tree], got {row!r}")
            size, alg = row
            known = mpi_algorithms(kind)
            if alg not in known:
                close = difflib.get_close_matches(str(alg), known, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                c.fail(
                    key,
                    f"entry {i}: no {kind} algorithm {alg!r} ({hint}choose from "
                    f"{', '.join(known)})",
                )
            if size == "any":
                if i != len(rows):
                    c.fail(key, f"entry {i}: 'any' (and above) must be the last entry")
                entries.append((ANY, alg))
                continue
            try:
                up_to = int(parse_quantity(size, "count"))
            except ValueError as e:
                c.fail(key, f"entry {i}: {e} or 'any'")
            if entries and up_to <= entries[-1][0]:
                c.fail(key, f"entry {i}: sizes must ascend, {size!r} follows {rows[i - 2][0]!r}")
            entries.append((up_to, alg))
        if entries[-1][0] != ANY:
            c.fail(key, "the last entry must be [any, ALG] (the algorithm above every size)")
        out[kind] = entries
    return out


def from_mapping(
    data: object,
    path: str = "<machine>",
    overridden: Sequence[str] = (),
    ranks_per_node_key: str | None = None,
) -> Machine:
    """Validate a parsed machine file (see the module docstring) into a Machine."""
    c = _Checker(path, overridden, ranks_per_node_key)
    if not isinstance(data, dict):
        c.fail("", f"expected a mapping with keys {', '.join(TOP_KEYS)}, got {type(data).__name__}")
    c.mapping(data, "", TOP_KEYS)
    for s in REQUIRED_SECTIONS:
        if data.get(s) is None:
            c.fail(s, f"missing: a required section with {', '.join(SECTIONS[s])}")
    fig: dict[str, float | int | None] = {}
    for s, keys in SECTIONS.items():
        if data.get(s) is None:
            continue
        section = c.mapping(data[s], s, list(keys))
        for k, kind in keys.items():
            fig[f"{s}.{k}"] = c.figure(s, section, k, kind)
    if data.get("switch") is not None and data.get("inter_node") is None:
        c.fail("switch", "a switch needs inter_node (a machine without it is one node)")

    name = data.get("name", os.path.splitext(os.path.basename(path))[0])
    if not isinstance(name, str) or not name.strip():
        c.fail("name", f"expected a non-empty string, got {name!r}")
    mpi = _mpi_table(c, data["mpi"]) if data.get("mpi") is not None else {}
    unmeasured = data.get("unmeasured") or []
    if not isinstance(unmeasured, list) or not all(isinstance(u, str) for u in unmeasured):
        c.fail("unmeasured", f"expected a list of keys like [inter_node], got {unmeasured!r}")
    for u in unmeasured:
        if u not in SECTIONS and u not in FIGURES:
            c.fail("unmeasured", f"unknown key {u!r} ({_nearest(u, [*SECTIONS, *FIGURES])})")
    calibration = data.get("calibration") or {}
    if not isinstance(calibration, dict):
        c.fail("calibration", f"expected a mapping, got {calibration!r}")

    has_inter = data.get("inter_node") is not None
    has_over = data.get("oversubscribed") is not None
    return Machine(
        name=name.strip(),
        source=path,
        ranks_per_node=int(fig["nodes.ranks_per_node"]),
        cores_per_node=int(fig["nodes.cores_per_node"]),
        intra=Level(fig["intra_node.latency"], fig["intra_node.bandwidth"]),
        inter=Level(fig["inter_node.latency"], fig["inter_node.bandwidth"]) if has_inter else None,
        nic_bandwidth=fig.get("inter_node.nic_bandwidth"),
        switch_nodes=fig.get("switch.nodes_per_switch"),
        oversubscription=fig.get("switch.oversubscription") or 1.0,
        matmul_flops=fig["compute.matmul"],
        memory_bandwidth=fig["compute.memory"],
        device_flops=fig["compute.device"],
        reduce_bandwidth=fig["compute.reduce"],
        mpi=mpi,
        unmeasured=tuple(unmeasured),
        calibration=calibration,
        node_bandwidth=fig.get("intra_node.node_bandwidth"),
        oversub=Level(fig["oversubscribed.latency"], fig["oversubscribed.bandwidth"])
        if has_over
        else None,
        oversub_node_bandwidth=fig.get("oversubscribed.node_bandwidth"),
        oversub_op_overhead=fig.get("oversubscribed.op_overhead"),
        oversub_wake=fig.get("oversubscribed.wake"),
        oversub_mpi_latency=fig.get("oversubscribed.mpi_latency"),
        oversub_unexpected=fig.get("oversubscribed.unexpected"),
        fresh_above=int(fig["fresh_memory.above"]) if fig.get("fresh_memory.above") else None,
        fault_rate=fig.get("fresh_memory.rate"),
        reuse_cache=int(fig["reuse.cache"]) if fig.get("reuse.cache") else None,
        reread=fig.get("reuse.reread"),
        zero_page_alltoall=fig.get("zero_pages.alltoall"),
        op_overhead=fig.get("engine.op_overhead") or 0.0,
        op_overheads={k: fig[f"engine.{k}"] for k in OVERHEAD_KINDS if fig.get(f"engine.{k}")},
        wake=fig.get("engine.wake") or 0.0,
        cold_moved=int(fig["cold.moved"]) if fig.get("cold.moved") else None,
        cold_engine=fig.get("cold.engine") or 0.0,
        cold_latency=fig.get("cold.latency") or 0.0,
        cold_exponent=fig.get("cold.exponent") or 1.0,
    )


def apply_override(data: dict, text: str, path: str) -> list[str]:
    """Apply one "dotted.key=value" to the raw mapping; return the key and the sections it
    created (errors inside them name the override). The value is read as YAML ('25 Gb/s'
    stays text, 4 is a number, [..] a list); null or empty removes the key."""
    key, sep, value = text.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or not all(parts):
        raise MachineError(
            f"{path}: --machine-set {text}: expected KEY=VALUE, e.g. 'inter_node.bandwidth=25 Gb/s'"
        )
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value.strip()
    node, keys = data, [key]
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
            keys.append(".".join(parts[: i + 1]))
        elif not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise MachineError(f"{path}: --machine-set {key}: {where} is not a mapping")
        node = child
    if parsed is None:
        node.pop(parts[-1], None)
    else:
        node[parts[-1]] = parsed
    return keys


def read(path: str) -> object:
    """The parsed YAML of a machine file (MachineError if unreadable or not YAML)."""
    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except OSError as e:
        raise MachineError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise MachineError(f"{path}: {where}not valid YAML: {problem}") from None


def load(path: str, overrides: Sequence[str] = (), ranks_per_node: int | None = None) -> Machine:
    """Read, override (--machine-set KEY=VALUE, --ranks-per-node) and validate a file."""
    data = read(path)
    if not isinstance(data, dict):
        return from_mapping(data, path)  # raises: not a mapping
    keys = [k for text in overrides for k in apply_override(data, text, path)]
    rpn_key = None
    if ranks_per_node is not None:
        nodes = data.setdefault("nodes", {})
        if not isinstance(nodes, dict):
            raise MachineError(f"{path}: nodes: expected a mapping, got {nodes!r}")
        nodes["ranks_per_node"] = ranks_per_node
        rpn_key = "nodes.ranks_per_node"
    return from_mapping(data, path, keys, rpn_key)
