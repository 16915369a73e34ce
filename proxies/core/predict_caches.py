"""The caches in a prediction: what an op costs because of what its rank touched before.

- Reused buffers (`reuse`): a collective MPI runs itself on a buffer its rank used again
  within `reuse.cache` distinct bytes costs `reuse.reread` x per byte (reused_ops).
- Cold code (`cold`): an op after its rank moved bulk data costs the engine and MPI more,
  their code and data brought back into the caches (CacheSim._cold, plan_touched).
"""

from __future__ import annotations

from collections.abc import Callable

from proxies.core.plan import P2P, Collective, Compute, Op, Plan, Wait


def reused_ops(plan: Plan, buffer: Callable[[object, int], object], cache: int) -> frozenset:
    """Indices of the plan's collectives whose buffer (`buffer(name, mb)`) the rank used
    again within `cache` bytes: the distinct bytes of its buffers that messages and
    collectives touched since that buffer's last use, its own included (an LRU stack
    distance). The iteration runs twice, so the first use of a buffer sees the previous
    iteration's; compute touches nothing (none and model)."""
    lru: dict[object, int] = {}  # buffer -> bytes last touched, oldest first
    hot: set[int] = set()
    for second in (False, True):
        for i, op in enumerate(plan.ops):
            if type(op) is Collective:
                touched = ((buffer(op.buf, op.mb), op.nbytes),)
            elif type(op) is P2P:
                touched = tuple((buffer(m.buf, m.mb), m.nbytes) for m in op.sends + op.recvs)
            else:
                continue
            for key, nbytes in touched:
                if second and key in lru and type(op) is Collective:
                    distance = max(lru[key], nbytes)
                    for other in reversed(lru):  # newest first, down to its last use
                        if other == key:
                            hot.add(i)
                            break
                        distance += lru[other]
                        if distance > cache:
                            break
                lru.pop(key, None)
                lru[key] = nbytes
    return frozenset(hot)


def plan_touched(op: P2P | Collective, groups: dict) -> int:
    """Bytes an op reads and writes on its rank, as the machine's `cold` figures count them:
    twice what it sends and receives (a P2P batch its messages; a collective of n bytes
    over p members of the plan's `groups` what a bandwidth-optimal algorithm moves per
    member, (p - 1) / p x n each way, twice that for an allreduce)."""
    if type(op) is P2P:
        return 2 * op.nbytes
    members = len(groups[op.group])
    share = op.nbytes * (members - 1) / max(1, members)
    return int(2 * 2 * share * (2 if op.kind == "allreduce" else 1))


class CacheSim:
    """The predictor's half that prices cold ops (proxies.core.predict._Predictor)."""

    def _cold(self, r: int, op: Op, oh: float) -> tuple[float, float]:
        """(the engine's own seconds for `op`, its blocking MPI calls' extra seconds) after
        the bytes its rank's last communication op touched (a compute op touches nothing
        here and brings no code back for the next one: both pay; a Wait comes after the
        bytes of the op it waits for, moved while it was in flight); notes what this one
        touches."""
        m = self.topo.machine
        if type(op) is Wait:  # its op's data moved before it: it runs cold, and after it
            self.after[r] = max(self.after[r], self.pending[r].pop(op.req, 0))
        b = self.after[r]
        f = min(1.0, b / m.cold_moved) ** m.cold_exponent if b else 0.0
        if type(op) is Compute:
            return oh + m.cold_engine * f, 0.0
        if type(op) is not Wait:
            touched = plan_touched(op, self.plans[r].groups)
            if op.req:  # moved while in flight: counted at its Wait
                self.pending[r][op.req], touched = touched, 0
            self.after[r] = touched
        blocking = type(op) is not Wait and not op.req
        return oh + m.cold_engine * f, m.cold_latency * f if blocking else 0.0
