"""Fully sharded data parallelism (ZeRO stage 3, PyTorch FSDP), model-agnostic: where a
plan all-gathers each unit's parameters, frees them, reduce-scatters its gradients and
steps its shard.

A front end cuts its parameters into `ShardUnit`s (a layer, an embedding ...: PyTorch's
fully_shard modules), each flat and padded to a multiple of the shard group's size so every
rank holds an equal shard. It describes one forward or backward pass as `Step`s: an op of
its plan and the units that op reads (uses) or whose gradients it finishes (completes).
`FSDP.pass_ops` lowers a pass, as FSDP2 issues it:

- the first unit's all-gather is posted at the pass's start; before the first step that
  uses unit j, unit j+1's all-gather is posted (prefetch one ahead, forward and backward),
  then Wait(unit j's) and "fsdp_unshard:<key>" (copy the gathered parameters out of the
  gather slot to where the compute reads them); after the last step that uses it,
  "fsdp_reshard:<key>" (free them: reshard_after_forward=True, so the backward gathers
  again). Two gather slots ("fsdp_ag0", "fsdp_ag1"; the collective's mb is the unit's index)
  suffice: at most two gathers are in flight and a slot is free once unshard copied it out;
- with reduce=True (the pass whose gradients are final: the last micro-batch's backward),
  after the step that completes a unit its gradients are reduce-scattered non-blocking
  ("fsdp_rs<slot>", mb = the unit's index), at most `inflight` in flight (the oldest is
  waited first). Hybrid sharding (HSDP, replicas > 1): once a reduce-scatter is waited, the
  reduced shard ("fsdp_rshard", mb = the unit's index) is allreduced over the replica group,
  non-blocking.

`end(extra, optimizer)` waits what is still in flight, runs `extra` (e.g. a tied
embedding's allreduce of its shard) and the optimizer, which steps each rank's shards only.

Per iteration with one micro-batch each unit sends P (n-1)/n twice as all-gathers and once
as a reduce-scatter (P its padded size, n the shard group's size): 3 x the parameters'
bytes x (n-1)/n in all, plus 2 P/n (r-1)/r per unit of the replica allreduces with HSDP.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from proxies.core.plan import Collective, Compute, Op, Wait

SLOTS = 2  # gather slots: the unit in use and the one prefetched
GATHER, SCATTER, REPLICA = "fsdp_allgather", "fsdp_reduce_scatter", "hsdp_allreduce"
SHARD_GROUP, REPLICA_GROUP = "fsdp", "hsdp"


@dataclass(frozen=True)
class ShardUnit:
    """One unit of parameters sharded together: `size` elements before padding."""

    key: str
    size: int

    def padded(self, n: int) -> int:
        """Elements after padding to a multiple of the shard group size n."""
        return -(-self.size // n) * n

    def shard(self, n: int) -> int:
        """Elements of one rank's shard."""
        return self.padded(n) // n


@dataclass(frozen=True)
class Step:
    """One op of a pass, the units it reads and the units whose gradients it finishes."""

    op: Op
    uses: tuple[str, ...] = ()
    completes: tuple[str, ...] = ()


def hsdp_groups(dp_group: Sequence[int], index: int, shard: int) -> tuple[tuple, tuple]:
    """(shard group, replica group) of the rank at `index` in its data-parallel group:
    shard groups are `shard` consecutive dp ranks, replica groups the ranks at the same
    place in every shard group."""
    g = tuple(dp_group)
    start = index // shard * shard
    return g[start : start + shard], g[index % shard :: shard]


class FSDP:
    """The FSDP lowering of one rank's plan. `units`: every unit the rank holds (keys
    unique); `shard`: the shard group's size n; `replicas`: how many shard groups hold
    copies (HSDP; 1: fully sharded); `inflight`: reduce-scatters in flight at once."""

    def __init__(
        self, units: Sequence[ShardUnit], shard: int, replicas: int = 1, inflight: int = 2
    ) -> None:
        if shard < 1 or replicas < 1 or inflight < 1:
            raise ValueError("shard, replicas and inflight must be at least 1")
        self.units = [u for u in units if u.size > 0]
        self.index = {u.key: i for i, u in enumerate(self.units)}
        if len(self.index) != len(self.units):
            raise ValueError("unit keys must be unique")
        self.n, self.replicas, self.inflight = shard, replicas, inflight
        self._passes = 0
        self._rs: list[str] = []  # reduce-scatters in flight, oldest first (unit keys)
        self._ar: list[str] = []  # replica allreduces in flight
        self._reduced: set[str] = set()

    # -- sizes ------------------------------------------------------------------------------

    def padded(self, key: str) -> int:
        return self.units[self.index[key]].padded(self.n)

    @property
    def shard_elements(self) -> int:
        """Elements of all this rank's shards."""
        return sum(u.shard(self.n) for u in self.units)

    @property
    def largest(self) -> int:
        """Elements of the largest gathered (padded) unit."""
        return max((u.padded(self.n) for u in self.units), default=0)

    # -- ops --------------------------------------------------------------------------------

    def _gather(self, key: str, slot: int, tag: int) -> Collective:
        return Collective(
            "allgather",
            SHARD_GROUP,
            f"fsdp_ag{slot}",
            self.padded(key),
            mb=self.index[key],
            req=f"fsdp_ag:{tag}:{key}",
            category=GATHER,
        )

    def _retire(self) -> list[Op]:
        """Wait for the oldest reduce-scatter; with HSDP post its shard's replica allreduce."""
        key = self._rs.pop(0)
        ops: list[Op] = [Wait(f"fsdp_rs:{key}")]
        if self.replicas > 1:
            u = self.units[self.index[key]]
            ops.append(
                Collective(
                    "allreduce",
                    REPLICA_GROUP,
                    "fsdp_rshard",
                    u.shard(self.n),
                    mb=self.index[key],
                    req=f"hsdp:{key}",
                    category=REPLICA,
                )
            )
            self._ar.append(key)
        return ops

    def _scatter(self, key: str) -> list[Op]:
        if key in self._reduced:
            raise ValueError(f"unit {key!r} reduce-scattered twice in one iteration")
        self._reduced.add(key)
        ops = self._retire() if len(self._rs) >= self.inflight else []
        slot = len(self._reduced) % self.inflight  # free: its last user was waited above
        ops.append(
            Collective(
                "reduce_scatter",
                SHARD_GROUP,
                f"fsdp_rs{slot}",
                self.padded(key),
                mb=self.index[key],
                req=f"fsdp_rs:{key}",
                category=SCATTER,
            )
        )
        self._rs.append(key)
        return ops

    def pass_ops(self, steps: Sequence[Step], reduce: bool = False) -> list[Op]:
        """One forward or backward pass with its gathers, frees and (reduce) its gradients'
        reduce-scatters spliced in (see the module docstring)."""
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        for i, s in enumerate(steps):
            for key in s.uses:
                if key not in self.index:
                    raise ValueError(f"step {i} uses unknown unit {key!r}")
                first.setdefault(key, i)
                last[key] = i
        order = sorted(first, key=lambda k: (first[k], self.index[k]))
        tag, self._passes = self._passes, self._passes + 1
        ops: list[Op] = []
        posted = 0

        def post() -> None:
            nonlocal posted
            if posted < len(order):
                ops.append(self._gather(order[posted], posted % SLOTS, tag))
                posted += 1

        post()
        j = 0  # the next unit of `order` to unshard
        for i, s in enumerate(steps):
            while j < len(order) and first[order[j]] == i:
                post()  # prefetch: the next unit's gather overlaps this one's compute
                ops.append(Wait(f"fsdp_ag:{tag}:{order[j]}"))
                ops.append(Compute(f"fsdp_unshard:{order[j]}", self.index[order[j]]))
                j += 1
            ops.append(s.op)
            ops += [Compute(f"fsdp_reshard:{k}", self.index[k]) for k in order if last[k] == i]
            if reduce:
                for key in s.completes:
                    ops += self._scatter(key)
        return ops

    def end(self, extra: Sequence[Op] = (), optimizer: Compute | None = None) -> list[Op]:
        """Wait the reduce-scatters and replica allreduces still in flight, then `extra` and
        the optimizer (on this rank's shards). Every unit must have been reduced once."""
        missing = [u.key for u in self.units if u.key not in self._reduced]
        if missing:
            raise ValueError(f"units never reduce-scattered: {', '.join(missing)}")
        ops: list[Op] = []
        while self._rs:
            ops += self._retire()
        ops += [Wait(f"hsdp:{key}") for key in self._ar]
        self._ar, self._reduced = [], set()
        return ops + list(extra) + [optimizer if optimizer is not None else Compute("optimizer")]


# -- memory a unit gives back -------------------------------------------------------------
# A rank holds a unit's parameters in full only while the unit is gathered (and its
# unsharded gradients only until their reduce-scatter). A front end whose compute reads
# fixed views of one flat array keeps the array and gives a freed range's pages back to the
# OS: the array is private anonymous memory, and MADV_DONTNEED on a range's whole pages
# drops them (they read as zeros and cost nothing until written again).

PAGE = mmap.PAGESIZE


def anonymous(n: int, dtype) -> np.ndarray:
    """n zeros of `dtype` in private anonymous memory of their own (pages appear as written;
    `release` gives them back)."""
    dt = np.dtype(dtype)
    # MAP_PRIVATE: a shared anonymous mapping keeps its pages in shmem after DONTNEED
    mm = mmap.mmap(-1, max(n * dt.itemsize, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(mm, dtype=dt, count=n)


def release(arr: np.ndarray, lo: int, hi: int) -> tuple[int, int]:
    """Give the whole pages of arr[lo:hi] back to the OS (arr from `anonymous`, or a view of
    one): they read as zeros afterwards. The partial pages at the ends, shared with the
    neighbouring ranges, are left as they are. Returns (a, b): arr[a:b] was given back
    (a == b: nothing, the range spans no whole page)."""
    base = arr
    while isinstance(base, np.ndarray):  # a view's base chain ends at the mmap's buffer
        base = base.base
    base = base.obj if isinstance(base, memoryview) else base
    if not isinstance(base, mmap.mmap):
        raise ValueError("release needs an array from fsdp.anonymous")
    origin = np.frombuffer(base, dtype=np.uint8).__array_interface__["data"][0]
    start = arr[lo:hi].__array_interface__["data"][0] - origin
    end = start + (hi - lo) * arr.itemsize
    first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE
    if last <= first:
        return lo, lo
    base.madvise(mmap.MADV_DONTNEED, first, last - first)
    step = arr.itemsize
    return lo + (first - start) // step, lo + (last - start) // step
