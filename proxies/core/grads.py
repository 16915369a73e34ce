"""Gradient-sync lowering, model-agnostic: from where a backward completes which gradients,
the data-parallel reductions a plan posts during it and the ops that end the iteration.

A model front end describes its gradients as flat arrays (`Flat`: one per reduction group,
e.g. GPT-3's dense gradients over dp and expert gradients over edp) and its backward as
`Unit`s in the order the backward completes them (a layer, the embedding ...), each naming
its ranges of those arrays. `GradSync` then answers, as data the plan builder splices in:

- after(unit keys): the non-blocking allreduces of the buckets those units close (with a
  Wait first when the in-flight cap is reached), policy "buckets" only;
- end(extra): the rest of the iteration's gradient sync, `extra` (other reductions the
  optimizer needs: a tied embedding, sequence-parallel partial sums) and the optimizer.

Policies: fused (one allreduce of each flat array after the backward), per-tensor (one per
parameter tensor), buckets (consecutive units closed at a size, posted as soon as their
last unit is done: PyTorch DDP, Megatron's overlap_grad_reduce; size 0: each unit posted
on its own, as CosmoFlow's and DLRM's per-layer allreduces), zero1 (ZeRO stage 1:
reduce-scatter, the optimizer on this rank's shard, allgather of the parameters).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from proxies.core.plan import Collective, Compute, Op, Span, Wait

POLICIES = ("fused", "per-tensor", "buckets", "zero1")


@dataclass(frozen=True)
class Flat:
    """A flat gradient array of the runtime, reduced over `group`.

    Bucket keys: span=True, one allreduce per contiguous range, keyed Span(name, lo, hi)
    (the runtime slices it) and requests numbered per allreduce; span=False, one allreduce
    per bucket, keyed `name` with the bucket index as its micro-batch (the runtime looks the
    range up) and requests numbered by bucket; whole=True (over span), one allreduce per
    bucket keyed `name` alone: the runtime's array is the bucket (CosmoFlow's conv layers,
    DLRM's MLP layers: one array, one unit each), numbered per allreduce.

    Requests are `req` formatted with {group} and {n} (the number above): "<group><n>" by
    default; a name without {n} suits a flat posted once (a repeat in flight is an error)."""

    name: str
    group: str
    size: int  # elements
    category: str = ""  # default "<group>_allreduce"
    span: bool = True
    tensors: tuple[tuple[str, int], ...] = ()  # per-tensor: (buffer key, elements) each
    params: str = "params"  # zero1: the parameter array allgathered after the step
    whole: bool = False
    req: str = "{group}{n}"

    def request(self, n: int) -> str:
        return self.req.format(group=self.group, n=n)


@dataclass(frozen=True)
class Unit:
    """Gradients complete at the same point of the backward: (flat name, lo, hi) ranges.
    A bucket never spans two segments (e.g. two model chunks of an interleaved schedule)."""

    key: Hashable
    ranges: tuple[tuple[str, int, int], ...]
    segment: int = 0

    @property
    def size(self) -> int:
        return sum(hi - lo for _, lo, hi in self.ranges)


@dataclass(frozen=True)
class Bucket:
    units: tuple[Unit, ...]
    ranges: dict[str, list[tuple[int, int]]] = field(hash=False)  # merged, per flat


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted [lo, hi) ranges with adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def buckets(units: Sequence[Unit], size: float) -> list[Bucket]:
    """Runs of consecutive units, closed once they hold `size` elements (0: every unit), at
    a segment's end, or at the last unit."""
    out: list[Bucket] = []
    current: list[Unit] = []
    for i, u in enumerate(units):
        current.append(u)
        nxt = units[i + 1] if i + 1 < len(units) else None
        if sum(x.size for x in current) >= size or nxt is None or nxt.segment != u.segment:
            per: dict[str, list[tuple[int, int]]] = {}
            for x in current:
                for name, lo, hi in x.ranges:
                    per.setdefault(name, []).append((lo, hi))
            out.append(Bucket(tuple(current), {k: merge_ranges(v) for k, v in per.items()}))
            current = []
    return out


class GradSync:
    """The gradient sync of one rank's plan. `flats`: the arrays to reduce (leave out those
    whose group has one rank: nothing to reduce); `bucket`: elements that close a bucket;
    `inflight`: buckets in flight at once (0: no limit)."""

    def __init__(
        self,
        policy: str,
        flats: Sequence[Flat],
        units: Sequence[Unit] = (),
        bucket: float = 0,
        inflight: int = 0,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown gradient sync policy {policy!r}")
        self.policy, self.flats, self.inflight = policy, {f.name: f for f in flats}, inflight
        self.buckets = buckets(units, bucket) if policy == "buckets" else []
        self._closes: dict[Hashable, list[int]] = {}
        for k, b in enumerate(self.buckets):
            self._closes.setdefault(b.units[-1].key, []).append(k)
        self._counter = {name: 0 for name in self.flats}
        self._pending: list[str] = []  # requests in flight, oldest first

    @property
    def overlaps(self) -> bool:
        """Whether anything is posted during the backward (a plan splits it only then)."""
        return bool(self.buckets and self.flats)

    def bucket_ops(self, k: int) -> list[Collective]:
        """Bucket k's allreduces (not yet posted; they number their requests as posted)."""
        out = []
        for name, rs in self.buckets[k].ranges.items():
            f = self.flats.get(name)
            if f is None:
                continue
            cat = f.category or f"{f.group}_allreduce"
            if f.span and not f.whole:
                for lo, hi in rs:
                    req = f.request(self._counter[name])
                    self._counter[name] += 1
                    out.append(
                        Collective(
                            "allreduce", f.group, Span(name, lo, hi), hi - lo, req=req, category=cat
                        )
                    )
                continue
            count = sum(hi - lo for lo, hi in rs)
            if not count:
                continue
            if f.whole:
                req = f.request(self._counter[name])
                self._counter[name] += 1
                out.append(Collective("allreduce", f.group, name, count, req=req, category=cat))
            else:
                out.append(
                    Collective(
                        "allreduce", f.group, name, count, mb=k, req=f.request(k), category=cat
                    )
                )
        return out

    def after(self, keys: Iterable[Hashable]) -> list[Op]:
        """The ops to post once the units `keys` are complete: the allreduces of every bucket
        they close, each after a Wait for the oldest in flight when the cap is reached."""
        ops: list[Op] = []
        for key in keys:
            for k in self._closes.get(key, ()):
                for coll in self.bucket_ops(k):
                    if coll.req in self._pending:
                        raise ValueError(f"request {coll.req!r} posted twice before its Wait")
                    if self.inflight and len(self._pending) >= self.inflight:
                        ops.append(Wait(self._pending.pop(0)))
                    ops.append(coll)
                    self._pending.append(coll.req)
        return ops

    def end(self, extra: Sequence[Op] = (), optimizer: Compute | None = None) -> list[Op]:
        """After the backward: complete the gradient sync, then `extra` (other reductions the
        optimizer needs), then the optimizer (`optimizer`: the front end's op, with its
        work; a bare Compute("optimizer") by default). ZeRO-1 runs `extra` first: its shards
        split the arrays those reductions write."""
        step = optimizer if optimizer is not None else Compute("optimizer")
        flats = list(self.flats.values())
        if self.policy == "zero1" and flats:
            ops: list[Op] = list(extra)
            ops += [Collective("reduce_scatter", f.group, f.name, f.size) for f in flats]
            ops.append(step)
            ops += [Collective("allgather", f.group, f.params, f.size) for f in flats]
            return ops
        ops = []
        if self.policy == "fused":
            ops += [Collective("allreduce", f.group, f.name, f.size) for f in flats]
        elif self.policy == "per-tensor":
            ops += [
                Collective("allreduce", f.group, key, count)
                for f in flats
                for key, count in f.tensors
            ]
        ops += [Wait(req) for req in self._pending]
        self._pending = []
        return ops + list(extra) + [step]
