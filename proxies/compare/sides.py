"""What `compare` reads: one proxy result JSON (from --json), or a sweep's results
directory (results.jsonl, or the per-point JSON files of --print-commands runs), as points
with their per-iteration samples; and which config keys change the work."""

from __future__ import annotations

import json
import os
import re

from proxies.core.report import ordered
from proxies.registry import report_categories
from proxies.sweep import results

# Every proxy's category labels: results carry no job to ask.
TABLE = report_categories()

# Config keys that change how the same work is done or measured, not the work itself:
# comparing them is the point of a comparison (MPI's allreduce against our ring, spin
# against yield). Every other key (model, sizes, layout, batch, compute mode, dtypes,
# --check, ...) changes what is computed or sent: runs that differ there are refused.
HOW_KEYS = frozenset(
    {
        "iters",
        "warmup",
        "seed",
        "lr",
        "weight_decay",
        "momentum",
        "data",
        "wait",
        "progress",
        "timeout",
        "allreduce",
        "grad_sync",
        "bucket_mb",
    }
)

# A --print-commands point file: runner.tag(index, point) + ".json"; the part after the
# index names the point's identity (proxy, ranks, a hash of args and repeat).
POINT_FILE = re.compile(r"^\d{4,}-(?P<ident>[A-Za-z0-9_]+-\d+r-[0-9a-f]{8})\.json$")
MAX_FILE = 256 << 20  # bytes of one result JSON: larger is not one of ours


class SideError(Exception):
    """A or B cannot be compared: one line, the path first."""


def read_result(path: str) -> dict:
    """A measured proxy result from its --json file; SideError naming what is wrong."""
    try:
        if os.path.getsize(path) > MAX_FILE:
            raise SideError(f"{path}: larger than {MAX_FILE >> 20} MiB: not a result JSON")
        with open(path, "rb") as f:
            res = json.loads(f.read().decode("utf-8"))
    except OSError as e:
        raise SideError(f"{path}: cannot read: {e.strerror}") from None
    except (ValueError, RecursionError):
        raise SideError(f"{path}: not a JSON file") from None
    if not isinstance(res, dict) or not isinstance(res.get("proxy"), str):
        raise SideError(f'{path}: not a proxy result JSON (no "proxy"; write one with --json)')
    if res.get("iter_time_s") is None and res.get("predicted_iter_time_s") is not None:
        raise SideError(
            f"{path}: a prediction without a measurement (a --dry-run): nothing to compare"
        )
    why = results.result_problem(res, False)
    if why is not None:
        raise SideError(f"{path}: not a proxy result JSON: {why}")
    if not isinstance(res.get("config", {}), dict):
        raise SideError(f"{path}: not a proxy result JSON: config is not an object")
    return res


def point(result: dict, name: str) -> dict:
    """A point of a side: its name, config and samples (iterations of all its repeats)."""
    return {
        "name": name,
        "proxy": result["proxy"],
        "world_size": result.get("world_size"),
        "config": result.get("config", {}),
        "mpi": (result.get("mpi") or {}).get("library", ""),
        "iter_time_s": list(result["iter_time_s"]),
        "breakdown_s": {c: list(v) for c, v in result.get("breakdown_s", {}).items()},
    }


def pool(into: dict, result: dict) -> None:
    """A repeat of the same point: its iterations join the samples."""
    into["iter_time_s"] += result["iter_time_s"]
    n_before = len(into["iter_time_s"]) - len(result["iter_time_s"])
    bd = result.get("breakdown_s", {})
    for c in ordered(set(into["breakdown_s"]) | set(bd), TABLE):
        # a category one repeat lacks took no time in it
        old = into["breakdown_s"].get(c, [0.0] * n_before)
        into["breakdown_s"][c] = old + list(bd.get(c, [0.0] * len(result["iter_time_s"])))


def load(path: str) -> tuple[str, dict[str, dict]]:
    """("file" or "sweep", {point key: point}). A file is one point keyed "run"."""
    if os.path.isfile(path):
        return "file", {"run": point(read_result(path), os.path.basename(path))}
    if not os.path.isdir(path):
        raise SideError(f"{path}: no such file or directory")
    jsonl = os.path.join(path, results.FILE)
    if os.path.isfile(jsonl):
        return "sweep", sweep_points(jsonl)
    files = sorted(f for f in os.listdir(path) if POINT_FILE.match(f))
    if files:
        out = {}
        for f in files:
            res = read_result(os.path.join(path, f))
            out[POINT_FILE.match(f)["ident"]] = point(res, f)
        return "sweep", out
    raise SideError(
        f"{path}: no {results.FILE} and no per-point JSON files: not a sweep's results directory"
    )


def sweep_points(jsonl: str) -> dict[str, dict]:
    """Measured ok points of a results.jsonl, keyed by identity (proxy, ranks, args; the
    repeats of a point pooled)."""
    try:
        records = results.load(jsonl)
    except results.ResultsError as e:
        raise SideError(str(e)) from None
    out: dict[str, dict] = {}
    for rec in results.latest(records).values():
        p = rec["point"]
        if rec["status"] != "ok" or p.get("predicted"):
            continue
        key = json.dumps(
            {"proxy": p["proxy"], "ranks": p["ranks"], "args": p["args"]}, sort_keys=True
        )
        if key in out:
            pool(out[key], rec["result"])
        else:
            words = " ".join(f"{k}={v}" for k, v in p["args"].items())
            out[key] = point(rec["result"], f"{p['label']} · {p['ranks']} ranks · {words}")
    if not out:
        raise SideError(f"{jsonl}: no measured point that finished ok")
    return out


def work_differences(a: dict, b: dict) -> list[str]:
    """The keys (proxy, world size, config keys outside HOW_KEYS) whose values differ."""
    diff = []
    if a["proxy"] != b["proxy"]:
        diff.append("proxy")
    if a["world_size"] != b["world_size"]:
        diff.append("world_size")
    ca, cb = a["config"], b["config"]
    for k in dict.fromkeys([*ca, *cb]):
        if k not in HOW_KEYS and ca.get(k) != cb.get(k):
            diff.append(k)
    return diff


def how_differences(a: dict, b: dict) -> list[str]:
    """What differs that does not change the work (shown, never refused)."""
    ca, cb = a["config"], b["config"]
    out = [f"{k}: {ca.get(k)} -> {cb.get(k)}" for k in sorted(HOW_KEYS) if ca.get(k) != cb.get(k)]
    if a["mpi"] != b["mpi"]:
        out.append(f"MPI: {a['mpi'] or '?'} -> {b['mpi'] or '?'}")
    return out
