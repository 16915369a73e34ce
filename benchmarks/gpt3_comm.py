"""GPT-3 communication only, at the C++ proxy's sizes: the Python proxy's time per iteration
with --compute none, to set beside a C++ run of the same pattern.

    python benchmarks/gpt3_comm.py                      # the configs below, on this machine
    python benchmarks/gpt3_comm.py --config 8:2 --compute model --iters 5

The pattern of spcl/DNN-cpp-proxies proxies/gpt3.cpp: GPT-3 175B widths, micro-batch 1,
sequence 2048, one layer per pipeline stage, 2 x STAGES micro-batches, all forwards then all
backwards, tensor parallel 4 (every message B*T*C = 25,165,824 floats; per micro-batch and
layer two allreduces forward and two backward), rank order stage-fastest, and the layers'
weights allreduced over data parallelism at the end (452,984,832 floats a layer shard). The
proxy runs it as

    mpiexec -n N python -m proxies.gpt3 S S --tp 4 --micro-batch 1 --seq-len 2048 \\
        --micro-batches 2S --schedule gpipe --layers-only --compute none --json out.json

(--layers-only: no embedding, LM head or loss, which the C++ proxy does not have; its DP
bucket also carries the layer's biases and layernorms, 0.02% more.) A config "N:S" is N
ranks and S stages; N must be a multiple of 4 * S, DP = N / (4 * S).

The C++ side, on a machine with a C++ MPI compiler (its source is not part of this repo):

    git clone https://github.com/spcl/DNN-cpp-proxies && cd DNN-cpp-proxies
    mpicxx -O3 -o gpt3 proxies/gpt3.cpp
    mpirun -n 8 ./gpt3 2 2          # STAGES (= layers) and micro-batches / STAGES

It always sleeps its A100 compute times (15,915 us forward, 31,830 us backward per layer):
compare it with this script's --compute model (the proxy's default --device-tflops
reproduces exactly those times), or remove its usleep calls and compare with --compute none.
It prints the mean over 128 iterations after 8 warm-up ones; this script prints the median
and mean over --iters after --warmup.

Measured on the 2-core dev box (MPICH 5.0.2 wheel, load average 7 to 10 from other jobs, so
+-15%), seconds per iteration, mean of 3 after 1 warm-up, --compute none:

    ranks:stages   proxy --wait yield   proxy --wait spin   C, same pattern, blocking MPI
    4:1            1.85                 2.54                2.15 - 2.38
    8:2            7.39 - 8.15          10.90               9.49 - 10.26

(C: a 60-line C program with the same messages, MPI_THREAD_MULTIPLE, written for this
comparison, not the C++ proxy. The messages are 100 MB: the Python overhead, a few us per
call, is lost in the noise; yield waits win here because 4-8 ranks share 2 cores.)
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's proxies (cli's option types), as the runs use
CONFIGS = ["4:1", "8:2"]  # fit a 2-core, 23 GB machine: ~0.5 GB of buffers per rank


def mpiexec() -> str:
    found = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if not found:
        sys.exit("gpt3_comm: mpiexec not found (activate the venv)")
    return found


def run(ranks: int, stages: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = [
            mpiexec(), "-n", str(ranks), sys.executable, "-m", "proxies.gpt3",
            str(stages), str(stages), "--tp", "4", "--micro-batch", "1", "--seq-len", "2048",
            "--micro-batches", str(2 * stages), "--schedule", "gpipe", "--layers-only",
            "--compute", args.compute, "--iters", str(args.iters), "--warmup", str(args.warmup),
            "--wait", args.wait, "--quiet", "--json", out,
        ]  # fmt: skip
        print("#", " ".join(cmd[3:]), flush=True)
        proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stderr=subprocess.PIPE)
        try:
            _, err = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            sys.exit(f"gpt3_comm: timed out after {args.timeout} s")
        if proc.returncode:
            sys.exit(f"gpt3_comm: the proxy failed:\n{err.decode()}")
        with open(out) as f:
            return json.load(f)


def parser() -> argparse.ArgumentParser:
    from proxies.core import cli

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config",
        action="append",
        metavar="RANKS:STAGES",
        help=f"ranks and stages, repeatable (default {' '.join(CONFIGS)})",
    )
    p.add_argument("--compute", choices=("none", "model"), default="none")
    p.add_argument("--iters", type=cli.positive_int, default=3, help="timed iterations (default 3)")
    p.add_argument(
        "--warmup", type=cli.nonneg_int, default=1, help="untimed iterations (default 1)"
    )
    p.add_argument("--wait", choices=("auto", "spin", "yield"), default="auto")
    p.add_argument(
        "--timeout",
        type=cli.number(min=0, open_min=True, max=cli.TIMEOUT_MAX_S),  # a subprocess limit
        default=1800,
        help=f"per run, seconds, at most {cli.TIMEOUT_MAX_S:g}",
    )
    return p


def main() -> None:
    args = parser().parse_args()
    rows = []
    for spec in args.config or CONFIGS:
        ranks, stages = (int(x) for x in spec.split(":"))
        if ranks % (4 * stages):
            sys.exit(f"gpt3_comm: {spec}: ranks must be a multiple of 4 x stages")
        r = run(ranks, stages, args)
        t = r["iter_time_s"]
        parts = {k: statistics.fmean(v) for k, v in r["breakdown_s"].items()}
        rows.append((spec, ranks // (4 * stages), t, parts, r["config"]["wait"]))
    cats = ["tp_allreduce", "pp", "dp_allreduce", "compute", "idle", "overhead"]
    print(f"# gpt3 comm pattern of the C++ proxy, compute {args.compute}, seconds per iteration")
    print(
        f"# {'ranks:stages':>12} {'dp':>3} {'median':>8} {'mean':>8} "
        + " ".join(f"{c:>12}" for c in cats)
        + "  waits"
    )
    for spec, dp, t, parts, wait in rows:
        print(
            f"  {spec:>12} {dp:>3} {statistics.median(t):8.3f} {statistics.fmean(t):8.3f} "
            + " ".join(f"{parts.get(c, 0.0):12.3f}" for c in cats)
            + f"  {wait}"
        )


if __name__ == "__main__":
    main()
