"""Check a folder of Chakra execution traces for the mistakes that break simulators.

    python -m proxies.core.chakra_check DIR [--prefix NAME]

Reads every `<prefix>.<rank>.et` with Chakra's own decoder and `comm_group.json`, and reports
(exit status 4, one line each) what ASTRA-sim users hit with hand-made or converted traces:
- a communication node whose comm_size is missing or not an int64 (int32 overflows at 2 GiB),
  or whose is_cpu_op is not false (ASTRA-sim refuses communication on the CPU);
- node ids repeated in a file, a dependency on an id not in the file, a dependency cycle;
- a send without its receive (or the reverse): per (source, destination, tag), the sizes
  in order must be the same on both sides;
- a collective group whose members disagree: the same sequence of (type, size) on every
  member of the group comm_group.json lists, and only its members using it.
No problems: exit 0. A folder without traces: exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict
from collections.abc import Sequence

from proxies.core import chakra, exits

COMM = ("COMM_SEND_NODE", "COMM_RECV_NODE", "COMM_COLL_NODE")


def read_trace(path: str) -> tuple[object, list]:
    """(GlobalMetadata, [Node]) of one .et file, with Chakra's decoder."""
    pb, lib = chakra.load(), chakra.protolib()
    with open(path, "rb") as f:
        meta = pb.GlobalMetadata()
        lib.decodeMessage(f, meta)
        nodes = []
        while True:
            n = pb.Node()
            if not lib.decodeMessage(f, n):
                return meta, nodes
            nodes.append(n)


def traces(directory: str, prefix: str | None = None) -> dict[int, str]:
    """rank -> path of every `<prefix>.<rank>.et` in `directory` (prefix: the only one)."""
    found: dict[str, dict[int, str]] = defaultdict(dict)
    for name in os.listdir(directory):
        m = re.fullmatch(r"(.+)\.(\d+)\.et", name)
        if m:
            found[m.group(1)][int(m.group(2))] = os.path.join(directory, name)
    if prefix is None and len(found) == 1:
        prefix = next(iter(found))
    return found.get(prefix or "", {})


def attrs(node) -> dict:
    """name -> AttributeProto."""
    return {a.name: a for a in node.attr}


def value(a):
    return getattr(a, a.WhichOneof("value")) if a.WhichOneof("value") else None


def check_file(rank: int, nodes: Sequence) -> list[str]:
    """Problems within one rank's trace."""
    pb = chakra.load()
    where = f"rank {rank}"
    out: list[str] = []
    ids = [n.id for n in nodes]
    seen: set[int] = set()
    for i in ids:
        if i in seen:
            out.append(f"{where}: node id {i} appears twice")
        seen.add(i)
    for n in nodes:
        kind = pb.NodeType.Name(n.type)
        for d in [*n.data_deps, *n.ctrl_deps]:
            if d not in seen:
                out.append(f"{where}: node {n.id} depends on {d}, not in the file")
        if kind not in COMM:
            continue
        a = attrs(n)
        cpu = a.get("is_cpu_op")
        if cpu is None or cpu.WhichOneof("value") != "bool_val" or cpu.bool_val:
            out.append(f"{where}: {kind} {n.id}: is_cpu_op must be the bool false")
        size = a.get("comm_size")
        if size is None or size.WhichOneof("value") != "int64_val" or size.int64_val < 0:
            got = "missing" if size is None else size.WhichOneof("value")
            out.append(f"{where}: {kind} {n.id}: comm_size must be a non-negative int64 ({got})")
        if kind == "COMM_COLL_NODE" and ("comm_type" not in a or "pg_name" not in a):
            out.append(f"{where}: COMM_COLL_NODE {n.id}: needs comm_type and pg_name")
        if kind != "COMM_COLL_NODE":
            need = ("comm_src", "comm_dst", "comm_tag")
            if any(k not in a for k in need):
                out.append(f"{where}: {kind} {n.id}: needs {', '.join(need)}")
            elif value(a["comm_src" if kind == "COMM_SEND_NODE" else "comm_dst"]) != rank:
                out.append(f"{where}: {kind} {n.id}: this rank is not its own side")
    out += cycles(where, nodes)
    return out


def cycles(where: str, nodes: Sequence) -> list[str]:
    """A dependency cycle, as one problem (Kahn's algorithm: what never becomes free)."""
    ids = {n.id for n in nodes}
    deps = {n.id: {d for d in [*n.data_deps, *n.ctrl_deps] if d in ids} for n in nodes}
    users: dict[int, list[int]] = defaultdict(list)
    for i, ds in deps.items():
        for d in ds:
            users[d].append(i)
    left = {i: len(ds) for i, ds in deps.items()}
    free = [i for i, k in left.items() if k == 0]
    done = 0
    while free:
        i = free.pop()
        done += 1
        for u in users[i]:
            left[u] -= 1
            if left[u] == 0:
                free.append(u)
    if done < len(deps):
        stuck = sorted(i for i, k in left.items() if k > 0)
        return [f"{where}: dependency cycle through nodes {stuck[:5]}"]
    return []


def check(directory: str, prefix: str | None = None) -> list[str]:
    """Every problem of the traces in `directory` (empty: valid). FileNotFoundError when
    there are none."""
    pb = chakra.load()
    paths = traces(directory, prefix)
    if not paths:
        raise FileNotFoundError(f"{directory}: no <prefix>.<rank>.et traces")
    gpath = os.path.join(directory, chakra.GROUP_FILE)
    groups: dict[str, list[int]] = {}
    if os.path.exists(gpath):
        with open(gpath) as f:
            groups = json.load(f)
    problems: list[str] = []
    missing = sorted(set(range(max(paths) + 1)) - set(paths))
    if missing:
        problems.append(f"ranks without a trace: {missing[:10]}")
    p2p: dict[str, dict[tuple, list[int]]] = {"send": defaultdict(list), "recv": defaultdict(list)}
    colls: dict[str, dict[int, list[tuple]]] = defaultdict(dict)
    for rank, path in sorted(paths.items()):
        _, nodes = read_trace(path)
        problems += check_file(rank, nodes)
        for n in nodes:
            a = attrs(n)
            if n.type in (pb.COMM_SEND_NODE, pb.COMM_RECV_NODE):
                if not all(k in a for k in ("comm_src", "comm_dst", "comm_tag", "comm_size")):
                    continue
                key = tuple(value(a[k]) for k in ("comm_src", "comm_dst", "comm_tag"))
                side = "send" if n.type == pb.COMM_SEND_NODE else "recv"
                p2p[side][key].append(value(a["comm_size"]))
            elif n.type == pb.COMM_COLL_NODE and "pg_name" in a:
                seq = colls[a["pg_name"].string_val].setdefault(rank, [])
                seq.append((value(a.get("comm_type")), value(a.get("comm_size"))))
    for key in sorted(set(p2p["send"]) | set(p2p["recv"])):
        s, r = p2p["send"].get(key, []), p2p["recv"].get(key, [])
        if s != r:
            src, dst, tag = key
            problems.append(
                f"messages {src} -> {dst} tag {tag}: sent sizes {s[:4]}, received {r[:4]}"
            )
    for pg, by_rank in sorted(colls.items()):
        members = groups.get(pg)
        if members is None:
            problems.append(
                f"group {pg}: used by ranks {sorted(by_rank)[:8]}, not in {chakra.GROUP_FILE}"
            )
            continue
        outside = sorted(set(by_rank) - set(members))
        if outside:
            problems.append(f"group {pg}: used by ranks {outside[:8]} outside it")
        first = by_rank.get(members[0], [])
        for m in members:
            if m in paths and by_rank.get(m, []) != first:
                problems.append(
                    f"group {pg}: rank {m}'s collectives (type, bytes) differ from rank "
                    f"{members[0]}'s: {by_rank.get(m, [])[:3]} vs {first[:3]}"
                )
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m proxies.core.chakra_check", description=__doc__)
    p.add_argument("dir", help="the folder --chakra wrote")
    p.add_argument("--prefix", help="trace name prefix (default: the only one in DIR)")
    args = p.parse_args(argv)
    if not os.path.isdir(args.dir):
        print(
            f"{p.prog}: {args.dir}: no such directory (the folder --chakra wrote)", file=sys.stderr
        )
        return exits.USAGE
    try:
        chakra.check_option(args.dir)
        problems = check(args.dir, args.prefix)
    except (FileNotFoundError, NotADirectoryError) as e:
        print(f"{p.prog}: {e}", file=sys.stderr)
        return exits.USAGE
    except chakra.cli.UsageError as e:
        print(f"{p.prog}: {e}", file=sys.stderr)
        return exits.USAGE
    for line in problems:
        print(line)
    n = len(traces(args.dir, args.prefix))
    print(f"{n} traces: " + (f"{len(problems)} problems" if problems else "valid"))
    return exits.CHECK if problems else exits.OK


if __name__ == "__main__":
    sys.exit(main())
