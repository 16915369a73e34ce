"""python -m proxies.gpt2.bench: one GPT-2 training step on one process, timed.

    python -m proxies.gpt2.bench                    # GPT-2 124M at B x T = 4x64 and 4x256
    python -m proxies.gpt2.bench --torch            # side by side with PyTorch eager
    python -m proxies.gpt2.bench --model gpt2-tiny --layers 2 --shapes 2x16 --json out.json

Letters as in config.py: B batch, T time, C channels, NH heads, V vocabulary, L layers.

One step is what the proxy's `--compute real` does on one rank holding the whole model:
zero_grad, forward (loss), backward, AdamW. Every step sees the next B samples of the
synthetic tokens, the same sequence for both implementations.

Reported per shape:
- ms per step: median, min, max of --steps timed steps after --warmup untimed ones;
  tokens/s = B*T / median.
- model FLOPs per step = 3 * StageModel.flops_forward() (backward = 2 x forward): per token
  6 * N_mm + 12 * L * T * C, with N_mm = 12 L C^2 + V C the matmul parameters (the tied LM
  head counted once; biases, layernorms, wpe not) and attention's QK^T and AV counted over
  the full T x T square, as computed. Not counted: layernorm, GELU, softmax, AdamW (and the
  logits the classifier recomputes in backward when its dlogits exceed fast.DLOGITS_BUDGET).
- matmul rate: np.matmul on the step's own GEMMs (forward, input-gradient and
  weight-gradient of qkv, proj, fc, fcproj and of the LM head in its chunks of
  kernels.CLASSIFIER_CHUNK // V rows; attention's batched QK^T and AV), each at its best
  call (of >= MATMUL_REPEATS calls and >= MATMUL_MIN_S seconds, before and again after the
  shape's timed steps), combined by its share of the step's FLOPs: the rate the step's
  matmul mix reaches on this machine. MFU = achieved model FLOP/s / that rate.
- memory: in a fresh child process without torch, peak RSS (VmHWM) after MEMORY_STEPS steps
  minus RSS after imports, against the bound of the issue: 4 bytes x 4N (parameters,
  gradients, AdamW m and v) + the activations saved for backward (the arrays of one
  StageActs that own their memory). MiB throughout.
- with --torch: the same model and data in PyTorch eager (proxies/transformer/reference.py), steps
  alternating ours/torch, first one then the other, so machine noise hits both; the first
  step's losses (relative difference, LOSS_TOL) and gradients before the first optimizer
  step (per tensor max|g_ours - g_torch| / max|g_torch|, worst tensor, GRAD_TOL); the
  last step's losses after both optimizers ran (LOSS_TOL_LAST, loose: AdamW amplifies
  rounding in near-zero gradients). Exit status 1 if a check fails. And the same GEMM mix
  through torch.matmul (PyTorch's BLAS: MKL in its x86 wheels, NumPy's is OpenBLAS): its
  rate, and the ratio our step would have at those rates, everything else as measured
  (derived: where the remaining gap is the BLAS library, not our kernels).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from functools import partial

import numpy as np

from proxies.core import cli, exits, provenance, report
from proxies.core import threads as blas_threads
from proxies.transformer.config import PRESETS, GPT2Config
from proxies.transformer.data import Synthetic, batch
from proxies.transformer.kernels import CLASSIFIER_CHUNK
from proxies.transformer.stage_model import StageModel

PROG = "proxies.gpt2.bench"
DEFAULT_SHAPES = "4x64,4x256"
LR = 1e-3  # the proxy's default
# Each GEMM's rate: its best call, of at least MATMUL_REPEATS calls and MATMUL_MIN_S seconds,
# measured before and after the shape's timed steps (load from other jobs comes and goes).
MATMUL_REPEATS = 3
MATMUL_MIN_S = 0.2
MEMORY_STEPS = 2  # the first step allocates AdamW's moments; the second is the steady state
MEMORY_LIMIT = 1.3  # the issue's bound: peak RSS <= 1.3 x (16 N + saved activations)
# float32 unit roundoff 6e-8; a gradient is a reduction over up to B*T (or V) terms through
# 2L + 2 chained kernels, with summation orders that differ between BLAS libraries: a few
# 1e-6 relative to the tensor's largest entry (measured: 5e-7..1e-6). 1e-4 keeps a margin
# of 100x and still catches any real bug (a wrong term is O(1) of the gradient).
GRAD_TOL = 1e-4
LOSS_TOL = 1e-4
LOSS_TOL_LAST = 1e-2
MiB = 1 << 20


def parser() -> cli.Parser:
    p = cli.Parser(
        prog=f"python -m {PROG}",
        description="Time one GPT-2 training step (forward, backward, AdamW) of the NumPy "
        "model in one process; report model FLOP/s, MFU against this machine's measured "
        "matmul rate, peak memory, and with --torch the same step in PyTorch eager.",
    )
    p.add_argument(
        "--model",
        choices=sorted(PRESETS),
        default="gpt2",
        help="preset widths (default gpt2: the 124M model)",
    )
    p.add_argument(
        "--layers", type=cli.positive_int, metavar="N", help="depth (default: the preset's)"
    )
    p.add_argument(
        "--shapes",
        default=DEFAULT_SHAPES,
        metavar="BxT,...",
        help=f"batch x sequence length of each run (default {DEFAULT_SHAPES})",
    )
    p.add_argument(
        "--steps", type=cli.positive_int, default=10, help="timed steps per shape (default 10)"
    )
    p.add_argument(
        "--warmup",
        type=cli.nonneg_int,
        default=2,
        help="untimed steps before them (default 2)",
    )
    p.add_argument(
        "--torch",
        action="store_true",
        help="also run the same model in PyTorch eager, alternating steps, and check that "
        "losses and gradients agree",
    )
    p.add_argument(
        "--torch-adamw",
        choices=("fused", "default"),
        default="fused",
        help="PyTorch's AdamW: fused (its fastest CPU loop; the default, the stricter "
        "comparison) or default (torch.optim.AdamW with no flags: on the CPU, a loop of "
        "tensor operations per parameter)",
    )
    p.add_argument("--json", metavar="PATH", help="write all results as one JSON object to PATH")
    p.add_argument(
        "--seed", type=cli.nonneg_int, default=0, help="seed of weights and tokens (default 0)"
    )
    # internal: the memory measurement, run in a fresh process per shape
    p.add_argument("--memory-child", metavar="BxT", help=argparse.SUPPRESS)
    provenance.add_version(p)  # --version
    return p


def parse_shapes(text: str, cfg: GPT2Config) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", item)
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise cli.UsageError(f"--shapes {text}: expected positive BxT pairs like 4x64,4x256")
        B, T = int(m.group(1)), int(m.group(2))
        if T > cfg.max_seq_len:
            raise cli.UsageError(
                f"--shapes {text}: T = {T} is longer than the context of {cfg.max_seq_len}"
            )
        shapes.append((B, T))
    return shapes


# ----------------------------------------------------------------------------------------
# the machine


def machine_info(torch=None) -> dict:
    threads, ranks, cores, source = blas_threads.decision or (0, 1, os.cpu_count() or 1, "?")
    info = {
        "cpu": _cpu_model(),
        "cores": cores,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "blas": _blas(),
        "blas_threads": threads,
        "blas_threads_source": source,
        "openblas_thread_timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
    }
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _blas() -> str:
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas['name']} {blas.get('version', '')}".strip()
    except Exception:  # older NumPy: no dict mode
        return "unknown"


def _status_kib(field: str) -> int | None:
    """A field of /proc/self/status in KiB (VmRSS: now, VmHWM: peak), None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


# ----------------------------------------------------------------------------------------
# one step, and its data


def tokens(cfg: GPT2Config, B: int, T: int, n: int, seed: int) -> list[tuple]:
    """n (inputs, targets) batches: step i takes samples i*B .. i*B + B - 1."""
    source = Synthetic(seed, cfg.vocab_size, T)
    return [batch(source, i * B, B) for i in range(n)]


def build(cfg: GPT2Config, B: int, T: int, seed: int) -> StageModel:
    return StageModel(cfg, range(cfg.n_layer), True, True, B, T, seed=seed)


def forward_backward(m: StageModel, x: np.ndarray, y: np.ndarray) -> float:
    m.zero_grad()
    loss = m.forward(0, x, y)
    m.backward(0)
    return loss


def saved_bytes(acts) -> int:
    """Bytes of the arrays a StageActs (and its LayerActs) own: views (a layer's inp, out)
    are counted where they were allocated."""
    total = 0
    for obj in [acts, *acts.layers]:
        for f in dataclasses.fields(obj):
            a = getattr(obj, f.name)
            if isinstance(a, np.ndarray) and a.base is None:
                total += a.nbytes
    return total


# ----------------------------------------------------------------------------------------
# memory, in a fresh process


def memory_child(cfg: GPT2Config, B: int, T: int, seed: int) -> int:
    """Print {baseline, peak, bound...} as JSON: RSS after imports and data, VmHWM after
    MEMORY_STEPS steps."""
    data = tokens(cfg, B, T, MEMORY_STEPS, seed)
    base = _status_kib("VmRSS")
    m = build(cfg, B, T, seed)
    for x, y in data:
        forward_backward(m, x, y)
        m.step(LR)
    peak = _status_kib("VmHWM")
    if base is None or peak is None:  # not Linux: ru_maxrss (bytes on macOS), no baseline
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak //= 1024 if sys.platform == "darwin" else 1
        base = 0
    state = 4 * m.num_params * m.dtype.itemsize  # parameters, gradients, AdamW m and v
    acts = saved_bytes(m._alloc_acts())  # np.empty: untouched, costs no RSS
    out = {
        "baseline_rss_mb": base / 1024,
        "peak_rss_mb": (peak - base) / 1024,
        "state_mb": state / MiB,
        "acts_mb": acts / MiB,
        "memory_bound_mb": (state + acts) / MiB,
        "torch_loaded": "torch" in sys.modules,
    }
    out["memory_ratio"] = out["peak_rss_mb"] / out["memory_bound_mb"]
    print(json.dumps(out))
    return 0


def measure_memory(args, cfg: GPT2Config, B: int, T: int) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", PROG, "--memory-child", f"{B}x{T}", "--model", args.model]
    cmd += ["--layers", str(cfg.n_layer), "--seed", str(args.seed)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"memory child {B}x{T} failed:\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------
# the machine's matmul rate on the step's GEMMs


def step_gemms(cfg: GPT2Config, B: int, T: int) -> list[tuple[str, float, tuple, tuple]]:
    """(name, FLOPs per step, shape a, shape b) of every GEMM of one step: per linear
    x @ W.T, dout @ W, dout.T @ x (as kernels.matmul_*; a "T" marks a transposed operand);
    the LM head in classifier chunks; attention as (B,NH) batched matmuls."""
    L, C, NH, V = cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size
    N, hs = B * T, C // NH
    gemms = []
    for name, OC, IC in (("qkv", 3 * C, C), ("proj", C, C), ("fc", 4 * C, C), ("fcproj", C, 4 * C)):
        f = L * 2.0 * N * IC * OC
        gemms += [
            (f"{name} x@W.T", f, (N, IC), ("T", OC, IC)),
            (f"{name} dout@W", f, (N, OC), (OC, IC)),
            (f"{name} dout.T@x", f, ("T", N, OC), (N, IC)),
        ]
    R = max(1, min(N, CLASSIFIER_CHUNK // V))
    f = 2.0 * N * C * V
    gemms += [
        ("head x@wte.T", f, (R, C), ("T", V, C)),
        ("head dlogits@wte", f, (R, V), (V, C)),
        ("head dlogits.T@x", f, ("T", R, V), (R, C)),
    ]
    # forward q@k.T and att@v; backward do@v.T like the first, att.T@do, datt@k, datt.T@q like
    # the second
    f = L * 2.0 * B * NH * T * T * hs
    gemms += [("attn q@k.T", 2 * f, (B, NH, T, hs), (B, NH, hs, T))]
    gemms += [("attn att@v", 4 * f, (B, NH, T, T), (B, NH, T, hs))]
    return gemms


def _operand(shape: tuple, rng: np.random.Generator) -> np.ndarray:
    if shape[0] == "T":  # stored the other way round, passed transposed
        return rng.standard_normal(shape[1:], dtype=np.float32).T
    return rng.standard_normal(shape, dtype=np.float32)


def gemm_seconds(cfg: GPT2Config, B: int, T: int, torch=None) -> dict[str, float]:
    """Each of the step's GEMMs: the best seconds of one call over at least MATMUL_REPEATS
    calls (and MATMUL_MIN_S, for the small ones); with torch, torch.matmul's on the same
    arrays (PyTorch's BLAS, MKL in its x86 wheels) instead of np.matmul's."""
    rng = np.random.default_rng(0)
    best = {}
    for name, _, sa, sb in step_gemms(cfg, B, T):
        a, b = _operand(sa, rng), _operand(sb, rng)
        shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
        out = np.full(shape, 0.0, dtype=np.float32)  # written: its pages are in before timing
        if torch is None:
            call = partial(np.matmul, a, b, out=out)
        else:
            ta, tb, tout = (torch.from_numpy(x) for x in (a, b, out))
            call = partial(torch.matmul, ta, tb, out=tout)
        times: list[float] = []
        while len(times) < MATMUL_REPEATS or (sum(times) < MATMUL_MIN_S and len(times) < 100):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        best[name] = min(times)
    return best


def matmul_rate(
    cfg: GPT2Config, B: int, T: int, seconds: dict[str, float]
) -> tuple[float, dict[str, float]]:
    """FLOP/s of the step's GEMM mix: its FLOPs / the sum of each GEMM's FLOPs at that GEMM's
    best rate; and each GEMM's rate in GFLOP/s."""
    total, spent, rates = 0.0, 0.0, {}
    for name, flops, sa, sb in step_gemms(cfg, B, T):
        a, b = _logical(sa), _logical(sb)
        rate = 2.0 * math.prod(a) * b[-1] / seconds[name]  # batch x M x K x N
        rates[name] = rate / 1e9
        total += flops
        spent += flops / rate
    return total / spent, rates


def _logical(shape: tuple) -> tuple[int, ...]:
    return shape[:0:-1] if shape[0] == "T" else shape


# ----------------------------------------------------------------------------------------
# the timed steps


def run_shape(args, cfg: GPT2Config, B: int, T: int, torch) -> dict:
    """Time warm-up + steps steps of ours (and torch's, alternating which goes first)."""
    n = args.warmup + args.steps
    data = tokens(cfg, B, T, n, args.seed)
    m = build(cfg, B, T, args.seed)
    rec: dict = {"B": B, "T": T}
    ours = Steps()

    def ours_fb(i: int) -> None:
        t0 = time.perf_counter()
        ours.losses.append(forward_backward(m, *data[i]))
        ours.fb.append(time.perf_counter() - t0)

    def ours_opt() -> None:
        t0 = time.perf_counter()
        m.step(LR)
        ours.opt.append(time.perf_counter() - t0)

    if torch is None:
        for i in range(n):
            ours_fb(i)
            ours_opt()
        return {**rec, **ours.summary("", args.warmup, B * T), "model_flops": 3 * m.flops_forward()}

    from proxies.transformer.reference import GPT2, adamw

    ref = GPT2.from_stage(m)
    opt = adamw(ref, LR, fused=args.torch_adamw == "fused")
    tdata = [tuple(torch.from_numpy(a.astype(np.int64)) for a in xy) for xy in data]
    theirs = Steps()

    def torch_fb(i: int) -> None:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = ref(*tdata[i])
        loss.backward()
        theirs.fb.append(time.perf_counter() - t0)
        theirs.losses.append(loss.item())

    def torch_opt() -> None:
        t0 = time.perf_counter()
        opt.step()
        theirs.opt.append(time.perf_counter() - t0)

    # step 1: both gradients compared before either optimizer moves the weights
    ours_fb(0)
    torch_fb(0)
    rec.update(compare_grads(m, ref))
    ours_opt()
    torch_opt()
    for i in range(1, n):  # alternate which goes first: drifting load touches both alike
        first, second = ((ours_fb, ours_opt), (torch_fb, torch_opt))[:: 1 if i % 2 else -1]
        for fb, step in (first, second):
            fb(i)
            step()
    rec.update(ours.summary("", args.warmup, B * T), model_flops=3 * m.flops_forward())
    rec.update(theirs.summary("torch_", args.warmup, B * T))
    rec.update(
        ratio_vs_torch=rec["ms_per_step"] / rec["torch_ms_per_step"],
        loss_rel_diff=abs(ours.losses[0] - theirs.losses[0]) / abs(theirs.losses[0]),
        loss_rel_diff_last=abs(ours.losses[-1] - theirs.losses[-1]) / abs(theirs.losses[-1]),
    )
    return rec


@dataclasses.dataclass
class Steps:
    """Seconds of forward+backward and of the optimizer, and the loss, per step."""

    fb: list[float] = dataclasses.field(default_factory=list)
    opt: list[float] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)

    def summary(self, prefix: str, warmup: int, tokens: int) -> dict:
        ms = [(a + b) * 1e3 for a, b in zip(self.fb, self.opt, strict=True)][warmup:]
        median = statistics.median(ms)
        return {
            f"{prefix}ms_per_step": median,
            f"{prefix}ms_min": min(ms),
            f"{prefix}ms_max": max(ms),
            f"{prefix}adamw_ms": statistics.median(t * 1e3 for t in self.opt[warmup:]),
            f"{prefix}tokens_per_s": tokens / median * 1e3,
            f"{prefix}losses": self.losses,
        }


def blas_gap(cfg: GPT2Config, B: int, T: int, rec: dict, rate: float, torch) -> dict:
    """The step's GEMMs through torch.matmul: PyTorch's rate on the same mix, the ms per step
    the GEMMs take at each rate (the mix's FLOPs / rate), and the ratio to PyTorch our step
    would have with PyTorch's BLAS rates and everything else as measured (derived, not timed:
    ours - (our GEMM ms - theirs at their rates), over PyTorch's step)."""
    torch_rate, _ = matmul_rate(cfg, B, T, gemm_seconds(cfg, B, T, torch))
    flops = sum(f for _, f, _, _ in step_gemms(cfg, B, T))
    gemm_ms, torch_gemm_ms = 1e3 * flops / rate, 1e3 * flops / torch_rate
    return {
        "torch_matmul_gflops": torch_rate / 1e9,
        "gemm_ms": gemm_ms,
        "torch_gemm_ms": torch_gemm_ms,
        "ratio_at_torch_blas": (rec["ms_per_step"] - gemm_ms + torch_gemm_ms)
        / rec["torch_ms_per_step"],
    }


def compare_grads(m: StageModel, ref) -> dict:
    """Per tensor max|g_ours - g_torch| / max|g_torch|; the worst tensor."""
    worst, name = -1.0, ""
    for n, p in ref.named().items():
        g = p.grad.numpy()
        scale = float(np.abs(g).max()) or 1.0
        d = float(np.abs(m.grad_views[n] - g).max()) / scale
        if d > worst:
            worst, name = d, n
    return {"grad_rel_diff": worst, "grad_worst_tensor": name}


# ----------------------------------------------------------------------------------------
# report


def slowest_gemms(cfg: GPT2Config, B: int, T: int, rec: dict, n: int = 3) -> str:
    """The GEMMs that take most of the mix's time, with their share and rate."""
    rates = rec["matmul_gemm_gflops"]
    secs = {name: f / 1e9 / rates[name] for name, f, _, _ in step_gemms(cfg, B, T)}
    total = sum(secs.values())
    top = sorted(secs, key=secs.get, reverse=True)[:n]
    return "most time in " + ", ".join(
        f"{g} ({100 * secs[g] / total:.0f}% at {rates[g]:.1f} GFLOP/s)" for g in top
    )


def checks_pass(rec: dict) -> bool:
    if "loss_rel_diff" not in rec:
        return True
    return (
        rec["loss_rel_diff"] <= LOSS_TOL
        and rec["grad_rel_diff"] <= GRAD_TOL
        and rec["loss_rel_diff_last"] <= LOSS_TOL_LAST
    )


def print_report(header: list[str], records: list[dict], with_torch: bool) -> None:
    from rich.table import Table

    from proxies.core.report import console

    out = console()
    for line in header:
        out.print(line)
    t = Table(title="training step (NumPy StageModel)", title_justify="left")
    for col in ("B x T", "ms/step median", "min", "max", "of which AdamW", "tokens/s"):
        t.add_column(col, justify="right")
    for col in ("model GFLOP/step", "model GFLOP/s", "matmul GFLOP/s", "MFU"):
        t.add_column(col, justify="right")
    for r in records:
        t.add_row(
            f"{r['B']}x{r['T']}",
            f"{r['ms_per_step']:.1f}",
            f"{r['ms_min']:.1f}",
            f"{r['ms_max']:.1f}",
            f"{r['adamw_ms']:.1f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['model_flops'] / 1e9:,.1f}",
            f"{r['model_flops'] / r['ms_per_step'] / 1e6:,.1f}",
            f"{r['matmul_gflops']:,.1f}",
            f"{100 * r['mfu']:.1f}%",
        )
    out.print(t)

    t = Table(title="peak memory of the step (fresh process, no torch)", title_justify="left")
    for col in ("B x T", "peak RSS - baseline MiB", "params+grads+AdamW MiB", "saved acts MiB"):
        t.add_column(col, justify="right")
    t.add_column("bound MiB", justify="right")
    t.add_column(f"ratio (limit: <= {MEMORY_LIMIT})", justify="right")
    for r in records:
        t.add_row(
            f"{r['B']}x{r['T']}",
            f"{r['peak_rss_mb']:,.1f}",
            f"{r['state_mb']:,.1f}",
            f"{r['acts_mb']:,.1f}",
            f"{r['memory_bound_mb']:,.1f}",
            f"{r['memory_ratio']:.3f}",
        )
    out.print(t)

    if with_torch:
        t = Table(title="vs PyTorch eager (steps alternated)", title_justify="left")
        for col in ("B x T", "torch ms/step median", "min", "max", "of which AdamW"):
            t.add_column(col, justify="right")
        t.add_column("ours / torch", justify="right")
        t.add_column("torch matmul GFLOP/s", justify="right")
        t.add_column("ours / torch at torch's matmul rates", justify="right")
        t.add_column("loss rel diff, step 1", justify="right")
        t.add_column("last step", justify="right")
        t.add_column("grad rel diff (worst tensor)", justify="right")
        t.add_column("agree", justify="right")
        for r in records:
            t.add_row(
                f"{r['B']}x{r['T']}",
                f"{r['torch_ms_per_step']:.1f}",
                f"{r['torch_ms_min']:.1f}",
                f"{r['torch_ms_max']:.1f}",
                f"{r['torch_adamw_ms']:.1f}",
                f"{r['ratio_vs_torch']:.2f}",
                f"{r['torch_matmul_gflops']:,.1f}",
                f"{r['ratio_at_torch_blas']:.2f}",
                f"{r['loss_rel_diff']:.1e}",
                f"{r['loss_rel_diff_last']:.1e}",
                f"{r['grad_rel_diff']:.1e} ({r['grad_worst_tensor']})",
                "ok" if checks_pass(r) else "FAIL",
            )
        out.print(t)
        out.print(
            f"agree: loss rel diff <= {LOSS_TOL:g} at step 1 and <= {LOSS_TOL_LAST:g} at the "
            f"last step; per tensor max|g_ours - g_torch| / max|g_torch| <= {GRAD_TOL:g} "
            "before the first optimizer step"
        )
        out.print(
            "torch matmul GFLOP/s: torch.matmul on the same GEMM mix (PyTorch's BLAS); ours / "
            "torch at torch's matmul rates: derived, our step with its GEMMs' time (mix FLOPs / "
            "our rate) replaced by that time at torch's rate"
        )


def run(args) -> int:
    cfg = PRESETS[args.model]
    if args.layers:
        cfg = cfg.with_layers(args.layers)
    shapes = parse_shapes(args.memory_child or args.shapes, cfg)
    if args.memory_child:
        return memory_child(cfg, *shapes[0], args.seed)
    cli.check_output(args.json)
    torch = None
    if args.torch:
        try:
            import torch
        except ImportError:
            raise cli.UsageError(
                "--torch needs PyTorch, which is not installed here: pip install torch"
            ) from None
    machine = machine_info(torch)
    if torch is not None and machine["blas_threads"] > 0:
        torch.set_num_threads(machine["blas_threads"])  # the same threads as NumPy's BLAS
        machine["torch_threads"] = torch.get_num_threads()

    N_mm = cfg.n_layer * 12 * cfg.n_embd**2 + cfg.vocab_size * cfg.n_embd
    header = [
        f"[bold]{PROG}[/] · {args.model} (L={cfg.n_layer}, C={cfg.n_embd}, NH={cfg.n_head}, "
        f"V={cfg.vocab_size}) = {cfg.num_params / 1e6:,.1f}M parameters · {args.warmup} "
        f"warm-up + {args.steps} timed steps per shape · AdamW lr {LR:g} · seed {args.seed}",
        f"machine: {machine['cpu']} · {machine['cores']} cores · numpy {machine['numpy']} "
        f"({machine['blas']}) · BLAS threads {machine['blas_threads']} "
        f"({machine['blas_threads_source']})"
        + (
            f" · torch {machine['torch']}, {machine['torch_threads']} threads, "
            f"{args.torch_adamw} AdamW"
            if torch
            else ""
        ),
        f"model FLOPs per step = 3 x forward = 6 N_mm + 12 L T C per token (N_mm = 12 L C^2 + "
        f"V C = {N_mm / 1e6:,.1f}M matmul parameters, tied head once; attention over the full "
        "T x T square); MFU = model FLOP/s / matmul rate, np.matmul on the step's own GEMMs, "
        "best call of each (before and after the steps), weighted by FLOPs",
    ]

    records = []
    for B, T in shapes:
        mem = measure_memory(args, cfg, B, T)  # first, alone: nothing else in this process runs
        before = gemm_seconds(cfg, B, T)
        rec = run_shape(args, cfg, B, T, torch)
        after = gemm_seconds(cfg, B, T)
        rate, rates = matmul_rate(cfg, B, T, {g: min(before[g], after[g]) for g in before})
        achieved = rec["model_flops"] / (rec["ms_per_step"] / 1e3)
        rec.update(matmul_gflops=rate / 1e9, matmul_gemm_gflops=rates, mfu=achieved / rate)
        if torch is not None:
            rec.update(blas_gap(cfg, B, T, rec, rate, torch))
        rec.update(mem)
        records.append(rec)
    print_report(header, records, torch is not None)
    for r in records:
        print(f"matmul mix {r['B']}x{r['T']}: " + slowest_gemms(cfg, r["B"], r["T"], r))

    if args.json:
        result = {
            "benchmark": "gpt2_step",
            "config": {
                "model": args.model,
                "layers": cfg.n_layer,
                "n_embd": cfg.n_embd,
                "n_head": cfg.n_head,
                "vocab_size": cfg.vocab_size,
                "params": cfg.num_params,
                "shapes": [[B, T] for B, T in shapes],
                "steps": args.steps,
                "warmup": args.warmup,
                "seed": args.seed,
                "lr": LR,
                "torch": args.torch,
                "torch_adamw": args.torch_adamw if args.torch else None,
            },
            "machine": machine,
            "flops_definition": header[2],
            "tolerances": {"loss": LOSS_TOL, "loss_last": LOSS_TOL_LAST, "grad": GRAD_TOL},
            "results": records,
        }
        result |= provenance.fields()
        if report.write_json(args.json, result, prog=PROG) is None:
            return exits.FAILED
    return 0 if all(checks_pass(r) for r in records) else 1


def main(argv: list[str] | None = None) -> int:
    try:
        return run(parser().parse_args(argv))
    except cli.UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
