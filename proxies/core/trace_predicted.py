"""--dry-run --machine FILE --trace FILE.json: the predicted iteration as a timeline.

The same format and tracks as a measured trace (trace.py), drawn from the prediction's
per-op spans (predict.py, keep_spans): computes; point-to-point batches with their waits for
their messages to exist (idle, together) nested at their start; blocking collectives with
their wait for the group's last member nested; a non-blocking collective's or P2P batch's
time in flight as an async span and its Wait as a slice; after its last op, each rank's wait
for the slowest. Self times per category are the predicted breakdown (a --slow-link hold
stays inside its batch).

Which ranks: --trace-ranks (world ranks), else the simulated ranks up to trace.MAX_RANKS.
Where the prediction folds identical ranks (predict.py), a rank that was not simulated is
drawn as its representative's timeline with its own peers, and its process name says so.
"""

from __future__ import annotations

from collections import defaultdict

from proxies.core import trace
from proxies.core.plan import P2P, Collective, Compute
from proxies.core.predict import Prediction


def document(job, args, pred: Prediction, note: str) -> dict:
    """The trace of one predicted iteration (times from 0, in the machine's seconds)."""
    world = job.grid.size
    rep_of = pred.rep_of
    if getattr(args, "trace_ranks", None) is not None:
        ranks = trace.ranks_of(args.trace_ranks, world)
    else:
        ranks = sorted(pred.spans)[: trace.MAX_RANKS]
    tracks = []
    shown_as = {}
    for r in ranks:
        src = int(rep_of[r]) if rep_of is not None else r
        shown_as[str(r)] = src
        tracks.append(_track(job, pred, r, src))
    meta = {
        "proxy": job.proxy,
        "kind": "predicted",
        "prediction": note,
        "world_size": world,
        "iteration_s": pred.time,
        "ranks": ranks,
        # world rank -> the simulated rank whose timeline it shows (itself unless folded)
        "shown_as": shown_as,
        "caps": {
            "iterations": 1,
            "ranks": f"--trace-ranks or the first {trace.MAX_RANKS} simulated",
        },
        "config": job.config,
    }
    return trace.document(tracks, meta)


def _track(job, pred: Prediction, rank: int, src: int) -> dict:
    name = trace.process_name(rank, job.grid.coords(rank))
    if src != rank:
        name += f" (as rank {src}: identical ranks simulated once)"
    tr = trace.Track(rank, name, rank)
    spans = sorted(pred.spans[src], key=lambda s: (s[0], s[1]))
    # The rank's own plan: its peers (an image's differ from its representative's), and its
    # point-to-point batches in plan order, the order a rank (blocked in each) runs them.
    plan = job.plan(rank)
    batches = iter([op for op in plan.ops if isinstance(op, P2P) and not op.req])
    # non-blocking batches by request: an in-flight span and a wait slice, as a
    # non-blocking collective's (no flow arrows: posting one takes no time, so no slice)
    own = {op.req: op for op in plan.ops if isinstance(op, P2P) and op.req}
    counts: dict[tuple, int] = defaultdict(int)

    def us(t: float) -> float:
        return t * 1e6

    tr.slice("iterations", "iteration (predicted)", trace.ITERATION, 0.0, us(pred.time))
    for t0, t1, op, idle in spans:
        if isinstance(op, Compute):
            tr.slice(
                "compute",
                trace.compute_name(op),
                op.category,
                us(t0),
                us(t1),
                op=op.name,
                mb=op.mb,
                chunk=op.chunk,
                flops=op.flops,
            )
        elif isinstance(op, P2P) and op.req:
            thread, name, args = trace.nonblocking(own[op.req], plan.groups)
            if idle is None:
                tr.span(f"{name} in flight", op.category + "_hidden", us(t0), us(t1), **args)
            else:
                tr.slice(thread, f"wait {name}", op.category, us(t0), us(t1), **args)
        elif isinstance(op, P2P):
            mine = next(batches)
            senders = ",".join(dict.fromkeys(str(m.peer) for m in mine.recvs))
            wait = [(us(t0), us(t0 + idle), senders)] if idle > 0 else []
            tr.p2p(mine, us(t0), us(t1), wait)
            nudge = min((t1 - t0) / 2, 1e-9)  # strictly inside the batch's slice
            for m in mine.sends:
                k = counts[rank, m.peer, m.tag]
                counts[rank, m.peer, m.tag] += 1
                tr.flow(
                    (rank, m.peer, m.tag, k),
                    "s",
                    trace.p2p_thread(mine.category),
                    us(t0 + idle + nudge),
                )
            for m in mine.recvs:
                k = counts[m.peer, rank, m.tag]
                counts[m.peer, rank, m.tag] += 1
                tr.flow(
                    (m.peer, rank, m.tag, k), "f", trace.p2p_thread(mine.category), us(t1 - nudge)
                )
        elif isinstance(op, Collective):
            n = len(plan.groups[op.group])
            if not op.req:
                tr.collective(op, us(t0), us(t1), us(idle), n)
            elif idle is None:
                tr.span(
                    f"{op.kind} {op.buf} in flight",
                    op.category + "_hidden",
                    us(t0),
                    us(t1),
                    **trace.coll_args(op, n),
                )
            else:
                tr.slice(
                    f"group {op.group}",
                    f"wait {op.kind} {op.buf}",
                    op.category,
                    us(t0),
                    us(t1),
                    **trace.coll_args(op, n),
                )
    end = pred.finish[src]
    if pred.time > end:
        tr.slice("compute", "waiting for the slowest rank", "idle", us(end), us(pred.time))
    return {"events": tr.events, "flows": tr.flows, "rank": rank}


def write(job, args, pred: Prediction, note: str) -> bool:
    """Write the predicted trace to --trace (atomically, as --json); False when nothing
    could be written."""
    return trace.write(args.trace, document(job, args, pred, note), job.prog)
