"""Run under mpiexec by tests/transformer/test_cp_mpi.py: several runs of the GPT proxies in
one MPI process group (one start-up for many context-parallel configurations).

Arguments: OUT_DIR, then runs separated by "--": each PROG (gpt2 | gpt3 | llama | bert) and
its argv. Run k writes OUT_DIR/k.json (its --json); a run whose job building fails writes
OUT_DIR/k.error with the message (rank 0)."""

import os
import sys

import numpy as np

from proxies.bert import proxy as bert
from proxies.core import cli, mpi, runner
from proxies.gpt2 import proxy as gpt2
from proxies.gpt3 import proxy as gpt3
from proxies.llama import proxy as llama

MPI = mpi.init()
world = MPI.COMM_WORLD
out_dir, rest = sys.argv[1], sys.argv[2:]
runs, cur = [], []
for a in rest + ["--"]:
    if a == "--":
        if cur:
            runs.append(cur)
        cur = []
    else:
        cur.append(a)
for k, (prog, *argv) in enumerate(runs):
    mod = {"gpt2": gpt2, "gpt3": gpt3, "llama": llama, "bert": bert}[prog]
    args = mod.parser().parse_args([*argv, "--json", os.path.join(out_dir, f"{k}.json")])
    try:
        job = mod.make_job(args, world.size)
    except cli.UsageError as e:
        if world.rank == 0:
            with open(os.path.join(out_dir, f"{k}.error"), "w") as f:
                f.write(str(e))
        continue
    code = runner.run(job, args, MPI)
    if code:
        print(f"run {k} ({prog} {' '.join(argv)}): exit {code}", file=sys.stderr, flush=True)
        world.Abort(code)
    np.seterr(all="warn")
