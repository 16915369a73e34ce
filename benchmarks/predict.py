"""Predicted vs measured, for every proxy: each point runs for real with --machine FILE and the
predictor's iteration is set beside the measured one.

    python benchmarks/predict.py                          # calibrate, then ranks 2 and 4
    python benchmarks/predict.py --machine configs/machines/one-node.yaml --ranks 2
    python benchmarks/predict.py --quick                  # tiny presets: checks the pipeline

Without --machine (or with --calibrate) it first runs
`mpiexec -n <largest rank count> python -m proxies calibrate -o <tmp>/machine.yaml` and predicts
with that file. Then for every proxy x rank count x compute mode it runs

    mpiexec -n R python -m proxies.PROXY ARGS --compute MODE --iters 5 --warmup 2 \\
        --machine FILE --json OUT

(2 warm-ups, 5 timed iterations, each under --timeout) --launches times (3 unless --quick)
and reads the measured (`iter_time_s`, `breakdown_s`) and predicted (`predicted_iter_time_s`,
`predicted_breakdown_s`) fields of OUT. Modes:

- `none`: communication only;
- `model`: compute slept at FLOPs / --device-tflops. With `--tflops auto` (the default) the
  rate is chosen so that the busiest rank's compute equals the measured `none` iteration of
  the same point, i.e. compute is about half of the iteration: rate = (compute seconds the
  predictor gives that rank at 1 TFLOP/s, from a --dry-run) / (measured `none` iteration).

The configurations (small, seconds each on 2 cores; R even):

- gpt2: GPT-2 124M widths (C=768, V=50257), 2 layers, 2 pipeline stages x R/2 data
  parallel, 4 micro-batches of 1 x 32 tokens: pipeline sends, the tied-embedding allreduce
  (V x C) between the stages, the data-parallel gradient allreduce when R > 2;
- gpt3: gpt3-medium widths, 2 layers (R/2 when more), tensor parallel 2 x R/2 pipeline
  stages, 4 micro-batches of 1 x 512 tokens: TP allreduces of B*T*C per layer, the
  vocabulary-parallel embedding and loss, pipeline sends when R > 2;
- cosmoflow: the MLPerf model (128^3 x 4 volume, conv 32..512), 1x2 spatial shards x R/2
  replicas, 4 samples per replica: halos, the dense layers' allgather / reduce-scatter, the
  conv and dense gradient allreduces (non-blocking, overlapping the backward);
- dlrm: the C++ proxy's DLRM (4 tables x 80,000 x 128), global batch 32768, table-wise: the
  embedding all-to-alls forward and backward, the MLP gradient allreduces.

The table: measured iteration (the median over launches of each launch's median of the timed
iterations, each the slowest rank's), predicted, their relative error, the launches' spread
((slowest - fastest launch) / measured: how far the measurement itself repeats), and among
the categories that take at least 10% of the measured iteration (mean over ranks, median over
iterations and launches; overlapped `_hidden` time excluded, it is not part of the
iteration) the one the prediction misses most. --details
adds every category. --restate predicts each point in the state the probe finds just before
it (the file's `reuse.reread` and `compute.memory` from that probe), the rest of the file as
calibrated.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's proxies (machine files), as the runs use (cwd ROOT)
PROXIES = ("gpt2", "gpt3", "cosmoflow", "dlrm")
MODES = ("none", "model")
MAX_RANKS = 1 << 16  # every point runs on this machine
SHARE = 0.10  # categories under this share of the iteration are not judged
# Timed iterations per point and warm-ups before them. The first iteration after one
# warm-up still pays one-time costs (MPI's heap growing to its temporaries: cosmoflow's
# 2-rank point 10 ms, then 6.3), which a steady-state prediction does not include.
ITERS, WARMUP = 5, 2
# Launches per point: one launch's iterations agree within a few %, separate launches of the
# same point on this VM differ by up to 50% (cosmoflow 2 ranks none: 5.1 to 7.6 ms in seven
# launches in a row); the median launch is the point's measurement.
LAUNCHES = 3
# --per-state: at most this many machine files (a state seen only during its own calibration
# would otherwise be calibrated again and again)
MAX_CALIBRATIONS = 4
# a point ran in the machine's calibrated state when every state figure its probes measured
# before and after it is within this factor of the calibrated one (this VM's states differ
# by 2x: a same-buffer allreduce x1.3 or x2.6 a cold one's, copies at 22 or 44 GB/s)
STATE_BAND = 1.4


def mpiexec() -> str:
    found = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if not found:
        sys.exit("predict: mpiexec not found (activate the venv)")
    return found


@dataclass
class Point:
    proxy: str
    config: str  # a short description for the table
    args: list[str]  # the proxy's arguments, without mode, iterations, machine or json
    ranks: int
    mode: str = "none"
    tflops: float | None = None  # --device-tflops, for mode model
    extra: list[str] = field(default_factory=list)  # placement options (--ranks-per-node)


def configs(proxy: str, ranks: int, quick: bool = False) -> tuple[str, list[str]]:
    """The (description, arguments) of one proxy at R ranks (R even)."""
    half = ranks // 2
    if proxy == "gpt2":
        model, t = ("gpt2-tiny", 16) if quick else ("gpt2", 32)
        return (
            f"{model} T={t}, 2 layers, pp 2 x dp {half}",
            ["2", "2", "4", "--model", model, "--seq-len", str(t)],
        )
    if proxy == "gpt3":
        model, t = ("gpt3-tiny", 16) if quick else ("gpt3-medium", 512)
        layers = max(2, half)  # at least one layer per stage
        return (
            f"{model} T={t}, {layers} layers, tp 2 x pp {half}",
            [str(layers), str(half), "--model", model, "--tp", "2", "--seq-len", str(t),
             "--micro-batches", "4"],
        )  # fmt: skip
    if proxy == "cosmoflow":
        model, per = ("cosmoflow-tiny", 1) if quick else ("cosmoflow", 4)
        return (
            f"{model}, 1x2 shards x dp {half}, {per} samples per replica",
            ["--model", model, "--shards", "1x2", "--global-batch", str(per * half)],
        )
    if proxy == "dlrm":
        model, batch = ("dlrm-tiny", 64) if quick else ("dnn-cpp-proxies", 32768)
        # dlrm-tiny has fewer tables than 4 ranks may need: row-wise works at any size
        sharding = "row" if quick else "table"
        return (
            f"{model} B={batch}, {sharding}-wise",
            ["--model", model, "--batch", str(batch), "--sharding", sharding],
        )
    raise ValueError(proxy)


def mode_args(point: Point) -> list[str]:
    if point.mode == "none":
        return ["--compute", "none"]
    out = ["--compute", "model", "--device-tflops", f"{point.tflops:.6g}"]
    # FLOPs / --device-tflops rather than the C++ proxy's A100 times, so the rate sets compute
    if point.proxy == "cosmoflow":
        out += ["--layer-times", "flops"]
    if point.proxy == "dlrm":
        out += ["--model-times", "flops"]
    return out


def command(
    point: Point, machine: str, json_path: str, iters: int, warmup: int, sets: Sequence[str] = ()
) -> list[str]:
    """The point's run; `sets`: --machine-set KEY=VALUE overrides of the file."""
    overrides = [x for kv in sets for x in ("--machine-set", kv)]
    return [
        mpiexec(), "-n", str(point.ranks), sys.executable, "-m", f"proxies.{point.proxy}",
        *point.args, *mode_args(point), "--iters", str(iters), "--warmup", str(warmup),
        "--machine", machine, *overrides, *point.extra, "--quiet", "--json", json_path,
    ]  # fmt: skip


def execute(cmd: list[str], timeout: float):
    """Run a command in its own process group, killed whole on timeout. Returns an object with
    returncode, stdout, stderr (as tests/launch.run); raises TimeoutError."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise TimeoutError(f"timed out after {timeout:g} s") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:160] if lines else "no output"


def compare(results: dict | list[dict]) -> dict:
    """The row's numbers from a proxy's --json results with --machine, one per launch of the
    same point (one prediction: the first's): the median launch of the launches' medians."""
    results = [results] if isinstance(results, dict) else results
    launches = [statistics.median(r["iter_time_s"]) for r in results]
    measured = statistics.median(launches)
    result = results[0]
    predicted = result["predicted_iter_time_s"]
    pred_cats = result.get("predicted_breakdown_s", {})
    cats = {}
    for c in dict.fromkeys(c for r in results for c in r["breakdown_s"]):
        m = statistics.median(
            statistics.median(r["breakdown_s"][c]) if c in r["breakdown_s"] else 0.0
            for r in results
        )
        p = pred_cats.get(c, 0.0)  # a category the predictor has no figure for: it predicts 0
        cats[c] = {
            "measured_s": m,
            "predicted_s": p,
            "share": m / measured if measured else 0.0,
            "error_pct": 100 * (p - m) / m if m else None,
        }
    judged = [
        (c, v)
        for c, v in cats.items()
        if not c.endswith("_hidden") and v["share"] >= SHARE and v["error_pct"] is not None
    ]
    worst = max(judged, key=lambda cv: abs(cv[1]["error_pct"]), default=None)
    return {
        "measured_s": measured,
        "measured_iters_s": [t for r in results for t in r["iter_time_s"]],
        "measured_launches_s": launches,
        "spread_pct": 100 * (max(launches) - min(launches)) / measured if measured else 0.0,
        "predicted_s": predicted,
        "error_pct": 100 * (predicted - measured) / measured,
        "worst_category": worst[0] if worst else None,
        "worst_category_error_pct": worst[1]["error_pct"] if worst else None,
        "categories": cats,
        "prediction": result.get("prediction", ""),
        "mpi": result.get("mpi", {}).get("library", ""),
        "wait": result.get("config", {}).get("wait", ""),
    }


def run_point(
    point: Point,
    machine: str,
    *,
    timeout: float = 120,
    iters: int = 3,
    warmup: int = 1,
    run: Callable = execute,
    probe: Callable[[], dict | None] | None = None,
    restate: Restate | None = None,
    launches: int = 1,
    pick: Callable[[dict | None], tuple[str, int, dict | None]] | None = None,
) -> dict:
    """Run one point with --machine and --json, `launches` times in a row; the row: the
    point, status ("ok", or why it failed), and when ok the measured, predicted and error
    fields (see compare). `probe` (e.g. state_probe): the machine's state figures just
    before the first launch and just after the last, kept as the row's "state" [before,
    after]. `pick` (with probe, e.g. Calibrations.pick): the machine file for the state the
    probe before found, as (file, its number, its calibrated state), kept as the row's
    "calibration" and "calibrated_state". `restate` (with probe, see `restated`): the
    point is predicted with reuse.reread = the probe's same-buffer time before it over the
    file's cold price of that call, and compute.memory scaled by the probe's copy rate over
    the calibration's, kept as the row's "restated_reread" and "restated_memory"."""
    row = {
        "proxy": point.proxy,
        "config": point.config,
        "ranks": point.ranks,
        "mode": point.mode,
        "tflops": point.tflops,
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        before = probe() if probe else None
        if pick:
            machine, row["calibration"], row["calibrated_state"] = pick(before)
        sets = []
        if restate and before and before.get("same_s"):
            row["restated_reread"] = float(f"{before['same_s'] / restate.cold_s:.4g}")
            sets.append(f"reuse.reread={row['restated_reread']}")
        if restate and restate.copy and before and before.get("copy"):
            row["restated_memory"] = float(f"{restate.memory * before['copy'] / restate.copy:.4g}")
            sets.append(f"compute.memory={row['restated_memory'] / 1e9:.4g} GB/s")
        cmd = command(point, machine, out, iters, warmup, sets)
        row["command"] = " ".join(["mpiexec", *cmd[1:3], "python", *cmd[4:-2]])
        results = []
        for k in range(launches):
            which = f"launch {k + 1} of {launches}: " if launches > 1 else ""
            try:
                r = run(cmd, timeout=timeout)
            except (TimeoutError, AssertionError) as e:  # AssertionError: tests/launch.run's
                row["status"] = f"failed: {which}{str(e).splitlines()[0]}"
                return row | {"wall_s": time.perf_counter() - t0}
            if r.returncode:
                row["wall_s"] = time.perf_counter() - t0
                last = last_line(r.stderr or r.stdout)
                row["status"] = f"failed: {which}exit {r.returncode}: {last}"
                return row
            try:
                with open(out) as f:
                    results.append(json.load(f))
                os.remove(out)
            except (OSError, ValueError) as e:
                row["wall_s"] = time.perf_counter() - t0
                row["status"] = f"failed: {which}no result ({type(e).__name__}: {e})"
                return row
        row["wall_s"] = time.perf_counter() - t0
        if probe:
            row["state"] = [before, probe()]
        try:
            row |= compare(results)
        except (ValueError, KeyError, statistics.StatisticsError) as e:
            row["status"] = f"failed: no prediction in the result ({type(e).__name__}: {e})"
            return row
    row["status"] = "ok"
    return row


def compute_at_one_tflops(point: Point, machine: str, timeout: float = 120) -> float:
    """Seconds of compute of the busiest rank at 1 TFLOP/s, from the predictor's dry run."""
    model = Point(point.proxy, point.config, point.args, point.ranks, "model", 1.0, point.extra)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "dry.json")
        cmd = [
            sys.executable, "-m", f"proxies.{point.proxy}", *point.args, *mode_args(model),
            "--dry-run", "--world-size", str(point.ranks), "--machine", machine,
            *point.extra, "--json", out,
        ]  # fmt: skip
        r = execute(cmd, timeout)
        if r.returncode:
            raise RuntimeError(last_line(r.stderr or r.stdout))
        with open(out) as f:
            return json.load(f)["predicted_breakdown_max_s"]["compute"]


def calibrate(ranks: int, path: str, quick: bool, timeout: float) -> None:
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "proxies", "calibrate", "-o", path]
    cmd += ["--quick"] if quick else []
    print(f"# mpiexec -n {ranks} python -m proxies calibrate -o {path}" + " --quick" * quick)
    try:
        r = execute(cmd, timeout)
    except TimeoutError as e:
        sys.exit(f"predict: calibrate {e}")
    if r.returncode:
        sys.exit(f"predict: calibrate failed: {last_line(r.stderr or r.stdout)}")


class Calibrations:
    """--per-state: one machine file per state of the machine the probes find, calibrated
    when a point's probe finds a state no file so far was calibrated in (a state figure
    beyond `band` of every file's calibrated one); each point is predicted with the file of
    the nearest state to the one it starts in. `first`: the file calibrated (or given)
    before the points; `run`: calibrate(ranks, path, quick, timeout)."""

    def __init__(
        self,
        first: str,
        ranks: int,
        folder: str,
        quick: bool = False,
        timeout: float = 120,
        band: float = STATE_BAND,
        run: Callable | None = None,
    ):
        from proxies.calibrate.probe import calibrated_state

        self.ranks, self.folder, self.quick, self.timeout = ranks, folder, quick, timeout
        self.band, self.run = band, run or calibrate
        self.files = [(first, calibrated_state(first))]

    def pick(self, now: dict | None) -> tuple[str, int, dict | None]:
        from proxies.calibrate.probe import calibrated_state
        from proxies.calibrate.state import worst_drift

        far = []
        for k, (_, state) in enumerate(self.files):
            w = worst_drift(now, state) if now and state else None
            if w is None:  # no figures to compare: the first file
                return self._file(0)
            far.append((w[1], k))
        nearest, k = min(far)
        if nearest <= self.band or len(self.files) >= MAX_CALIBRATIONS:
            return self._file(k)
        path = os.path.join(self.folder, f"machine-{len(self.files) + 1}.yaml")
        self.run(self.ranks, path, self.quick, self.timeout)
        self.files.append((path, calibrated_state(path)))
        print(f"# file {len(self.files)}: {machine_summary(path)[0]}", flush=True)
        return self._file(len(self.files) - 1)

    def _file(self, k: int) -> tuple[str, int, dict | None]:
        return self.files[k][0], k + 1, self.files[k][1]


@dataclass(frozen=True)
class Restate:
    """What --restate needs of the machine file: the predicted seconds of the state's cold
    allreduce (calibration.reuse), which the probe's same-buffer time is divided by; the
    copy rate the calibration's state measured and the file's compute.memory, which is
    scaled by the probe's copy rate over that (None: no copy rate recorded)."""

    cold_s: float
    copy: float | None
    memory: float


def restated(machine: str) -> Restate:
    """The file's figures --restate works from; a one-line error where it has none."""
    from proxies.core.machine import load

    m = load(machine)
    cold = (m.calibration.get("reuse") or {}).get("predicted_cold_s")
    if not isinstance(cold, (int, float)) or cold <= 0:
        raise ValueError(
            f"--restate: {machine} has no calibration.reuse.predicted_cold_s (calibrate again)"
        )
    copy = (m.calibration.get("state") or {}).get("copy")
    ok = isinstance(copy, (int, float)) and copy > 0 and m.memory_bandwidth
    return Restate(float(cold), float(copy) if ok else None, float(m.memory_bandwidth or 0))


def state_probe(timeout: float = 30) -> dict | None:
    """The machine's state figures now (python -m proxies.calibrate.probe on 2 ranks: a cold
    and a same-buffer 1 MiB allreduce, a copy's rate), None if it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "probe.json")
        cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "proxies.calibrate.probe", "--json", out]
        try:
            if execute(cmd, timeout).returncode:
                return None
            with open(out) as f:
                return json.load(f)
        except (TimeoutError, OSError, ValueError):
            return None


def drift(row: dict, calibrated: dict | None) -> float | None:
    """How far the row's machine state was from the calibrated one (the row's own
    "calibrated_state" with --per-state, else `calibrated`): the largest factor (>= 1) of any
    state figure, before or after the run (None: unknown)."""
    from proxies.calibrate.state import worst_drift

    got = row.get("state")
    calibrated = row.get("calibrated_state", calibrated)
    if calibrated is None or not got or None in got:
        return None
    worst = [worst_drift(d, calibrated) for d in got]
    return None if None in worst else max(w[1] for w in worst)


def steady(row: dict, calibrated: dict | None, band: float = STATE_BAND) -> bool | None:
    """Whether the row ran in the state the machine file was calibrated in: every state
    figure before and after within a factor `band` of the calibrated one (None: unknown)."""
    d = drift(row, calibrated)
    return None if d is None else d <= band


def machine_summary(path: str) -> tuple[str, list[str]]:
    """A line of the machine file's key figures, and the placement options every point needs:
    a one-node file (no inter_node) puts all of a point's ranks on that node, as here."""
    from proxies.core import machine as machines

    m = machines.load(path)
    g = 1e9
    parts = [
        f"{m.name}: {m.ranks_per_node} ranks/node, {m.cores_per_node} cores/node",
        f"intra {m.intra.latency * 1e6:.3g} us, {m.intra.bandwidth / g:.3g} GB/s"
        + (f" (node {m.node_bandwidth / g:.3g} GB/s)" if m.node_bandwidth else ""),
    ]
    if m.inter is not None:
        parts.append(f"inter {m.inter.latency * 1e6:.3g} us, {m.inter.bandwidth / g:.3g} GB/s")
    parts.append(f"reduce {m.reduce_bandwidth / g:.3g} GB/s")
    if m.matmul_flops:
        parts.append(f"matmul {m.matmul_flops / g:.3g} GFLOP/s")
    if m.mpi:
        parts.append(
            "mpi "
            + "; ".join(
                f"{k} " + ", ".join(f"{a} to {s}" if s < 2**63 else f"{a} above" for s, a in v)
                for k, v in sorted(m.mpi.items())
            )
        )
    if m.oversub is not None:
        from proxies.calibrate.describe import oversubscribed_text

        parts.append(f"oversubscribed {oversubscribed_text(m)}")
    if m.fresh_above is not None:
        parts.append(f"fresh above {m.fresh_above >> 20} MiB at {m.fault_rate / g:.3g} GB/s")
    if m.zero_page_alltoall is not None:
        parts.append(f"all-to-all from zero pages x{m.zero_page_alltoall:.3g}")
    if isinstance(m.calibration.get("state"), dict):
        from proxies.calibrate.describe import state_text

        parts.append(f"state: {state_text(m.calibration['state'])}")
    if m.op_overhead or m.wake:
        kinds = "".join(f", {k} {v * 1e6:.3g}" for k, v in m.op_overheads.items())
        parts.append(
            f"engine {m.op_overhead * 1e6:.3g} us/op{kinds}, sleeps {m.wake * 1e6:.3g} us late"
        )
    if m.cold_moved:
        parts.append(
            f"cold after {m.cold_moved >> 20} MiB: engine +{m.cold_engine * 1e6:.3g} us, "
            f"MPI +{m.cold_latency * 1e6:.3g} us, ^{m.cold_exponent:.3g}"
        )
    return " · ".join(parts), m.inter is None


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.0f}%"


def print_table(rows: list[dict], target: float, calibrated: dict | None = None) -> None:
    head = ("proxy", "config", "ranks", "mode", "measured", "predicted", "error", "spread")
    w = max([len(r["config"]) for r in rows] + [6])
    print(
        f"{head[0]:<9} {head[1]:<{w}} {head[2]:>5} {head[3]:<15} {head[4]:>9} "
        f"{head[5]:>9} {head[6]:>7} {head[7]:>6}  worst >=10%"
    )
    for r in rows:
        mode = r["mode"] + (
            f" {r['tflops']:.3g} TF" if r["mode"] == "model" and r["tflops"] else ""
        )
        lead = f"{r['proxy']:<9} {r['config']:<{w}} {r['ranks']:>5} {mode:<15}"
        if r["status"] != "ok":
            print(f"{lead} {r['status']}")
            continue
        worst = (
            f"{r['worst_category']} {pct(r['worst_category_error_pct'])}"
            if r["worst_category"]
            else "-"
        )
        miss = "  *" if abs(r["error_pct"]) > target else ""
        d = drift(r, calibrated)
        state = "" if d is None else f"  drift x{d:.2g}" + (" ~" if d > STATE_BAND else "")
        state += f"  file {r['calibration']}" if "calibration" in r else ""
        several = len(r.get("measured_launches_s", ())) > 1  # one launch: no spread
        spread = f"{r['spread_pct']:.0f}%" if several else "-"
        print(
            f"{lead} {r['measured_s']:8.4f}s {r['predicted_s']:8.4f}s "
            f"{pct(r['error_pct']):>7} {spread:>6}  {worst}{miss}{state}"
        )
    ok = [r for r in rows if r["status"] == "ok"]
    within = sum(abs(r["error_pct"]) <= target for r in ok)
    line = f"# within {target:g}%: {within} of {len(ok)}"
    known = [r for r in ok if steady(r, calibrated) is not None]
    if known:
        calm = [r for r in known if steady(r, calibrated)]
        inside = sum(abs(r["error_pct"]) <= target for r in calm)
        line += (
            f"; {inside} of the {len(calm)} run in the calibrated state (every state figure "
            f"before and after within x{STATE_BAND:g} of the calibrated one; ~ marks the others)"
        )
    wide = [r for r in ok if len(r.get("measured_launches_s", ())) > 1]
    if wide:
        apart = sum(r["spread_pct"] > target for r in wide)
        line += (
            f"; the launches of {apart} of {len(wide)} points spread wider than {target:g}% "
            "(the measurement's own repeatability)"
        )
    print(line)


def print_details(rows: list[dict]) -> None:
    for r in rows:
        if r["status"] != "ok":
            continue
        print(f"\n# {r['proxy']} {r['config']}, {r['ranks']} ranks, {r['mode']}: {r['prediction']}")
        print(f"  {'category':<24} {'measured':>9} {'predicted':>9} {'share':>6} {'error':>7}")
        for c, v in r["categories"].items():
            print(
                f"  {c:<24} {v['measured_s']:8.4f}s {v['predicted_s']:8.4f}s "
                f"{100 * v['share']:5.0f}% {pct(v['error_pct']):>7}"
            )


def rank_list(text: str) -> list[int]:
    try:
        ranks = [int(x) for x in text.split(",")]
    except ValueError:
        ranks = []
    if not ranks or any(r < 2 or r % 2 or r > MAX_RANKS for r in ranks):
        raise argparse.ArgumentTypeError(
            f"expected even rank counts >= 2 (and <= {MAX_RANKS}), comma-separated (the "
            "configs use tp or pp 2), "
            f"got {text!r}"
        )
    return sorted(set(ranks))


def tflops_or_auto(text: str) -> str | float:
    from proxies.core import cli

    if text == "auto":
        return text
    try:
        return cli.device_tflops(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a positive number or auto (TFLOP/s from {cli.TFLOPS_MIN:g} to "
            f"{cli.TFLOPS_MAX:g}), got {text!r}"
        ) from None


def parser() -> argparse.ArgumentParser:
    from proxies.core import cli

    p = argparse.ArgumentParser(
        prog="python benchmarks/predict.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--ranks", type=rank_list, default=[2, 4], help="rank counts (default 2,4)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--machine", metavar="FILE", help="predict with this machine file")
    src.add_argument(
        "--calibrate",
        action="store_true",
        help="calibrate this machine first at the largest rank count (the default without "
        "--machine)",
    )
    p.add_argument(
        "--proxies",
        default=",".join(PROXIES),
        help=f"comma-separated subset of {','.join(PROXIES)} (default all)",
    )
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of none,model")
    p.add_argument(
        "--tflops",
        type=tflops_or_auto,
        default="auto",
        help="--device-tflops of the model points: a number, or auto (compute about half of "
        "the iteration; needs the none point)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny presets, 1 timed iteration, calibrate --quick: checks that everything runs "
        "(its errors say little: the iterations are a few ms)",
    )
    p.add_argument(
        "--timeout",
        type=cli.number(min=0, open_min=True, max=cli.TIMEOUT_MAX_S),  # a subprocess limit
        default=120,
        help="seconds per point (default 120)",
    )
    p.add_argument(
        "--target",
        type=cli.number(min=0, open_min=True, max=1000),
        default=25,
        help="error %% marked * above (25), in (0, 1000]",
    )
    p.add_argument(
        "--no-probe",
        action="store_true",
        help="skip the state probe before and after each point (python -m "
        "proxies.calibrate.probe, about a second each: how far the machine had drifted from "
        "its calibration)",
    )
    p.add_argument(
        "--restate",
        action="store_true",
        help="predict each point in the state the probe finds just before it: reuse.reread "
        "from the probe's same-buffer allreduce over the file's cold price of it "
        "(calibration.reuse), compute.memory scaled by the probe's copy rate over the "
        "calibration's (calibration.state.copy); the rest of the file as calibrated",
    )
    p.add_argument(
        "--launches",
        type=cli.integer(min=1, max=100),
        default=None,
        help=f"launches of each point, measured as the median launch ({LAUNCHES}; 1 with --quick)",
    )
    p.add_argument(
        "--per-state",
        action="store_true",
        help="calibrate again when a point's probe finds the machine in a state no machine "
        "file so far was calibrated in (a state figure beyond the band), up to "
        f"{MAX_CALIBRATIONS} files; each point is predicted with the file of the state it "
        "starts in",
    )
    p.add_argument("--details", action="store_true", help="every category of every point")
    p.add_argument("--json", metavar="OUT", help="write the machine and every row to OUT")
    return p


def subset(text: str, known: tuple[str, ...], option: str, p) -> list[str]:
    chosen = [x for x in text.split(",") if x]
    bad = [x for x in chosen if x not in known]
    if bad or not chosen:
        p.error(f"{option}: expected a subset of {','.join(known)}, got {text!r}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    proxies = subset(args.proxies, PROXIES, "--proxies", p)
    modes = subset(args.modes, MODES, "--modes", p)
    fixed = None if args.tflops == "auto" else args.tflops
    from proxies.core import cli, report

    if cli.output_problem(args.json):
        p.error(cli.output_problem(args.json))  # before the points, not after them
    if args.machine and not os.path.isfile(args.machine):
        p.error(f"--machine: no such file: {args.machine}")
    if (args.restate or args.per_state) and args.no_probe:
        p.error(f"{'--restate' if args.restate else '--per-state'} needs the state probe: not "
                "with --no-probe")  # fmt: skip
    if args.restate and args.per_state:
        p.error("--restate and --per-state: one or the other (--per-state calibrates each state)")
    iters, warmup = (1, 1) if args.quick else (ITERS, WARMUP)
    launches = args.launches or (1 if args.quick else LAUNCHES)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        machine = args.machine
        if machine is None:
            machine = os.path.join(tmp, "machine.yaml")
            calibrate(max(args.ranks), machine, args.quick, args.timeout)
        try:
            summary, one_node = machine_summary(machine)
            from proxies.calibrate.probe import calibrated_state

            calibrated = calibrated_state(machine)
            restate = restated(machine) if args.restate else None
        except Exception as e:  # a bad file: the proxies would each refuse it the same way
            print(f"predict: {e}", file=sys.stderr)
            return 2
        probe = None if args.no_probe else state_probe
        timing = dict(
            timeout=args.timeout,
            iters=iters,
            warmup=warmup,
            probe=probe,
            restate=restate,
            launches=launches,
        )
        cals = None
        if args.per_state:
            cals = Calibrations(machine, max(args.ranks), tmp, args.quick, args.timeout)
            timing["pick"] = cals.pick
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        print(f"# host: {cores} cores · machine file {machine}")
        print(f"# {'file 1: ' * args.per_state}{summary}")
        if restate:
            print(
                f"# --restate: each point with reuse.reread = the probe's same-buffer 1 MiB "
                f"allreduce before it / {restate.cold_s * 1e6:.0f} us (the file's cold price of "
                f"it)"
                + (
                    f", compute.memory = {restate.memory / 1e9:.3g} GB/s x the probe's copy "
                    f"rate / {restate.copy / 1e9:.3g} GB/s (the calibration's)"
                    if restate.copy
                    else ""
                )
            )
        rows = []
        for proxy in proxies:
            for ranks in args.ranks:
                config, pargs = configs(proxy, ranks, args.quick)
                # a one-node machine file: all of the point's ranks share that node
                extra = ["--ranks-per-node", str(ranks)] if one_node else []
                base = Point(proxy, config, pargs, ranks, extra=extra)
                none = None
                if "none" in modes or (fixed is None and "model" in modes):
                    none = run_point(base, machine, **timing)
                    if "none" in modes:
                        rows.append(none)
                        print_progress(none)
                if "model" not in modes:
                    continue
                model = Point(proxy, config, pargs, ranks, "model", fixed, extra)
                if fixed is None:
                    try:
                        if none["status"] != "ok":
                            raise RuntimeError("the none point failed, nothing to scale by")
                        c1 = compute_at_one_tflops(base, machine, args.timeout)
                        model.tflops = float(f"{c1 / none['measured_s']:.2g}")
                    except (RuntimeError, TimeoutError, OSError, ValueError, KeyError) as e:
                        row = run_point_failed(model, f"failed: no --device-tflops ({e})")
                        rows.append(row)
                        print_progress(row)
                        continue
                row = run_point(model, machine, **timing)
                rows.append(row)
                print_progress(row)
        mpi = next((r["mpi"] for r in rows if r.get("mpi")), "")
        waits = sorted({f"{r['ranks']} ranks: {r['wait']}" for r in rows if r.get("wait")})
        print(
            f"\n# predicted vs measured per iteration, the median of {iters} timed after "
            f"{warmup} warm-up"
            + (f", the median of {launches} launches" if launches > 1 else "")
            + (f" · {mpi} · waits {', '.join(waits)}" if mpi else "")
        )
        print(f"# * error above {args.target:g}%")
        print_table(rows, args.target, calibrated)
        if args.details:
            print_details(rows)
        total = time.perf_counter() - started
        print(f"# {len(rows)} points in {total:.0f} s")
        if args.json:
            out = {
                "command": " ".join(["python", "benchmarks/predict.py", *sys.argv[1:]]),
                "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                "host_cores": cores,
                "machine": summary,
                "calibrated_state": calibrated,
                # the files themselves: each point can be predicted again from its file
                "calibrations": [
                    {
                        "file": k + 1,
                        "machine": machine_summary(path)[0],
                        "state": state,
                        "yaml": read_text(path),
                    }
                    for k, (path, state) in enumerate(cals.files if cals else [(machine, None)])
                ],
                "launches": launches,
                "mpi": mpi,
                "seconds": total,
                "rows": rows,
            }
            if report.write_json(args.json, out, prog="predict") is None:
                return 1
    # every point was tried and shown; the status says whether all of them ran (as sweeps)
    return 1 if any(r["status"] != "ok" for r in rows) else 0


def read_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def run_point_failed(point: Point, status: str) -> dict:
    return {
        "proxy": point.proxy,
        "config": point.config,
        "ranks": point.ranks,
        "mode": point.mode,
        "tflops": point.tflops,
        "status": status,
    }


def print_progress(row: dict) -> None:
    what = (
        f"{row['measured_s']:.4f} s measured, {row['predicted_s']:.4f} s predicted"
        if row["status"] == "ok"
        else row["status"]
    )
    print(f"# {row['proxy']} {row['ranks']} ranks {row['mode']}: {what}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
