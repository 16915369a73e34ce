"""One training iteration of one rank, as data.

A Plan is an ordered tuple of ops. The same object is executed (engine.py), printed
(`--dry-run`), checked for deadlock and message matching without MPI (simulate.py), and
timed op by op (the breakdown). A proxy is a function from (model, parallel config, rank)
to a Plan.

Conventions
- Point-to-point peers are world ranks. Collectives name a group ("dp", "tp", "embed" ...);
  `Plan.groups[name]` lists that group's world ranks, in group-rank order.
- Buffers are named: (buf, mb) is resolved to a NumPy array by the proxy's runtime, so a
  plan never holds data. `count` is in elements of `dtype`; Python ints, so 64-bit safe.
- A P2P op is a batch: its sends and receives are posted together and it completes when all
  of them have (Megatron's batch_isend_irecv). Two neighbours that exchange in the same step
  must put both directions in one batch, or synchronous sends deadlock.
- A Collective or a P2P batch with `req` set is non-blocking: it starts there (a batch posts
  its Isends and Irecvs) and completes at the Wait with the same `req`; until then its
  buffers are the transfer's (simulate.py refuses a plan that touches them). Without `req`
  it blocks.
- `category` names the breakdown bucket the op's time and bytes go to ("pp", "dp_allreduce").
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from proxies.core.wire import numpy_dtype

COLLECTIVE_KINDS = ("allreduce", "allgather", "reduce_scatter", "alltoall", "bcast", "reduce")
# alltoallv: blocks of any size, known only at run time (data-dependent, e.g. the ids each
# rank sends to each row-wise shard's owner). `count` is what this rank sends, which the plan
# knows; the runtime supplies the buffers and per-peer counts (see engine.Runtime.alltoallv).
COLLECTIVE_KINDS += ("alltoallv",)


def itemsize(dtype: str) -> int:
    return numpy_dtype(dtype).itemsize


def block_range(count: int, n: int, i: int) -> tuple[int, int]:
    """[lo, hi) of block i of n of a collective's whole array (reduce_scatter, allgather,
    alltoall): sizes differ by at most one, the larger first, as np.array_split."""
    q, r = divmod(count, n)
    lo = i * q + min(i, r)
    return lo, lo + q + (i < r)


@dataclass(frozen=True)
class Compute:
    """Local work: a forward or backward of one micro-batch, an optimizer step ..."""

    name: str  # "forward", "backward", "optimizer"
    mb: int = -1  # micro-batch, -1 when the op is not per micro-batch
    chunk: int = 0  # model chunk (virtual stage) for interleaved schedules
    flops: float = 0.0  # floating-point operations, for compute=model
    seconds: float = 0.0  # compute=model duration when known (e.g. measured on a GPU)
    category: str = "compute"

    def model_seconds(self, rate: float) -> float:
        """compute=model: the known duration, else flops at `rate` FLOP/s."""
        return self.seconds if self.seconds else self.flops / rate


@dataclass(frozen=True)
class Span:
    """A buffer key naming the flat range [lo, hi) of a runtime's array `name` (a gradient
    bucket's part of the flat gradient buffer): the runtime slices it, nothing parses it.
    Prints as "name:lo:hi" in plans, logs and goldens."""

    name: str
    lo: int
    hi: int

    def __str__(self) -> str:
        return f"{self.name}:{self.lo}:{self.hi}"

    @property
    def count(self) -> int:
        return self.hi - self.lo


# A buffer key: a name the runtime resolves (with the micro-batch), or a Span of one.
Buf = str | Span


@dataclass(frozen=True)
class Msg:
    """One side of a point-to-point message."""

    peer: int  # world rank on the other side
    tag: int
    buf: Buf  # buffer name, e.g. "act" (activation) or "grad" (activation gradient)
    mb: int  # micro-batch the buffer belongs to
    count: int  # elements
    dtype: str = "float32"
    chunk: int = 0

    @property
    def nbytes(self) -> int:
        return self.count * itemsize(self.dtype)


@dataclass(frozen=True)
class P2P:
    """Sends and receives posted together and completed together."""

    name: str  # "send_forward", "recv_backward", "send_forward_recv_backward" ...
    sends: tuple[Msg, ...] = ()
    recvs: tuple[Msg, ...] = ()
    category: str = "pp"
    req: str = ""  # non-empty: non-blocking, posted here and completed by Wait(req)

    @property
    def nbytes_sent(self) -> int:
        return sum(m.nbytes for m in self.sends)

    @property
    def nbytes_recv(self) -> int:
        return sum(m.nbytes for m in self.recvs)

    @property
    def nbytes(self) -> int:
        """Bytes the batch moves on this rank: its sends and its receives."""
        return self.nbytes_sent + self.nbytes_recv


@dataclass(frozen=True)
class Collective:
    """A collective over a named group. `count` is the whole array (nccl-tests convention)."""

    kind: str  # one of COLLECTIVE_KINDS
    group: str  # key into Plan.groups
    buf: Buf
    count: int
    dtype: str = "float32"
    mb: int = -1
    req: str = ""  # non-empty: non-blocking, completed by Wait(req)
    category: str = ""  # default: "<group>_<kind>"
    # allgather / reduce_scatter: the blocks are whole units of `unit` elements (sizes
    # differing by at most one unit), e.g. one unit per dense column of B samples when a
    # layer's columns are split unevenly; 1 = any element boundary.
    unit: int = 1

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVE_KINDS:
            raise ValueError(f"unknown collective kind {self.kind!r}")
        if self.unit < 1 or self.count % self.unit:
            raise ValueError(f"count {self.count} is not a whole number of units {self.unit}")
        if not self.category:
            object.__setattr__(self, "category", f"{self.group}_{self.kind}")

    @property
    def nbytes(self) -> int:
        return self.count * itemsize(self.dtype)


@dataclass(frozen=True)
class Wait:
    """Complete the non-blocking op (collective or P2P batch) started with the same `req`."""

    req: str
    category: str = ""


Op = Compute | P2P | Collective | Wait


@dataclass(frozen=True)
class Plan:
    rank: int
    ops: tuple[Op, ...]
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    coords: dict[str, int] = field(default_factory=dict)  # e.g. {"pp": 2, "dp": 1}

    def messages(self):
        """(op, msg, direction) for every point-to-point message, direction "send"/"recv"."""
        for op in self.ops:
            if isinstance(op, P2P):
                for m in op.sends:
                    yield op, m, "send"
                for m in op.recvs:
                    yield op, m, "recv"

    def bytes_by_category(self) -> dict[str, int]:
        """Bytes per category for one iteration of this rank.

        Point-to-point: `<category>_send` and `<category>_recv`; collectives: the array size.
        """
        out: dict[str, int] = {}
        for op in self.ops:
            if isinstance(op, P2P):
                for key, n in (
                    (f"{op.category}_send", op.nbytes_sent),
                    (f"{op.category}_recv", op.nbytes_recv),
                ):
                    if n:
                        out[key] = out.get(key, 0) + n
            elif isinstance(op, Collective):
                out[op.category] = out.get(op.category, 0) + op.nbytes
        return out


def retype(
    plan: Plan,
    dtype: str,
    grad_dtype: str,
    grads: frozenset[str] = frozenset(),
    keep: frozenset[str] = frozenset(),
) -> Plan:
    """The plan with its float32 traffic on the wire dtypes (a lowering pass, --dtype and
    --grad-dtype): ops whose category is in `grads` (gradient reductions) as `grad_dtype`,
    the rest (activations, tensor/sequence/expert-parallel traffic, gathered parameters) as
    `dtype`. Buffers named in `keep` (e.g. loss statistics reduced in float32, as Megatron
    does) and non-float32 messages (integer ids) keep their type."""
    if dtype == grad_dtype == "float32":
        return plan

    def pick(category: str, buf: str, current: str) -> str:
        if current != "float32" or buf in keep:
            return current
        return grad_dtype if category in grads else dtype

    def msgs(category: str, ms: tuple[Msg, ...]) -> tuple[Msg, ...]:
        return tuple(replace(m, dtype=pick(category, m.buf, m.dtype)) for m in ms)

    ops: list[Op] = []
    for op in plan.ops:
        if isinstance(op, Collective):
            op = replace(op, dtype=pick(op.category, op.buf, op.dtype))
        elif isinstance(op, P2P):
            op = replace(op, sends=msgs(op.category, op.sends), recvs=msgs(op.category, op.recvs))
        ops.append(op)
    return replace(plan, ops=tuple(ops))
