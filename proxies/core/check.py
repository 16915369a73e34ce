"""--check: what a received message or a collective's result must hold.

Point-to-point: the receiver compares the crc32 of what arrived with the crc32 the sender
computed before sending (sent beside it on a duplicate communicator).

Collectives, each checked against what the math says (n = group size, `blocks`):
- allreduce: sum_j w_j out_j == sum over ranks of sum_j w_j in_j, for fixed pseudo-random
  weights w, within the rounding bound of the wire dtype (float32, or bf16/fp16 summed in
  float32 and rounded per step: proxies.core.wire); and every rank holds identical bytes;
- reduce_scatter: the same weighted sum, block by block, for this rank's block;
- reduce: the same on the root;
- allgather: block i of the result has the crc32 rank i's block had before;
- alltoall: block i of the result has the crc32 of the block rank i addressed to us;
- bcast: the result has the root's crc32;
- alltoallv: as alltoall, with the blocks the runtime's per-peer counts cut (`before_v`).
The extra collectives on small arrays are why --check runs are not for timing.
"""

from __future__ import annotations

import zlib

import numpy as np

from proxies.core import wire

_WEIGHTS = np.random.default_rng(12345).random(1 << 20) + 0.5  # in [0.5, 1.5)


def crc(buf: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(buf).reshape(-1).view(np.uint8))


def checksum(buf: np.ndarray) -> np.ndarray:
    """(crc32, element count) as int64: what a sender ships beside a message."""
    return np.array([crc(buf), buf.size], dtype=np.int64)


def fill(buf: np.ndarray, seed: int) -> None:
    """Content that differs per message, for runs without real compute."""
    rng = np.random.default_rng(seed)
    buf[...] = rng.standard_normal(buf.shape, dtype=np.float32).astype(buf.dtype, copy=False)


def weighted_sums(x: np.ndarray) -> np.ndarray:
    """(sum w*x, sum w*|x|) in float64; linear in x, so sums of inputs predict the output."""
    flat, out, w = x.reshape(-1), np.zeros(2), _WEIGHTS
    for lo in range(0, flat.size, w.size):
        chunk = flat[lo : lo + w.size].astype(np.float64)
        out += (chunk @ w[: chunk.size], np.abs(chunk) @ w[: chunk.size])
    return out


def blocks(buf: np.ndarray, n: int, unit: int = 1) -> list[np.ndarray]:
    """The n blocks of a collective's whole array: sizes differ by at most one element (one
    `unit` of elements when unit > 1), the larger ones first (np.array_split), so any count
    works."""
    if unit == 1:
        return np.array_split(buf.reshape(-1), n)
    return [b.reshape(-1) for b in np.array_split(buf.reshape(-1, unit), n)]


def before(MPI, kind: str, comm, buf: np.ndarray, unit: int = 1):
    """What to remember of this rank's input, collectively exchanged where needed."""
    n = comm.size
    if kind in ("allreduce", "reduce"):
        return weighted_sums(buf)
    if kind == "reduce_scatter":
        return np.array([weighted_sums(b) for b in blocks(buf, n, unit)])
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


def verify(MPI, kind: str, comm, buf: np.ndarray, state, unit: int = 1) -> str | None:
    """None if the result is right, else what is wrong. Collective over `comm`."""
    n, r = comm.size, comm.rank
    if kind in ("allreduce", "reduce", "reduce_scatter"):
        if kind == "reduce_scatter":
            inputs = np.empty(2)
            comm.Reduce_scatter_block(state, inputs, op=MPI.SUM)
            got = weighted_sums(blocks(buf, n, unit)[r])
        else:
            inputs = np.empty(2)
            comm.Allreduce(state, inputs, op=MPI.SUM)
            got = weighted_sums(buf)
        # Each output element carries at most n-1 roundings of partial sums, and with a
        # 16-bit wire dtype one more when it is stored.
        tol = 2 * n * wire.epsilon(buf.dtype) * inputs[1] + 1e-30
        if kind == "reduce" and r != 0:
            return None
        if abs(got[0] - inputs[0]) > tol:
            return (
                f"weighted sum of the result {got[0]:.9g}, of the inputs {inputs[0]:.9g} "
                f"(tolerance {tol:.3g})"
            )
        if kind == "allreduce":
            crcs = np.empty(n, dtype=np.int64)
            comm.Allgather(np.array([crc(buf)], dtype=np.int64), crcs)
            if len(set(crcs.tolist())) != 1:
                return f"the {n} ranks hold different results (crc32s {sorted(set(crcs.tolist()))})"
        return None
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
