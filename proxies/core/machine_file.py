"""Writing machine files: a Machine as the YAML mapping `machine.load` reads back, and as
text with comments above its keys (calibrate's output)."""

from __future__ import annotations

import json
import os
import textwrap

import yaml

from proxies.core.machine import ANY, Level, Machine
from proxies.core.units import format_quantity

__all__ = ["dump", "dumps", "to_mapping"]


def _level(level: Level) -> dict:
    """A level's latency and bandwidth, as text with units."""
    return {
        "latency": format_quantity(level.latency, "time"),
        "bandwidth": format_quantity(level.bandwidth, "bandwidth"),
    }


def to_mapping(m: Machine) -> dict:
    """The YAML mapping of a Machine, figures as text with units (load reads it back)."""
    q = format_quantity
    out: dict = {"name": m.name}
    out["nodes"] = {"ranks_per_node": m.ranks_per_node, "cores_per_node": m.cores_per_node}
    out["intra_node"] = _level(m.intra)
    if m.node_bandwidth is not None:
        out["intra_node"]["node_bandwidth"] = q(m.node_bandwidth, "bandwidth")
    if m.inter is not None:
        out["inter_node"] = _level(m.inter)
        if m.nic_bandwidth is not None:
            out["inter_node"]["nic_bandwidth"] = q(m.nic_bandwidth, "bandwidth")
    if m.switch_nodes is not None:
        out["switch"] = {
            "nodes_per_switch": m.switch_nodes,
            "oversubscription": float(m.oversubscription),
        }
    compute = {
        "matmul": (m.matmul_flops, "rate"),
        "memory": (m.memory_bandwidth, "bandwidth"),
        "device": (m.device_flops, "rate"),
        "reduce": (m.reduce_bandwidth, "bandwidth"),
    }
    out["compute"] = {k: q(v, kind) for k, (v, kind) in compute.items() if v is not None}
    if m.oversub is not None:
        over = _level(m.oversub)
        if m.oversub_node_bandwidth is not None:
            over["node_bandwidth"] = q(m.oversub_node_bandwidth, "bandwidth")
        if m.oversub_op_overhead is not None:
            over["op_overhead"] = q(m.oversub_op_overhead, "time")
        if m.oversub_wake is not None:
            over["wake"] = q(m.oversub_wake, "time")
        if m.oversub_mpi_latency is not None:
            over["mpi_latency"] = q(m.oversub_mpi_latency, "time")
        if m.oversub_unexpected is not None:
            over["unexpected"] = float(m.oversub_unexpected)
        out["oversubscribed"] = over
    if m.fresh_above is not None and m.fault_rate is not None:
        out["fresh_memory"] = {
            "above": q(m.fresh_above, "count"),
            "rate": q(m.fault_rate, "bandwidth"),
        }
    if m.reuse_cache is not None and m.reread is not None:
        out["reuse"] = {"cache": q(m.reuse_cache, "count"), "reread": float(m.reread)}
    if m.zero_page_alltoall is not None:
        out["zero_pages"] = {"alltoall": float(m.zero_page_alltoall)}
    engine = {}
    if m.op_overhead:
        engine["op_overhead"] = q(m.op_overhead, "time")
    if m.wake:
        engine["wake"] = q(m.wake, "time")
    for kind, seconds in m.op_overheads.items():
        engine[kind] = q(seconds, "time")
    if engine:
        out["engine"] = engine
    if m.cold_moved:
        cold = {"moved": q(m.cold_moved, "count"), "engine": q(m.cold_engine, "time")}
        if m.cold_latency:  # optional; a time is positive
            cold["latency"] = q(m.cold_latency, "time")
        out["cold"] = {**cold, "exponent": float(m.cold_exponent)}
    if m.mpi:
        out["mpi"] = {
            kind: [["any" if s == ANY else q(s, "count"), alg] for s, alg in rows]
            for kind, rows in m.mpi.items()
        }
    if m.unmeasured:
        out["unmeasured"] = list(m.unmeasured)
    if m.calibration:
        out["calibration"] = _plain(m.calibration)
    return out


def _plain(obj: object) -> object:
    """Tuples -> lists, NumPy scalars -> Python numbers: what yaml.safe_dump accepts."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):
        return obj.item()
    return obj


def _scalar(value: object) -> str:
    if isinstance(value, str):
        plain = yaml.safe_dump(value, default_flow_style=True).split("\n")[0]
        return plain if plain == value else json.dumps(value)
    if isinstance(value, list):  # mpi rows and unmeasured: one line each
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    return str(value)


def _comment(text: str, indent: str) -> list[str]:
    lines: list[str] = []
    for para in text.splitlines():
        lines += textwrap.wrap(para, 96 - len(indent), break_on_hyphens=False) or [""]
    return [f"{indent}# {line}".rstrip() for line in lines]


def dumps(m: Machine, comments: dict[str, str] | None = None) -> str:
    """The file's text; comments[dotted key] goes above that key ("" heads the file)."""
    comments = comments or {}
    lines = _comment(comments[""], "") if comments.get("") else []
    for top, value in to_mapping(m).items():
        lines += _comment(comments[top], "") if top in comments else []
        if top == "calibration":
            body = yaml.safe_dump(value, default_flow_style=None, sort_keys=False, width=96)
            lines += ["calibration:", *("  " + line for line in body.rstrip().splitlines())]
        elif isinstance(value, dict):
            lines.append(f"{top}:")
            for k, v in value.items():
                key = f"{top}.{k}"
                lines += _comment(comments[key], "  ") if key in comments else []
                lines.append(f"  {k}: {_scalar(v)}")
        else:
            lines.append(f"{top}: {_scalar(value)}")
    return "\n".join(lines) + "\n"


def dump(m: Machine, path: str, comments: dict[str, str] | None = None) -> None:
    """Write `m` as a machine file, atomically (a reader never sees half a file)."""
    text = dumps(m, comments)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
