"""Context parallelism's load imbalance: per-rank causal attention time for each split.

    python benchmarks/cp_balance.py                 # gpt2-tiny and gpt2 widths, T = 1024, 4096
    python benchmarks/cp_balance.py --model gpt2-tiny --seq-len 256 --repeats 1

T tokens split over --cp ranks (proxies/transformer/cp.py: contiguous, interleaved,
zigzag); each rank's attention forward + backward of the all-gather family
(cp_kernels.allgather_forward / _backward: its queries against every token's gathered keys
and values, in query blocks that stop at the causal frontier) is run in turn on this one
process, one BLAS thread, so the ranks' times compare as if each had its own core. The
collectives are not run: what is measured is the compute a rank brings to the reduce-scatter
that follows its attention backward, where the others wait for the slowest.

Printed per (model width, T) and split, per rank: the time (the thread's CPU time, so a
shared machine's other jobs taking the core do not count; min over --repeats, after one
warm-up step per rank), time / mean,
idle = slowest - own; the exact causal work (key <= query pairs per batch row and head),
work / mean, and the idle it predicts (the work gap at the split's measured ms per pair).
Then per split the slowest / mean of both, and the pairs the kernels compute (masked pairs
inside a query block included). With causal attention the contiguous split's last rank
does about (2N-1)/N of the mean work; interleaved and zigzag stay near 1.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":
    # One BLAS thread, set before NumPy loads (the proxies package pins threads on import
    # and keeps a user's setting): ranks are run in turn, each as if on its own core.
    sys.path.insert(0, ROOT)  # this checkout's proxies
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS"):
        os.environ[var] = "1"
    os.environ["PROXIES_KERNEL_THREADS"] = "1"

import numpy as np  # noqa: E402

from proxies.core import cli  # noqa: E402
from proxies.transformer import cp  # noqa: E402
from proxies.transformer import cp_kernels as K  # noqa: E402
from proxies.transformer.config import PRESETS  # noqa: E402

PROG = "cp_balance"


def _list(kind):
    def parse(text: str) -> list:
        return [kind(x) for x in text.split(",")]

    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        type=_list(str),
        default=["gpt2-tiny", "gpt2"],
        help="presets whose widths (C, NH) are measured, comma-separated (default gpt2-tiny,gpt2)",
    )
    p.add_argument(
        "--seq-len",
        type=_list(cli.positive_int),
        default=[1024, 4096],
        help="sequence lengths T, comma-separated (default 1024,4096)",
    )
    p.add_argument(
        "--cp", type=cli.positive_int, default=4, help="context-parallel ranks N (default 4)"
    )
    p.add_argument("--batch", type=cli.positive_int, default=1, help="micro-batch B (default 1)")
    p.add_argument(
        "--repeats", type=cli.positive_int, default=3, help="timed repeats, min taken (default 3)"
    )
    p.add_argument(
        "--block",
        type=cli.positive_int,
        default=K.BLOCK_Q,
        help=f"queries per block of the all-gather kernels (default {K.BLOCK_Q})",
    )
    return p


def check(args: argparse.Namespace) -> None:
    """Every impossible combination, before any work: one line, exit 2."""
    for name in args.model:
        if name not in PRESETS:
            raise cli.UsageError(f"--model: unknown model {name!r}; one of {', '.join(PRESETS)}")
    for T in args.seq_len:
        for split in cp.SPLITS:
            try:
                cp.validate(split, args.cp, T)
            except ValueError as e:
                raise cli.UsageError(f"--seq-len {T}: {e}") from None


class Rank:
    """One rank's share of one (width, T, split): its inputs and buffers, made once."""

    def __init__(self, qkv, kv, dout, pos, NH: int, block: int) -> None:
        B, _, C3 = qkv.shape
        self.pos, self.NH, self.block, self.kv = pos, NH, block, kv
        self.qkv = np.ascontiguousarray(qkv[:, pos])
        self.dout = np.ascontiguousarray(dout[:, pos])
        self.out = np.empty_like(self.dout)
        self.att = np.empty(K.att_size(pos, B, NH, block), np.float32)
        self.dqkv = np.empty_like(self.qkv)
        self.dkv = np.empty_like(kv)

    def step(self) -> float:
        """CPU seconds of one attention forward + backward (one BLAS thread: all on this
        thread; wall time on a shared 2-core machine swung 2x between runs)."""
        t = time.thread_time()
        K.allgather_forward(self.out, self.att, self.qkv, self.kv, self.pos, self.NH, self.block)
        K.allgather_backward(
            self.dqkv, self.dkv, self.dout, self.qkv, self.kv, self.att, self.pos, self.NH,
            self.block, fresh=True,
        )  # fmt: skip
        return time.thread_time() - t


def measure(model: str, T: int, args: argparse.Namespace) -> None:
    cfg = PRESETS[model]
    C, NH, N, B = cfg.n_embd, cfg.n_head, args.cp, args.batch
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((B, T, 3 * C), dtype=np.float32)
    dout = rng.standard_normal((B, T, C), dtype=np.float32)
    kv = np.ascontiguousarray(qkv[..., C:])  # what the all-gather leaves on every rank
    best: dict[str, list[float]] = {}
    for split in cp.SPLITS:
        ranks = [Rank(qkv, kv, dout, p, NH, args.block) for p in cp.positions(split, N, T)]
        best[split] = [np.inf] * N
        for rank in ranks:  # warm-up: the first touches of its buffers
            rank.step()
        for _ in range(args.repeats):
            for i, rank in enumerate(ranks):
                best[split][i] = min(best[split][i], rank.step())
        del ranks
    print(f"\n{model} width (C={C}, NH={NH}), T={T}, cp {N}, B={B}: attention forward + backward")
    print("  split        rank   ms    time/mean  idle ms   pairs      work/mean  idle ms (work)")
    summary = []
    for split in cp.SPLITS:
        times, work = best[split], cp.work(split, N, T)
        ms_per_pair = sum(times) / sum(work) * 1e3
        for i, ((tr, ti), (wr, wi)) in enumerate(
            zip(cp.imbalance(times), cp.imbalance(work), strict=True)
        ):
            print(
                f"  {split:<12} {i:>4} {times[i] * 1e3:>7.1f} {tr:>8.2f} {ti * 1e3:>9.1f}"
                f"   {work[i]:>9,} {wr:>8.2f} {wi * ms_per_pair:>10.1f}"
            )
        computed = sum(cp.computed_pairs(p, args.block) for p in cp.positions(split, N, T))
        fwd, bwd = cp.attention_flops(sum(work), C, B)
        summary.append(
            f"  {split:<12} slowest/mean: time {max(times) * N / sum(times):.2f},"
            f" work {max(work) * N / sum(work):.3f};"
            f" pairs computed {computed / sum(work):.3f} x exact;"
            f" {(fwd + bwd) / sum(times) / 1e9:.1f} GFLOP/s (exact pairs)"
        )
    print("\n".join(summary))
    print(f"  (2N-1)/N = {(2 * N - 1) / N:.3f}: the contiguous split's last rank, in work")


def machine() -> str:
    blas = os.environ.get("OPENBLAS_NUM_THREADS", "?")
    return (
        f"{platform.machine()}, {os.cpu_count()} cores; NumPy {np.__version__},"
        f" OPENBLAS_NUM_THREADS={blas}; the ranks run in turn on one process"
    )


def run(args: argparse.Namespace) -> int:
    check(args)
    print(f"# {PROG}: {machine()}")
    print(f"# query block {args.block}, min of {args.repeats} repeats per rank")
    for model in args.model:
        for T in args.seq_len:
            measure(model, T, args)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return run(parser().parse_args(argv))
    except cli.UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
