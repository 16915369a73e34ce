"""Communication buffers on huge pages: the memory `calibrate` measures on.

Within a node, MPICH (and Open MPI where its shared-memory transport has CMA or XPMEM)
moves a large message with a single copy straight from the sender's memory (Linux CMA:
process_vm_readv), which looks up and pins the sender's pages on every message and
writes through the receiver's page tables. On 4 KiB pages that is a large part of the
cost; on 2 MiB pages it is not. Measured with benchmarks/huge_pages.py (2 ranks, 2-core
VM, MPICH 5.0.2, buffers not in the caches): 2 MiB exchanged both ways took 248-253 us on
np.zeros buffers and 150-154 us on these; an in-place 3.4 MiB MPI_Allreduce 739-755 us
against 388-405 (Open MPI 5.0.11: 244 against 140 us, 711 against 338).

NumPy asks the kernel for huge pages (MADV_HUGEPAGE) only for arrays of 4 MiB and more,
so with np.zeros a run's buffers below 4 MiB got small pages and its larger ones huge
pages, while calibrate's buffers (slices of one large array) were all on huge pages: the
machine file priced every message as if on huge pages, and the runs' messages below 4 MiB
took 1.3-1.9x that. The proxies' communication buffers come from here instead, so runs
and calibration use the same kind of memory, and what a run measures is the network and
the MPI library rather than the kernel's page walks. (Frameworks' buffers live in GPU
memory, where there is no such cost.)

`zeros` carves buffers out of shared anonymous mappings advised MADV_HUGEPAGE, aligned to
2 MiB, so small buffers share huge pages rather than each taking one. A buffer's pages
appear only when first touched, as with np.zeros: a send buffer nothing ever writes reads
as the kernel's zero page. Where the kernel has no transparent huge pages (or THP is
"never"), the advice is ignored and these are plain 4 KiB pages. PROXIES_HUGE_PAGES=off
makes `zeros` plain np.zeros (to compare the two).
"""

from __future__ import annotations

import mmap
import os
import weakref

import numpy as np

HUGE = 2 << 20  # the x86-64 and arm64 (4 KiB base pages) transparent huge page
CHUNK = 32 << 20  # a shared mapping small buffers are carved from
OWN = 4 << 20  # buffers of at least this many bytes get a mapping of their own
SMALL_ALIGN = 64  # a cache line: buffers below a page
PAGE_ALIGN = 4096


def enabled() -> bool:
    """Whether buffers come from advised mappings (else np.zeros)."""
    off = os.environ.get("PROXIES_HUGE_PAGES", "").strip().lower() in ("off", "0", "no")
    return not off and hasattr(mmap, "MADV_HUGEPAGE")


def mapping(nbytes: int) -> np.ndarray:
    """`nbytes` zero bytes (uint8) in a private anonymous mapping of their own, starting on a
    2 MiB boundary and advised MADV_HUGEPAGE where the kernel has it."""
    size = max(nbytes, 1)
    mm = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(mm, dtype=np.uint8)
    skip = -whole.__array_interface__["data"][0] % HUGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without THP: plain pages
            pass
    return whole[skip : skip + size]


class _Carver:
    """Bump allocation from the current shared mapping. Only a weak reference to it is kept
    (to the array over the whole mapping, which every buffer carved from it refers to): it
    is unmapped when the last of those buffers is gone."""

    def __init__(self) -> None:
        self.whole: weakref.ref | None = None
        self.end = 0  # the chunk's end in `whole`
        self.used = 0  # the next free byte in `whole`

    def take(self, nbytes: int) -> np.ndarray:
        align = SMALL_ALIGN if nbytes < PAGE_ALIGN else PAGE_ALIGN
        whole = self.whole() if self.whole is not None else None
        start = -(-self.used // align) * align
        if whole is None or start + nbytes > self.end:
            chunk = mapping(CHUNK)
            whole = chunk.base
            self.whole = weakref.ref(whole)
            start = chunk.__array_interface__["data"][0] - whole.__array_interface__["data"][0]
            self.end = start + chunk.size
        self.used = start + nbytes
        return whole[start : start + nbytes]


_carver = _Carver()


def zeros(shape, dtype=np.float32) -> np.ndarray:
    """np.zeros(shape, dtype) on huge-page-advised memory (see the module docstring)."""
    dt = np.dtype(dtype)
    if not enabled():
        return np.zeros(shape, dtype=dt)
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * dt.itemsize
    raw = mapping(nbytes) if nbytes >= OWN else _carver.take(max(nbytes, 1))
    return raw[:nbytes].view(dt).reshape(shape)


def zeros_like(a: np.ndarray) -> np.ndarray:
    return zeros(a.shape, a.dtype)


def huge_bytes(pid: int | str = "self") -> int | None:
    """Bytes of this process's anonymous memory on transparent huge pages (AnonHugePages in
    /proc/PID/smaps_rollup), or None where the file is not there."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return 0
