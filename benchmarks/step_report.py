"""The machine side of benchmarks/gpt2_step.py: what runs it (CPU, BLAS, threads), the rate
its BLAS reaches on the step's own GEMMs (np.matmul, and torch.matmul for the BLAS gap), the
agreement checks, and the printed tables.

Letters as in proxies/transformer/config.py: B batch, T time, C channels, NH heads,
V vocabulary (the real one: the LM head multiplies only the rows that are not padding),
L layers, N = B*T.
"""

from __future__ import annotations

import math
import os
import platform
import time
from functools import partial

import numpy as np

from proxies.core import threads as blas_threads
from proxies.transformer.config import GPT2Config
from proxies.transformer.kernels import CLASSIFIER_CHUNK

# Each GEMM's rate: its best call, of at least MATMUL_REPEATS calls and MATMUL_MIN_S seconds,
# measured before and after the shape's timed steps (load from other jobs comes and goes).
MATMUL_REPEATS = 3
MATMUL_MIN_S = 0.2
MEMORY_LIMIT = 1.3  # the issue's bound: peak RSS <= 1.3 x (16 N + saved activations)
# float32 unit roundoff 6e-8; a gradient is a reduction over up to B*T (or V) terms through
# 2L + 2 chained kernels, with summation orders that differ between BLAS libraries: a few
# 1e-6 relative to the tensor's largest entry (measured: 5e-7..1e-6). 1e-4 keeps a margin
# of 100x and still catches any real bug (a wrong term is O(1) of the gradient).
GRAD_TOL = 1e-4
LOSS_TOL = 1e-4
LOSS_TOL_LAST = 1e-2


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


def status_kib(field: str) -> int | None:
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
# the machine's matmul rate on the step's GEMMs


def step_gemms(
    cfg: GPT2Config, B: int, T: int, keeps_logits: bool
) -> list[tuple[str, float, tuple, tuple]]:
    """(name, FLOPs per step, shape a, shape b) of every GEMM of one step, as StageShard
    issues them at tp = 1: per linear x @ W.T, dout @ W, dout.T @ x (as kernels.matmul_*; a
    "T" marks a transposed operand); the LM head over all N rows at once when the shard
    keeps its logits for the backward (`keeps_logits`), else in chunks of
    CLASSIFIER_CHUNK // V rows; attention as (B,NH) batched matmuls."""
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
    R = N if keeps_logits else max(1, min(N, CLASSIFIER_CHUNK // V))
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


def gemm_seconds(gemms: list[tuple], torch=None) -> dict[str, float]:
    """Each of the step's GEMMs: the best seconds of one call over at least MATMUL_REPEATS
    calls (and MATMUL_MIN_S, for the small ones); with torch, torch.matmul's on the same
    arrays (PyTorch's BLAS, MKL in its x86 wheels) instead of np.matmul's."""
    rng = np.random.default_rng(0)
    best = {}
    for name, _, sa, sb in gemms:
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


def matmul_rate(gemms: list[tuple], seconds: dict[str, float]) -> tuple[float, dict[str, float]]:
    """FLOP/s of the step's GEMM mix: its FLOPs / the sum of each GEMM's FLOPs at that GEMM's
    best rate; and each GEMM's rate in GFLOP/s."""
    total, spent, rates = 0.0, 0.0, {}
    for name, flops, sa, sb in gemms:
        a, b = _logical(sa), _logical(sb)
        rate = 2.0 * math.prod(a) * b[-1] / seconds[name]  # batch x M x K x N
        rates[name] = rate / 1e9
        total += flops
        spent += flops / rate
    return total / spent, rates


def _logical(shape: tuple) -> tuple[int, ...]:
    return shape[:0:-1] if shape[0] == "T" else shape


def blas_gap(gemms: list[tuple], rec: dict, rate: float, torch) -> dict:
    """The step's GEMMs through torch.matmul: PyTorch's rate on the same mix, the ms per step
    the GEMMs take at each rate (the mix's FLOPs / rate), and the ratio to PyTorch our step
    would have with PyTorch's BLAS rates and everything else as measured (derived, not timed:
    ours - (our GEMM ms - theirs at their rates), over PyTorch's step)."""
    torch_rate, _ = matmul_rate(gemms, gemm_seconds(gemms, torch))
    flops = sum(f for _, f, _, _ in gemms)
    gemm_ms, torch_gemm_ms = 1e3 * flops / rate, 1e3 * flops / torch_rate
    return {
        "torch_matmul_gflops": torch_rate / 1e9,
        "gemm_ms": gemm_ms,
        "torch_gemm_ms": torch_gemm_ms,
        "ratio_at_torch_blas": (rec["ms_per_step"] - gemm_ms + torch_gemm_ms)
        / rec["torch_ms_per_step"],
    }


def slowest_gemms(gemms: list[tuple], rec: dict, n: int = 3) -> str:
    """The GEMMs that take most of the mix's time, with their share and rate."""
    rates = rec["matmul_gemm_gflops"]
    secs = {name: f / 1e9 / rates[name] for name, f, _, _ in gemms}
    total = sum(secs.values())
    top = sorted(secs, key=secs.get, reverse=True)[:n]
    return "most time in " + ", ".join(
        f"{g} ({100 * secs[g] / total:.0f}% at {rates[g]:.1f} GFLOP/s)" for g in top
    )


# ----------------------------------------------------------------------------------------
# checks and tables


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
    t = Table(title="training step (NumPy StageShard, tp = pp = 1)", title_justify="left")
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
        _print_torch(out, records)


def _print_torch(out, records: list[dict]) -> None:
    from rich.table import Table

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
