"""Chakra execution traces of one iteration (`--chakra DIR`), written from the plan.

A plan is already what a trace-driven simulator (ASTRA-sim) wants: every rank's ordered
compute and communication, with sizes, peers and groups. This module encodes it as MLCommons
Chakra execution traces, one `<prefix>.<rank>.et` per rank (the name ASTRA-sim's
`--workload-configuration=<prefix>` opens for each NPU) and `comm_group.json`, the JSON
ASTRA-sim's `--comm-group-configuration` reads: {"<pg_name>": [world ranks]}.

What each node carries (attribute names and types as Chakra's PyTorch converter writes them):
- Compute: COMP_NODE, duration_micros (a dry run: the op's modelled time, its known seconds,
  else FLOPs at --device-tflops or the machine file's rate; a run: the op's measured time,
  the mean over the timed iterations, see `export_measured`), num_ops (int64 FLOPs),
  is_cpu_op false.
- A P2P batch: one COMM_SEND_NODE / COMM_RECV_NODE per message, comm_src, comm_dst,
  comm_tag, comm_size (int64 bytes), is_cpu_op false.
- A Collective: COMM_COLL_NODE, comm_type (Chakra's CollectiveCommType), comm_size (int64
  bytes of the whole array, the plan's nccl-tests convention), pg_name (a key of
  comm_group.json), is_cpu_op false.
- A Wait: a zero-duration COMP_NODE "wait <req>" (Chakra has no wait node).

Dependencies (data_deps) follow the plan's order: each op depends on the op(s) before it (all
messages of a P2P batch, which completes as one). A non-blocking collective depends on what
precedes it but nothing depends on it except its Wait, so the compute between the two
overlaps it in the simulator as it does in the run. Each collective also has a ctrl_dep on
the previous collective of its group: one communicator runs its collectives in issue order
(NCCL's one stream per communicator), and without it a simulator may start two ready
collectives of one group in different orders on different ranks.

mlc-chakra (the optional `chakra` extra) is imported lazily: without it `--chakra` is one
line and exit status 2 before any planning.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from proxies.core import cli
from proxies.core.plan import P2P, Collective, Compute, Plan, Wait

GROUP_FILE = "comm_group.json"
SCHEMA = "1.0.0"  # Chakra's GlobalMetadata version, as its generator writes

# Plan collective kinds -> Chakra CollectiveCommType names. alltoallv (sizes known at run time)
# is an all-to-all of what this rank sends.
COMM_TYPES = {
    "allreduce": "ALL_REDUCE",
    "allgather": "ALL_GATHER",
    "reduce_scatter": "REDUCE_SCATTER",
    "alltoall": "ALL_TO_ALL",
    "alltoallv": "ALL_TO_ALL",
    "bcast": "BROADCAST",
    "reduce": "REDUCE",
}


def load() -> Any:
    """Chakra's generated schema module (et_def_pb2); ImportError without mlc-chakra."""
    from chakra.schema.protobuf import et_def_pb2

    return et_def_pb2


def protolib() -> Any:
    """Chakra's own length-prefixed reader and writer (encodeMessage, decodeMessage)."""
    from chakra.src.third_party.utils import protolib as lib

    return lib


def check_option(directory: str | None) -> None:
    """--chakra DIR: the package importable and DIR creatable, or a UsageError (exit 2)."""
    if directory is None:
        return
    try:
        load()
        protolib()
    except ImportError as e:
        raise cli.UsageError(
            f"--chakra needs the mlc-chakra package ({e.name or e}): "
            "pip install 'mpi-dl-proxies[chakra]'"
        ) from None
    if not directory.strip():
        raise cli.UsageError("--chakra: empty path")
    full = os.path.realpath(directory)
    if os.path.exists(full) and not os.path.isdir(full):
        raise cli.UsageError(f"--chakra {directory}: exists and is not a directory")
    parent = full
    while not os.path.isdir(parent):  # the nearest existing ancestor must be writable
        parent = os.path.dirname(parent)
    if any(full == r or full.startswith(r + "/") for r in cli.SPECIAL_ROOTS):
        raise cli.UsageError(f"--chakra {directory}: not a place for results")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise cli.UsageError(f"--chakra {directory}: cannot write in {parent}")


def group_id(names: tuple[str, ...], world: int, name: str, members: tuple[int, ...]) -> str:
    """The pg_name of group `name` with these members: the same on every member, computed
    from the rank's own plan alone. (name, lowest member) identifies a communicator, as the
    runner's Split colour does."""
    return str(names.index(name) * world + min(members) + 1)


def _attr(pb, name: str, **value) -> Any:
    return pb.AttributeProto(name=name, **value)


# A node before encoding: (id, name, NodeType name, duration_micros, attributes as
# ((name, oneof field, value), ...), data_deps, ctrl_deps).
Record = tuple[int, str, str, int, tuple, list[int], list[int]]


def rank_records(
    plan: Plan, names: tuple[str, ...], world: int, seconds: Callable[[int, Compute], float]
) -> list[Record]:
    """The nodes of one rank's plan, ids 1.. in plan order (see the module doc).
    `seconds(i, op)`: the duration of compute op `op`, the plan's op number `i`."""
    out: list[Record] = []
    frontier: list[int] = []  # what the next op depends on
    pending: dict[str, list[int]] = {}  # req -> its non-blocking op's node ids
    last_coll: dict[str, int] = {}  # group -> id of its latest collective

    def node(name: str, kind: str, deps: list[int], attrs: tuple, us: int = 0, ctrl=()) -> int:
        out.append((len(out) + 1, name, kind, us, attrs, deps, list(ctrl)))
        return len(out)

    for k, op in enumerate(plan.ops):
        if isinstance(op, Compute):
            us = max(0, round(seconds(k, op) * 1e6))
            name = op.name + (f" mb {op.mb}" if op.mb >= 0 else "") + f" chunk {op.chunk}"
            attrs = (("num_ops", "int64_val", int(op.flops)),)
            frontier = [node(name, "COMP_NODE", frontier, attrs, us)]
        elif isinstance(op, P2P):
            ids = []
            for way, msgs in (("send", op.sends), ("recv", op.recvs)):
                for m in msgs:
                    src, dst = (plan.rank, m.peer) if way == "send" else (m.peer, plan.rank)
                    attrs = (
                        ("comm_src", "int64_val", src),
                        ("comm_dst", "int64_val", dst),
                        ("comm_tag", "int64_val", m.tag),
                        ("comm_size", "int64_val", m.nbytes),
                    )
                    name = f"{op.name}: {way} {m.buf} mb {m.mb}"
                    ids.append(node(name, f"COMM_{way.upper()}_NODE", frontier, attrs))
            if op.req:  # non-blocking: only its wait depends on its messages (overlap)
                pending[op.req] = ids
            else:
                frontier = ids or frontier
        elif isinstance(op, Collective):
            attrs = (
                ("comm_type", "int64_val", COMM_TYPES[op.kind]),
                ("comm_size", "int64_val", op.nbytes),
                ("pg_name", "string_val", group_id(names, world, op.group, plan.groups[op.group])),
            )
            name = f"{op.kind} {op.group} {op.buf}" + (f" mb {op.mb}" if op.mb >= 0 else "")
            prev = last_coll.get(op.group)
            ctrl = [prev] if prev is not None and prev not in frontier else []
            i = node(name, "COMM_COLL_NODE", frontier, attrs, ctrl=ctrl)
            last_coll[op.group] = i
            if op.req:
                pending[op.req] = [i]  # the next op does not wait for it: overlap
            else:
                frontier = [i]
        elif isinstance(op, Wait):
            started = pending.pop(op.req)
            frontier = [node(f"wait {op.req}", "COMP_NODE", [*frontier, *started], ())]
    return out


def encode(pb, records: Iterable[Record], cache: dict) -> Iterable[bytes]:
    """Each record as a serialized Node. What does not depend on the node's place (name,
    type, duration, attributes) is serialized once per distinct content and cached: two
    serialized parts of a message concatenated are the serialized message (protobuf merges
    them), so only id and dependencies are serialized per node."""
    for i, name, kind, us, attrs, deps, ctrl in records:
        key = (name, kind, us, attrs)
        body = cache.get(key)
        if body is None:
            n = pb.Node(name=name, type=pb.NodeType.Value(kind), duration_micros=us)
            n.attr.append(_attr(pb, "is_cpu_op", bool_val=False))
            for a, field, v in attrs:
                if a == "comm_type":
                    v = pb.CollectiveCommType.Value(v)
                n.attr.append(_attr(pb, a, **{field: v}))
            body = cache[key] = n.SerializeToString()
        yield pb.Node(id=i, data_deps=deps, ctrl_deps=ctrl).SerializeToString() + body


def groups_of(plan: Plan, names: tuple[str, ...], world: int) -> dict[str, list[int]]:
    """pg_name -> members of the groups this rank's collectives use."""
    used = {op.group for op in plan.ops if isinstance(op, Collective)}
    return {group_id(names, world, g, plan.groups[g]): list(plan.groups[g]) for g in used}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def write_rank(path: str, blobs: Iterable[bytes], meta: dict[str, str]) -> int:
    """One .et file: a GlobalMetadata, then the serialized nodes, each prefixed with its
    length as a varint (the framing of Chakra's protolib.encodeMessage, which its decoder
    and ASTRA-sim's feeder read). Returns the bytes written."""
    pb, lib = load(), protolib()
    gm = pb.GlobalMetadata(version=SCHEMA)
    gm.attr.extend(_attr(pb, k, string_val=v) for k, v in meta.items())
    with atomic(path, "wb") as f:
        lib.encodeMessage(f, gm)
        for b in blobs:
            f.write(_varint(len(b)))
            f.write(b)
        return f.tell()


@contextlib.contextmanager
def atomic(path: str, mode: str = "w"):
    """A file written under a temporary name and renamed onto `path` when complete: a
    reader (or a run killed half-way) never sees half a trace."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, mode) as f:
            yield f
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def export(
    job,
    directory: str,
    rate: float,
    ranks: Iterable[int] | None = None,
    measured: dict[int, list[float]] | None = None,
) -> dict:
    """Write every rank's trace (or those of `ranks`) and comm_group.json into `directory`.

    Durations: `measured[rank][i]`, the seconds of the rank's plan op number i, where given
    (a run), else the op's modelled time at `rate` FLOP/s. Returns a summary for the console
    and JSON.
    """
    pb = load()
    t0 = time.perf_counter()
    os.makedirs(directory, exist_ok=True)
    world = job.grid.size
    names = tuple(job.group_names)
    build = getattr(job.plan, "__wrapped__", job.plan)  # uncached: one plan in memory at a time
    prefix = os.path.join(directory, job.proxy)
    groups: dict[str, list[int]] = {}
    cache: dict = {}  # serialized node contents, shared by ranks running the same ops
    total = nodes_n = 0
    for r in range(world) if ranks is None else ranks:
        plan = build(r)
        if len(cache) > 200_000:  # point-to-point contents differ per rank: bound the memory
            cache.clear()
        times = (measured or {}).get(r)
        if times is not None and len(times) != len(plan.ops):  # not the plan the rank ran
            raise ValueError(f"rank {r}: {len(times)} measured ops, its plan has {len(plan.ops)}")

        def seconds(i: int, op: Compute, times=times) -> float:
            return op.model_seconds(rate) if times is None else times[i]

        records = rank_records(plan, names, world, seconds)
        meta = {"generator": f"proxies.{job.proxy}", "rank": str(r), "world_size": str(world)}
        total += write_rank(f"{prefix}.{r}.et", encode(pb, records, cache), meta)
        nodes_n += len(records)
        groups.update(groups_of(plan, names, world))
    ordered = {k: groups[k] for k in sorted(groups, key=int)}
    with atomic(os.path.join(directory, GROUP_FILE)) as f:  # a line per group
        f.write(
            "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in ordered.items())
        )
        f.write("\n}\n")
    return {
        "dir": directory,
        "prefix": prefix,
        "files": world if ranks is None else len(list(ranks)),
        "nodes": nodes_n,
        "bytes": total,
        "groups": len(ordered),
        "durations": "modelled" if measured is None else "measured",
        "seconds": time.perf_counter() - t0,
    }


def write_measured(job, args, measured: list[list[float]]) -> dict | None:
    """A run's traces (rank 0, after the timed iterations): `measured[rank][i]`, the mean
    seconds of that rank's plan op number i over the timed iterations, as the compute nodes'
    durations. Gathered to rank 0 and written there, as --json and --trace are: nothing
    assumes the ranks share a file system, at the cost of rank 0 rebuilding every rank's
    plan (a second per thousand ranks or so). The summary for the JSON, printed unless
    --quiet; None when the folder could not be written (said on stderr, the caller exits
    non-zero; the run's other results are still written)."""
    try:
        s = export(job, args.chakra, args.device_tflops * 1e12, measured=dict(enumerate(measured)))
    except OSError as e:
        print(f"{job.prog}: --chakra {args.chakra}: {e.strerror or e}", file=sys.stderr, flush=True)
        return None
    s |= {"statistic": "mean", "iterations": args.iters}
    if not args.quiet:
        from proxies.core import report

        report.console().print(summary_line(s))
    return s


def summary_line(s: dict) -> str:
    measured = " with measured compute times" if s.get("durations") == "measured" else ""
    return (
        f"chakra: {s['files']:,} traces{measured} ({s['nodes']:,} nodes, "
        f"{s['bytes'] / 2**20:.1f} MiB) and "
        f"{GROUP_FILE} ({s['groups']:,} group{'s' if s['groups'] != 1 else ''}) in {s['dir']} "
        f"in {s['seconds']:.1f} s; ASTRA-sim: "
        f"--workload-configuration={s['prefix']} "
        f"--comm-group-configuration={os.path.join(s['dir'], GROUP_FILE)}"
    )
