"""What every algorithm shares: block boundaries, the 1-D view, waiting, scratch, tags.

Blocks: a buffer of `count` elements over n ranks is cut as np.array_split cuts it, the
first count % n blocks one element longer. Blocks may be empty (count < n, count 0); the
algorithms still send them (a zero-length message), so every rank runs the same steps.

Large counts: messages are numpy slices of the caller's buffer; past 2^31 - 1 elements
mpi4py 4 calls MPI-4's large-count routines (MPI_Isend_c ...) by itself, so nothing here
chunks for MPI's int counts.

16-bit floats (bf16, fp16) travel as their uint16 words (`words`); the algorithms add them
with NumPy, which widens to float32 and rounds each sum back (see proxies.core.wire).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from proxies.core import pages
from proxies.core.wire import transport as words  # noqa: F401  (re-exported)

# Tags at the top of the range MPI guarantees (MPI_TAG_UB >= 32767), away from the small
# tags proxies use for their own messages. Each module adds its own offset.
TAG = 32000

Wait = Callable[[list], object]


def bounds(count: int, n: int) -> list[int]:
    """Offsets of n blocks: block i is [off[i], off[i+1]) (np.array_split boundaries)."""
    q, rem = divmod(count, n)
    return [i * q + min(i, rem) for i in range(n + 1)]


def flat(buf: np.ndarray) -> np.ndarray:
    """The buffer as a 1-D view; results must land in the caller's memory."""
    if not buf.flags.c_contiguous:
        raise ValueError("collectives work in place: the buffer must be C-contiguous")
    return buf.reshape(-1)


def waitall(wait: Wait | None) -> Wait:
    """The caller's wait (e.g. the engine's Waiter.waitall), or MPI's blocking Waitall."""
    if wait is not None:
        return wait
    from mpi4py import MPI  # already imported by whoever built the communicator

    return MPI.Request.Waitall


_scratch: dict[tuple[str, int], np.ndarray] = {}


def scratch(size: int, dtype, slot: int = 0) -> np.ndarray:
    """A reusable receive buffer of `size` elements: allocated once per (dtype, slot) and
    grown when a larger call comes, so the hot loops never allocate (or page-fault)."""
    key = (np.dtype(dtype).str, slot)
    buf = _scratch.get(key)
    if buf is None or buf.size < size:
        buf = _scratch[key] = pages.zeros(max(size, 1), dtype)
    return buf[:size]
