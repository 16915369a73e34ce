"""One GPT training step of the NumPy model on one process, timed; MFU, peak memory, and
PyTorch beside it.

    python benchmarks/gpt2_step.py                  # GPT-2 124M at B x T = 4x64 and 4x256
    python benchmarks/gpt2_step.py --torch          # side by side with PyTorch eager
    python benchmarks/gpt2_step.py --preset gpt3-small --shapes 4x64
    python benchmarks/gpt2_step.py --preset gpt2-tiny --layers 2 --shapes 2x16 --json out.json

Letters as in proxies/transformer/config.py: B batch, T time, C channels, NH heads,
V vocabulary (Vp padded), L layers.

One step is what the proxies' `--compute real` does on one rank holding the whole model:
the forward (loss) and backward of one micro-batch, piece by piece as the plan cuts them,
on the one stage model, `proxies.transformer.model.StageShard` at tp = pp = 1 (step_shard.py),
then AdamW. Any preset of GPT-2 or GPT-3 (`--preset`); a GPT-3 preset's vocabulary is padded
to Vp as its front end pads it. Every step sees the next B samples of the synthetic tokens,
the same sequence for both implementations.

Reported per shape:
- ms per step: median, min, max of --steps timed steps after --warmup untimed ones;
  tokens/s = B*T / median.
- model FLOPs per step = the FLOPs of the plan's pieces (forward, backward = 2 x forward):
  per token 6 * N_mm + 12 * L * T * C, with N_mm = 12 L C^2 + Vp C the matmul parameters
  (the tied LM head counted once; biases, layernorms, wpe not) and attention's QK^T and AV
  counted over the full T x T square, as computed. Not counted: layernorm, GELU, softmax,
  AdamW (and the logits the LM head recomputes in backward when its probabilities exceed
  fast.DLOGITS_BUDGET).
- matmul rate: np.matmul on the step's own GEMMs (forward, input-gradient and
  weight-gradient of qkv, proj, fc, fcproj and of the LM head as the shard runs it;
  attention's batched QK^T and AV), each at its best call (of >= MATMUL_REPEATS calls and
  >= MATMUL_MIN_S seconds, before and again after the shape's timed steps), combined by its
  share of the step's FLOPs: the rate the step's matmul mix reaches on this machine.
  MFU = achieved model FLOP/s / that rate.
- memory: in a fresh child process without torch, peak RSS (VmHWM) after MEMORY_STEPS steps
  minus RSS after imports, against the bound of the issue: 4 bytes x 4N (parameters,
  gradients, AdamW m and v) + the activations saved for backward (the arrays of one
  micro-batch's ChunkActs that own their memory). MiB throughout.
- with --torch: the same model and data in PyTorch eager (proxies/transformer/reference.py,
  at the real vocabulary: step_shard.torch_reference), steps alternating ours/torch, first
  one then the other, so machine noise hits both; the first step's losses (relative
  difference, LOSS_TOL) and gradients before the first optimizer step (per tensor
  max|g_ours - g_torch| / max|g_torch|, worst tensor, GRAD_TOL); the last step's losses
  after both optimizers ran (LOSS_TOL_LAST, loose: AdamW amplifies rounding in near-zero
  gradients). Exit status 1 if a check fails. And the same GEMM mix through torch.matmul
  (PyTorch's BLAS: MKL in its x86 wheels, NumPy's is OpenBLAS): its rate, and the ratio our
  step would have at those rates, everything else as measured (derived: where the remaining
  gap is the BLAS library, not our kernels).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (HERE, ROOT):  # step_shard / step_report beside this file; proxies from here
    if _path not in sys.path:
        sys.path.insert(0, _path)

# proxies first: importing it pins the BLAS threads before NumPy loads
from proxies.core import cli, exits, provenance, report  # noqa: E402, I001

import numpy as np  # noqa: E402
import step_report as sr  # noqa: E402
from step_shard import PRESETS, Step, compare_grads, tokens, torch_reference  # noqa: E402

from proxies.transformer.config import GPT2Config  # noqa: E402

PROG = "gpt2_step.py"
DEFAULT_SHAPES = "4x64,4x256"
LR = 1e-3  # the proxy's default
MEMORY_STEPS = 2  # the first step allocates AdamW's moments; the second is the steady state
MiB = 1 << 20


def parser() -> cli.Parser:
    p = cli.Parser(
        prog=f"python benchmarks/{PROG}",
        description="Time one GPT training step (forward, backward, AdamW) of the NumPy "
        "model (the proxies' StageShard, whole model on one rank) in one process; report "
        "model FLOP/s, MFU against this machine's measured matmul rate, peak memory, and "
        "with --torch the same step in PyTorch eager.",
    )
    p.add_argument(
        "--preset",
        "--model",
        dest="model",
        choices=sorted(PRESETS),
        default="gpt2",
        help="model preset, GPT-2's or GPT-3's (default gpt2: the 124M model)",
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
# memory, in a fresh process


def memory_child(cfg: GPT2Config, B: int, T: int, seed: int) -> int:
    """Print {baseline, peak, bound...} as JSON: RSS after imports and data, VmHWM after
    MEMORY_STEPS steps."""
    data = tokens(cfg, B, T, MEMORY_STEPS, seed)
    base = sr.status_kib("VmRSS")
    m = Step(cfg, B, T, seed)
    acts = 0
    for x, y in data:
        m.forward(x, y)
        acts = m.saved_bytes()  # what this forward keeps for the backward
        m.backward()
        m.step(LR)
    peak = sr.status_kib("VmHWM")
    if base is None or peak is None:  # not Linux: ru_maxrss (bytes on macOS), no baseline
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak //= 1024 if sys.platform == "darwin" else 1
        base = 0
    state = m.state_bytes
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
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", f"{B}x{T}"]
    cmd += ["--preset", args.model, "--layers", str(cfg.n_layer), "--seed", str(args.seed)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"memory child {B}x{T} failed:\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------
# the timed steps


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


def run_shape(args, m: Step, B: int, T: int, torch) -> dict:
    """Time warm-up + steps steps of ours (and torch's, alternating which goes first)."""
    n = args.warmup + args.steps
    data = tokens(m.S.cfg, B, T, n, args.seed)
    rec: dict = {"B": B, "T": T, "model_flops": m.model_flops()}
    ours = Steps()

    def ours_fb(i: int) -> None:
        t0 = time.perf_counter()
        ours.losses.append(m.forward_backward(*data[i]))
        ours.fb.append(time.perf_counter() - t0)

    def ours_opt() -> None:
        t0 = time.perf_counter()
        m.step(LR)
        ours.opt.append(time.perf_counter() - t0)

    if torch is None:
        for i in range(n):
            ours_fb(i)
            ours_opt()
        return {**rec, **ours.summary("", args.warmup, B * T)}

    from proxies.transformer.reference import adamw

    ref = torch_reference(m)
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
    rec.update(ours.summary("", args.warmup, B * T))
    rec.update(theirs.summary("torch_", args.warmup, B * T))
    rec.update(
        ratio_vs_torch=rec["ms_per_step"] / rec["torch_ms_per_step"],
        loss_rel_diff=abs(ours.losses[0] - theirs.losses[0]) / abs(theirs.losses[0]),
        loss_rel_diff_last=abs(ours.losses[-1] - theirs.losses[-1]) / abs(theirs.losses[-1]),
    )
    return rec


# ----------------------------------------------------------------------------------------
# the run


def import_torch(wanted: bool):
    if not wanted:
        return None
    try:
        import torch
    except ImportError:
        raise cli.UsageError(
            "--torch needs PyTorch, which is not installed here: pip install torch"
        ) from None
    return torch


def header(args, cfg: GPT2Config, vocab: int, machine: dict, torch) -> list[str]:
    N_mm = cfg.n_layer * 12 * cfg.n_embd**2 + vocab * cfg.n_embd
    padded = f", padded to Vp={vocab}" if vocab != cfg.vocab_size else ""
    return [
        f"[bold]{PROG}[/] · {args.model} (L={cfg.n_layer}, C={cfg.n_embd}, NH={cfg.n_head}, "
        f"V={cfg.vocab_size}{padded}) = {cfg.num_params / 1e6:,.1f}M parameters · "
        f"{args.warmup} warm-up + {args.steps} timed steps per shape · AdamW lr {LR:g} · "
        f"seed {args.seed}",
        f"machine: {machine['cpu']} · {machine['cores']} cores · numpy {machine['numpy']} "
        f"({machine['blas']}) · BLAS threads {machine['blas_threads']} "
        f"({machine['blas_threads_source']})"
        + (
            f" · torch {machine['torch']}, {machine['torch_threads']} threads, "
            f"{args.torch_adamw} AdamW"
            if torch
            else ""
        ),
        f"model FLOPs per step = the plan's pieces, 3 x forward = 6 N_mm + 12 L T C per token "
        f"(N_mm = 12 L C^2 + Vp C = {N_mm / 1e6:,.1f}M matmul parameters, tied head once; "
        "attention over the full T x T square); MFU = model FLOP/s / matmul rate, np.matmul "
        "on the step's own GEMMs, best call of each (before and after the steps), weighted "
        "by FLOPs",
    ]


def run(args) -> int:
    cfg = PRESETS[args.model]
    if args.layers:
        cfg = cfg.with_layers(args.layers)
    shapes = parse_shapes(args.memory_child or args.shapes, cfg)
    if args.memory_child:
        return memory_child(cfg, *shapes[0], args.seed)
    cli.check_output(args.json)
    torch = import_torch(args.torch)
    machine = sr.machine_info(torch)
    if torch is not None and machine["blas_threads"] > 0:
        torch.set_num_threads(machine["blas_threads"])  # the same threads as NumPy's BLAS
        machine["torch_threads"] = torch.get_num_threads()

    records, vocab = [], cfg.vocab_size
    for B, T in shapes:
        mem = measure_memory(args, cfg, B, T)  # first, alone: nothing else in this process runs
        m = Step(cfg, B, T, args.seed)
        vocab = m.S.vocab
        gemms = sr.step_gemms(cfg, B, T, m.shard.keeps_logits)
        before = sr.gemm_seconds(gemms)
        rec = run_shape(args, m, B, T, torch)
        after = sr.gemm_seconds(gemms)
        rate, rates = sr.matmul_rate(gemms, {g: min(before[g], after[g]) for g in before})
        achieved = rec["model_flops"] / (rec["ms_per_step"] / 1e3)
        rec.update(matmul_gflops=rate / 1e9, matmul_gemm_gflops=rates, mfu=achieved / rate)
        if torch is not None:
            rec.update(sr.blas_gap(gemms, rec, rate, torch))
        rec.update(mem)
        rec["most_time_in"] = sr.slowest_gemms(gemms, rec)
        records.append(rec)
        del m  # its parameters and saved state before the next shape's
    lines = header(args, cfg, vocab, machine, torch)
    sr.print_report(lines, records, torch is not None)
    for r in records:
        print(f"matmul mix {r['B']}x{r['T']}: {r['most_time_in']}")

    if args.json:
        result = {
            "benchmark": "gpt2_step",
            "config": {
                "model": args.model,
                "layers": cfg.n_layer,
                "n_embd": cfg.n_embd,
                "n_head": cfg.n_head,
                "vocab_size": cfg.vocab_size,
                "padded_vocab_size": vocab,
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
            "flops_definition": lines[2],
            "tolerances": {"loss": sr.LOSS_TOL, "loss_last": sr.LOSS_TOL_LAST, "grad": sr.GRAD_TOL},
            "results": records,
        }
        result |= provenance.fields()
        if report.write_json(args.json, result, prog=PROG) is None:
            return exits.FAILED
    return 0 if all(sr.checks_pass(r) for r in records) else 1


def main(argv: list[str] | None = None) -> int:
    try:
        return run(parser().parse_args(argv))
    except cli.UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return exits.USAGE


if __name__ == "__main__":
    sys.exit(main())
