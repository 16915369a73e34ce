"""--check: what a received message or a collective's result must hold, and the bound it
guarantees.

Point-to-point: the receiver compares the crc32 of what arrived with the crc32 the sender
computed before sending (sent beside it on a duplicate communicator).

Copies (n = group size, the whole array cut into n `blocks`), compared by crc32:
- allgather: block i of the result has the crc32 rank i's block had before;
- alltoall: block i of the result has the crc32 of the block rank i addressed to us;
- bcast: the result has the root's crc32;
- alltoallv: as alltoall, with the blocks the runtime's per-peer counts cut (`before_v`).
A crc32 per block, indexed by position, catches any change of a block's bytes (a NaN, a
flipped bit, two blocks or two elements swapped) except with probability 2^-32, and always
a change confined to 32 consecutive bits.

Reductions (allreduce, reduce, reduce_scatter). The result y of n inputs x^r cannot be
compared bit for bit: its rounding depends on the order MPI adds in. So each rank cuts the
result into check blocks of B = BLOCK elements (in reduce_scatter, within each rank's block)
and each input rank ships, per check block b, five float64 numbers in one extra reduction
(Allreduce, Reduce to the root, Reduce_scatter), summed over ranks:
  T_b = sum_{i in b} w_i x_i,  M_b = sum_{i in b} w_i |x_i|,  P_b = max_{i in b} |x_i|,
  and x_s, |x_s| at one sampled position s of the block (`_samples`);
with weights w_i in [1, 2) that depend on the position in the block only: distinct multiples
of 1/B in a golden-ratio order, so neighbours differ by at least 0.38 (`WEIGHTS`). Let
eps be the wire dtype's machine epsilon (2^-23 float32, 2^-10 fp16, 2^-7 bf16), sig its
smallest subnormal, W_b = sum_{i in b} w_i, and
  tol_b = n eps M_b + n sig W_b + 2^-36 M_b     (block),
  tol_s = n eps |x_s| + n sig + 2^-36 |x_s|    (sample; sums over ranks).
A correct result holds |sum_{i in b} w_i y_i - T_b| <= tol_b and |y_s - x_s| <= tol_s:
summing n values in any order errs by at most gamma_{n-1} = (n-1)u/(1-(n-1)u) times the sum
of their magnitudes (Higham, Accuracy and Stability, eq. 4.4; u = eps/2, one rounding per
addition, or for bf16/fp16 a float32 addition rounded to 16 bits: proxies.core.wire, u
then eps/2 (1 + 2^-15)), plus
half a subnormal per addition, plus float64 rounding below 2^-40 M_b; while (n-1)u <= 1/3
(n <= 2.8 million for float32, 683 for fp16, 86 for bf16) that is at most tol. Guaranteed,
per group of n ranks:
1. No false alarm on a correct result, under the condition above.
2. Any single element of block b changed by more than 2 tol_b <= 4n (eps A_b + sig B) + 2^-34
   A_b is caught, where A_b is the sum of |inputs| over the block's B elements and the n
   ranks (the tolerance depends on that block alone, not the buffer's size). More generally
   any change e of the result with |sum_{i in b} w_i e_i| > 2 tol_b in some block; and any
   change of a sampled element by more than 2 tol_s.
3. NaN or inf: any non-finite element in a block whose inputs were finite is caught (unless
   (1 + n eps) sum_r P_b reaches the dtype's largest value, where a true sum may overflow);
   a block whose inputs already held NaN or inf must come out non-finite (else caught) and
   is otherwise not judged: that is the training's fault, not the transport's, and a real
   run ends with its non-finite loss.
4. A lost (or doubled) contribution of rank r is a change e = -x^r (or +x^r): caught when
   |sum_{i in b} w_i x^r_i| > 2 tol_b in some block, or at some sample |x^r_s| > 2 tol_s.
   The first holds for float32 in practice (mean-zero data: ~sqrt(B) |x| against
   ~B n^2 eps |x|); with 16-bit wires tol_b is large, and the samples catch it: any of them
   where rank r's value exceeds ~2 n eps times the sum of the n magnitudes there.
5. Permutations: a value moved to another block changes that block (2.); two elements of
   one block exchanged change it by (w_a - w_c)(y_c - y_a), with |w_a - w_c| >= 1/B (0.38
   for neighbours); a sampled element replaced by one differing by more than 2 tol_s is
   caught. Swapped blocks of any size are caught by the block sums (float32) or the samples
   (16-bit wires) unless their contents agree within those bounds.
And every rank holds identical bytes (allreduce: an allgather of the result's crc32s).
Cost: O(size) local work in float64 chunks (no Python loop per element or block), one extra
reduction of 5 doubles per 4096 elements (40 bytes per 16 KiB of float32), and for allreduce
an allgather of one crc32 per rank. The extra collectives are why --check runs are not for
timing.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np

from proxies.core import wire

REDUCTIONS = ("allreduce", "reduce", "reduce_scatter")
BLOCK = 1 << 12  # elements per check block of a reduction

# w_j = 1 + (j K mod B) / B: B distinct values in [1, 2); K odd (so coprime to B) near
# B / golden ratio, so consecutive positions land far apart (three-distance theorem).
_K = int(BLOCK * 0.6180339887) | 1
WEIGHTS = 1.0 + (np.arange(BLOCK, dtype=np.int64) * _K % BLOCK) / BLOCK
_WSUM = np.concatenate([[0.0], np.cumsum(WEIGHTS)])  # _WSUM[L]: weights of an L-block
_ROWS = 256  # check blocks converted to float64 at a time: 8 MiB of scratch
_F64 = 2.0**-36  # float64 rounding of the weighted sums, with margin
_COLS = 5  # T, M, P, x_s, |x_s| per check block


def crc(buf: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(buf).reshape(-1).view(np.uint8))


def checksum(buf: np.ndarray) -> np.ndarray:
    """(crc32, element count) as int64: what a sender ships beside a message."""
    return np.array([crc(buf), buf.size], dtype=np.int64)


def fill(buf: np.ndarray, seed: int) -> None:
    """Content that differs per message, for runs without real compute."""
    rng = np.random.default_rng(seed)
    buf[...] = rng.standard_normal(buf.shape, dtype=np.float32).astype(buf.dtype, copy=False)


def blocks(buf: np.ndarray, n: int, unit: int = 1) -> list[np.ndarray]:
    """The n blocks of a collective's whole array: sizes differ by at most one element (one
    `unit` of elements when unit > 1), the larger ones first (np.array_split), so any count
    works."""
    if unit == 1:
        return np.array_split(buf.reshape(-1), n)
    return [b.reshape(-1) for b in np.array_split(buf.reshape(-1, unit), n)]


@functools.cache
def block_counts(size: int, n: int, unit: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(counts, displacements) of blocks' split of `size` elements over n ranks: worked out
    once per shape (the engine asks on every allgather and reduce-scatter; building the
    views each time took 8 - 16 us a call inside a run)."""
    counts = tuple(b.size for b in blocks(np.empty(size, np.uint8), n, unit))
    return counts, tuple(np.cumsum((0,) + counts[:-1]).tolist())


def uneven(size: int, n: int, unit: int = 1) -> bool:
    """Whether block_counts' blocks differ in size (the v-variants are needed)."""
    counts = block_counts(size, n, unit)[0]
    return counts[0] != counts[-1]


def _f64(x: np.ndarray) -> np.ndarray:
    """x as float64 (exact for every wire dtype, bfloat16 included)."""
    return x.astype(np.float64)


def _samples(first: int, sizes: np.ndarray) -> np.ndarray:
    """One position per check block (offsets within each block), a hash of the block's
    index in the whole buffer: the same on every rank without communication."""
    index = np.arange(first, first + sizes.size, dtype=np.uint64)
    mixed = (index + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)  # wraps: a hash
    return ((mixed >> np.uint64(32)) % np.maximum(sizes, 1).astype(np.uint64)).astype(np.int64)


def _sizes(size: int) -> np.ndarray:
    """Check-block lengths of a segment of `size` elements."""
    full, rest = divmod(size, BLOCK)
    sizes = np.full(full + (rest > 0), BLOCK, dtype=np.int64)
    if rest:
        sizes[-1] = rest
    return sizes


def _stats(x: np.ndarray, first: int, inputs: bool) -> np.ndarray:
    """Per check block of the 1-D segment x (block indices from `first`): the five
    columns of the docstring (inputs), or (sum w y, y_s) of a result."""
    sizes = _sizes(x.size)
    out = np.empty((sizes.size, _COLS if inputs else 2))
    full = x.size // BLOCK
    rows = [(lo, min(lo + _ROWS, full)) for lo in range(0, full, _ROWS)]
    for lo, hi in rows + ([(full, full + 1)] if full < sizes.size else []):
        c = _f64(x[lo * BLOCK : hi * BLOCK]).reshape(hi - lo, -1)
        w = WEIGHTS[: c.shape[1]]
        # einsum, not `c @ w`: BLAS's matrix-vector product was 10x slower here.
        out[lo:hi, 0] = np.einsum("ij,j->i", c, w)
        if inputs:
            np.abs(c, out=c)
            out[lo:hi, 1] = np.einsum("ij,j->i", c, w)
            out[lo:hi, 2] = c.max(axis=1)
    s = np.arange(sizes.size, dtype=np.int64) * BLOCK + _samples(first, sizes)
    picked = _f64(x[s]) if x.size else np.zeros(0)
    out[:, 3 if inputs else 1] = picked
    if inputs:
        out[:, 4] = np.abs(picked)
    return out


def _segments(kind: str, size: int, n: int, unit: int) -> list[tuple[int, int]]:
    """(offset, size) of the parts cut into check blocks: the whole buffer, or each rank's
    block of a reduce_scatter."""
    if kind != "reduce_scatter":
        return [(0, size)]
    q, rem = divmod(size // unit, n)  # as `blocks` cuts (np.array_split of the units)
    sizes = [(q + (i < rem)) * unit for i in range(n)]
    return list(zip(np.cumsum([0] + sizes[:-1]).tolist(), sizes, strict=True))


def _reduction_before(kind: str, n: int, buf: np.ndarray, unit: int) -> np.ndarray:
    flat, parts, first = buf.reshape(-1), [], 0
    for lo, size in _segments(kind, flat.size, n, unit):
        parts.append(_stats(flat[lo : lo + size], first, inputs=True))
        first += parts[-1].shape[0]
    return np.concatenate(parts) if parts else np.empty((0, _COLS))


def before(MPI, kind: str, comm, buf: np.ndarray, unit: int = 1):
    """What to remember of this rank's input, collectively exchanged where needed."""
    n = comm.size
    if kind in REDUCTIONS:
        return _reduction_before(kind, n, buf, unit)  # local: exchanged in verify
    if kind == "allgather":
        mine = np.array([crc(blocks(buf, n, unit)[comm.rank])], dtype=np.int64)
        every = np.empty(n, dtype=np.int64)
        comm.Allgather(mine, every)
        return every
    if kind == "alltoall":
        sent = np.array([crc(b) for b in blocks(buf, n, unit)], dtype=np.int64)
        got = np.empty(n, dtype=np.int64)
        comm.Alltoall(sent, got)  # got[i]: crc of the block rank i addressed to us
        return got
    if kind == "bcast":
        root = np.array([crc(buf)], dtype=np.int64)
        comm.Bcast(root, root=0)
        return root
    raise ValueError(f"no check for collective {kind!r}")


def split(buf: np.ndarray, counts) -> list[np.ndarray]:
    """The blocks of an alltoallv buffer: counts[i] elements for peer i, in order."""
    return np.split(buf.reshape(-1), np.cumsum(counts)[:-1])


def before_v(comm, send: np.ndarray, scounts) -> np.ndarray:
    """alltoallv: got[i] is the crc32 of the block rank i addressed to us."""
    sent = np.array([crc(b) for b in split(send, scounts)], dtype=np.int64)
    got = np.empty(comm.size, dtype=np.int64)
    comm.Alltoall(sent, got)
    return got


def verify_v(recv: np.ndarray, rcounts, state) -> str | None:
    got = [crc(b) for b in split(recv, rcounts)]
    bad = [i for i in range(len(got)) if got[i] != state[i]]
    return f"block {bad[0]} of {len(got)} differs from what rank {bad[0]} sent" if bad else None


def _exchange(MPI, kind: str, comm, state: np.ndarray, unit: int, size: int) -> np.ndarray:
    """The inputs' columns summed over ranks: all blocks (allreduce; reduce, on the root)
    or this rank's (reduce_scatter)."""
    if kind == "reduce_scatter":
        segs = _segments(kind, size, comm.size, unit)
        counts = [_sizes(s).size * _COLS for _, s in segs]
        mine = np.empty(counts[comm.rank])
        comm.Reduce_scatter(np.ascontiguousarray(state).reshape(-1), mine, counts, MPI.SUM)
        return mine.reshape(-1, _COLS)
    total = np.empty_like(state)
    if kind == "reduce":
        comm.Reduce(state, total, MPI.SUM, 0)
    else:
        comm.Allreduce(state, total, MPI.SUM)
    return total


def _judge(
    n: int, dtype: np.dtype, y: np.ndarray, at: int, first: int, ins: np.ndarray
) -> str | None:
    """The docstring's clauses for the segment y (element `at` of the buffer, its check
    blocks numbered from `first`), given the inputs' columns summed over ranks; all blocks
    at once."""
    got = _stats(y, first, inputs=False)
    T, M, P, xs, axs = ins.T
    sizes = _sizes(y.size)
    if np.issubdtype(dtype, np.floating) or wire.is_sixteen(dtype):
        info = wire.finfo(dtype)
        eps, sig, big = float(info.eps), float(info.smallest_subnormal), float(info.max)
    else:  # integers add exactly
        eps, sig, big = 0.0, 0.0, np.inf
    with np.errstate(invalid="ignore", over="ignore"):
        tol = n * eps * M + n * sig * _WSUM[sizes] + _F64 * M
        tol_s = n * eps * axs + n * sig + _F64 * axs
        finite_in, finite_out = np.isfinite(M), np.isfinite(got[:, 0])
        may_overflow = (1 + n * eps) * P >= big
        checks = [
            (
                ~finite_in & finite_out,
                "its inputs held NaN or inf (before the collective) but the result is finite",
            ),
            (finite_in & ~finite_out & ~may_overflow, "non-finite"),
            (finite_in & finite_out & (np.abs(got[:, 0] - T) > tol), "weighted sum"),
            (finite_in & finite_out & (np.abs(got[:, 1] - xs) > tol_s), "sample"),
        ]
    for bad, what in checks:
        if not bad.any():
            continue
        b = int(np.flatnonzero(bad)[0])
        lo = b * BLOCK
        where = (
            f"check block {first + b} (elements {at + lo}..{at + lo + sizes[b] - 1}; "
            f"{int(bad.sum())} of {bad.size} blocks wrong)"
        )
        if what == "non-finite":
            k = lo + int(np.flatnonzero(~np.isfinite(_f64(y[lo : lo + sizes[b]])))[0])
            value = _f64(y[k : k + 1])[0]
            return f"{where}: element {at + k} is {value} though every input was finite"
        if what == "weighted sum":
            return (
                f"{where}: weighted sum of the result {got[b, 0]:.9g}, of the inputs "
                f"{T[b]:.9g} (tolerance {tol[b]:.3g})"
            )
        if what == "sample":
            k = at + lo + int(_samples(first + b, sizes[b : b + 1])[0])
            return (
                f"{where}: element {k} is {got[b, 1]:.9g}, the sum of the inputs {xs[b]:.9g} "
                f"(tolerance {tol_s[b]:.3g})"
            )
        return f"{where}: {what}"
    return None


def verify(MPI, kind: str, comm, buf: np.ndarray, state, unit: int = 1) -> str | None:
    """None if the result is right, else what is wrong. Collective over `comm`: every rank
    makes the same calls whatever it finds, so a rank that finds an error cannot leave the
    others waiting in a check collective."""
    n, r = comm.size, comm.rank
    if kind in REDUCTIONS:
        flat = buf.reshape(-1)
        ins = _exchange(MPI, kind, comm, state, unit, flat.size)
        crcs = np.empty(n, dtype=np.int64)
        if kind == "allreduce":
            comm.Allgather(np.array([crc(flat)], dtype=np.int64), crcs)
        if kind == "reduce" and r != 0:
            return None
        segs = _segments(kind, flat.size, n, unit)
        mine = r if kind == "reduce_scatter" else 0
        lo, size = segs[mine]
        first = sum(_sizes(s).size for _, s in segs[:mine])  # global index of its 1st block
        error = _judge(n, flat.dtype, flat[lo : lo + size], lo, first, ins)
        if error is None and kind == "allreduce" and len(set(crcs.tolist())) != 1:
            error = f"the {n} ranks hold different results (crc32s {sorted(set(crcs.tolist()))})"
        return error
    if kind in ("allgather", "alltoall"):
        got = [crc(b) for b in blocks(buf, n, unit)]
        bad = [i for i in range(n) if got[i] != state[i]]
        if bad:
            return f"block {bad[0]} of {n} differs from what rank {bad[0]} sent"
        return None
    if kind == "bcast":
        if crc(buf) != int(state[0]):
            return "the result differs from the root's buffer"
        return None
    raise ValueError(f"no check for collective {kind!r}")
