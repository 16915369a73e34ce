"""Every rank's plan of a transformer front end run in lockstep in this process, each
collective emulated with NumPy: the in-process form of "distributed equals one process"
(tests/gpt3, tests/llama, tests/bert and the FSDP tests use it)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from proxies.core.plan import Collective, Compute, Wait


def emulate_collective(op: Collective, bufs: list[np.ndarray]) -> None:
    """What MPI would leave in each member's buffer (members in group-rank order)."""
    n = len(bufs)
    blocks = [b.reshape(n, -1) if op.kind != "allreduce" else b for b in bufs]
    if op.kind == "allreduce":
        total = np.sum([b.astype(np.float64) for b in bufs], axis=0)
        for b in bufs:
            b[...] = total
    elif op.kind == "allgather":
        mine = np.stack([blocks[i][i] for i in range(n)])
        for b in blocks:
            b[...] = mine
    elif op.kind == "reduce_scatter":
        total = np.sum([b.astype(np.float64) for b in blocks], axis=0)
        for i, b in enumerate(blocks):
            b[i] = total[i]
    elif op.kind == "alltoall":
        sent = [b.copy() for b in blocks]
        for j, b in enumerate(blocks):
            for i in range(n):
                b[i] = sent[i][j]
    else:
        raise NotImplementedError(op.kind)


def run(
    make_job: Callable, parser: Callable, argv: list[str], world: int, iters: int = 2,
    stop_at_optimizer: bool = False,
) -> tuple[list[float], list]:  # fmt: skip
    """Run every rank's plan in lockstep (pipeline stages = 1: every rank has the same op
    sequence). Returns (mean loss per iteration, runtimes); with stop_at_optimizer, stops
    before the first optimizer step."""
    job = make_job(parser().parse_args(argv), world)
    plans = [job.plan(r) for r in range(world)]
    assert len({len(p.ops) for p in plans}) == 1
    rts = [job.runtime(r, None, None, "real") for r in range(world)]
    losses = []
    for it in range(iters):
        for i, op in enumerate(plans[0].ops):
            if isinstance(op, Compute):
                if stop_at_optimizer and op.name == "optimizer":
                    return losses, rts
                for r in range(world):
                    rts[r].compute(plans[r].ops[i], it)
            elif isinstance(op, Collective):
                for members in {plans[r].groups[op.group] for r in range(world)}:
                    emulate_collective(op, [rts[q].buffer(op.buf, op.mb, 0) for q in members])
            else:
                assert isinstance(op, Wait), op  # non-blocking ones ran when posted
        sums = [rt.finish_iteration(it) for rt in rts]
        losses.append(sum(s for s, _ in sums) / sum(n for _, n in sums))
    return losses, rts
