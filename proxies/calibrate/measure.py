"""What calibrate measures. Every function is collective: all ranks of `comm` call it.

Timing discipline: MPI.Wtime, warm-ups before timed repetitions, the median of the
repetitions; where several ranks take part, the slowest rank's time. Ranks with nothing to
do wait in a yielding barrier (test and sleep), so on a node with more ranks than cores
they leave the cores to the ranks that measure.

Cold buffers: a proxy's messages leave from and arrive in memory the caches lost long ago
(an iteration touches far more than they hold), and on a CPU node that halves what a
message of a MiB moves per second (1 MiB exchanged both ways between 2 cores: 82 us from
cached buffers, 184 us from evicted ones, measured here). So every repetition of the
messages and collectives below uses the next slice of an arena larger than the last-level
cache (`Arena`), not the same cached buffer again.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import numpy as np

from proxies.core import pages


def sig(x: float, digits: int = 4) -> float:
    """x to `digits` significant digits: how the machine file records a measured figure."""
    return float(f"{x:.{digits}g}")


TAG = 31000  # below the collectives' tags (32000+), away from the proxies' small ones

# 8 B .. 32 MiB by 4, then 64 MiB; quick: 8 B .. 2 MiB by 8
PINGPONG_SIZES = [8 * 4**k for k in range(12)] + [64 << 20]
QUICK_PINGPONG_SIZES = [8 * 8**k for k in range(7)]


def _caches() -> list[tuple[int, int]]:
    """(bytes, CPUs sharing it) of each of cpu0's caches (Linux sysfs; none where
    unreadable, one CPU where the sharing list is)."""
    import glob

    out = []
    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            text = open(f"{d}/size").read().strip().upper()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if not digits.isdigit():
            continue
        cpus = 0
        try:
            for part in open(f"{d}/shared_cpu_list").read().strip().split(","):
                lo, _, hi = part.partition("-")
                if lo.isdigit():
                    cpus += int(hi) - int(lo) + 1 if hi.isdigit() else 1
        except OSError:
            pass
        out.append((int(digits) * unit, max(cpus, 1)))
    return out


def cache_bytes() -> int:
    """The largest CPU cache this process may use (Linux sysfs; 32 MiB where unreadable)."""
    return max((size for size, _ in _caches()), default=32 << 20)


def cache_share() -> int:
    """The largest CPU cache's bytes per CPU that shares it (the whole 32 MiB assumed by
    cache_bytes where sysfs is unreadable)."""
    size, cpus = max(_caches(), default=(32 << 20, 1))
    return size // cpus


class Arena:
    """Buffers for timed repetitions that are not in the caches: rep k of a size gets the
    k-th slice of a touched array of 2 x the largest cache (or of the size, if larger), so
    a slice comes back only after the whole arena has been through the caches since."""

    def __init__(self, largest: int, dtype=np.uint8) -> None:
        self.dtype = np.dtype(dtype)
        span = max(2 * cache_bytes(), largest)
        self.data = pages.zeros(span // self.dtype.itemsize, self.dtype)  # as a run's buffers
        self.data[...] = 1  # touched
        self.next = 0

    def take(self, nbytes: int) -> np.ndarray:
        """The next slice of nbytes (whole elements, at least one), page aligned."""
        n = max(1, nbytes // self.dtype.itemsize)
        step = -(-n * self.dtype.itemsize // 4096) * 4096 // self.dtype.itemsize
        if self.next + n > self.data.size:
            self.next = 0
        out = self.data[self.next : self.next + n]
        self.next += step
        return out


def pingpong_reps(size: int, quick: bool) -> int:
    """Round trips per size: many for small messages (their times are short and noisy)."""
    reps = int(min(200, max(5, 2**24 // max(size, 1))))
    return max(3, reps // 8) if quick else reps


PINGPONG_PASSES = 3  # a calibration's round trips per size, spread over this many sweeps


def pingpong(
    comm, MPI, idle_barrier: Callable[[], None], a: int, b: int, sizes: Sequence[int], quick: bool
) -> list[tuple[int, float]]:
    """One-way seconds per message size between ranks a and b: the median round trip / 2
    (blocking Send/Recv on uppercase buffers, a cold slice of an Arena every round trip).
    The round trips of each size are split over PINGPONG_PASSES sweeps through the sizes
    (one with quick), each with two round trips of warm-up per size: a passing disturbance
    of the machine then touches a part of every size's round trips, not all of one size's.
    Here (2 ranks, 2-core VM, MPICH) ten single sweeps fitted 17.4 to 19.4 GB/s, six of
    three pooled sweeps 18.6 to 19.1 GB/s, at the same total of round trips."""
    r = comm.rank
    times: dict[int, list[float]] = {size: [] for size in sizes}
    passes = 1 if quick else PINGPONG_PASSES
    if r in (a, b):
        peer = b if r == a else a
        arena = Arena(max(sizes))  # touched: no page faults in the timing
        for _ in range(passes):
            for size in sizes:
                reps = -(-pingpong_reps(size, quick) // passes)
                for i in range(2 + reps):
                    view = arena.take(size)
                    if r == a:
                        t0 = MPI.Wtime()
                        comm.Send(view, dest=peer, tag=TAG)
                        comm.Recv(view, source=peer, tag=TAG)
                        if i >= 2:
                            times[size].append((MPI.Wtime() - t0) / 2)
                    else:
                        comm.Recv(view, source=peer, tag=TAG)
                        comm.Send(view, dest=peer, tag=TAG)
    out = [(size, statistics.median(times[size])) for size in sizes] if r == a else []
    idle_barrier()
    return comm.bcast(out, root=a)


def fit_hockney(points: Sequence[tuple[int, float]]) -> tuple[float, float, list[float]]:
    """(latency, bandwidth, relative residuals) of t = latency + bytes / bandwidth.

    Least squares on the relative error (each equation divided by its measured time), so
    8 B and 64 MiB weigh alike: an absolute fit would let the large sizes decide the
    latency alone. Residual = (fitted - measured) / measured, per size."""
    s = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    design = np.column_stack([1 / t, s / t])
    (alpha, inv_bw), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if inv_bw <= 0:  # no growth with size (cannot happen with MiB messages): largest size
        inv_bw = t[-1] / s[-1]
    if alpha <= 0:  # bandwidth explains even the smallest message: keep what it leaves
        alpha = max(float(np.min(t - s * inv_bw)), float(np.min(t)) * 1e-3)
    fitted = alpha + s * inv_bw
    return float(alpha), float(1 / inv_bw), [float(x) for x in (fitted - t) / t]


def kernel_rate(
    comm, MPI, barrier: Callable[[], None], fn: Callable[[], object], work: float, reps: int
) -> list[float]:
    """work / seconds of fn() on every rank at once (the contention runs see): one warm-up,
    a barrier so the ranks start together, `reps` timed calls; each rank's median rate,
    gathered (index = rank)."""
    fn()
    barrier()
    times = []
    for _ in range(reps):
        t0 = MPI.Wtime()
        fn()
        times.append(MPI.Wtime() - t0)
    return comm.allgather(work / statistics.median(times))


MATMUL_SHAPES = [(256, 768, 768), (256, 768, 3072), (1024, 1024, 1024)]  # GPT-2 124M widths
QUICK_MATMUL_SHAPES = [(128, 256, 256), (256, 256, 1024)]


def matmul_rates(comm, MPI, barrier, shapes, reps: int) -> list[tuple[tuple, list[float]]]:
    """FLOP/s of np.matmul (float32, 2mkn FLOPs) per shape (m, k, n), per rank."""
    out = []
    rng = np.random.default_rng(comm.rank)
    for m, k, n in shapes:
        x = rng.standard_normal((m, k), dtype=np.float32)
        w = rng.standard_normal((k, n), dtype=np.float32)
        y = np.empty((m, n), dtype=np.float32)

        def fn(x=x, w=w, y=y):
            return np.matmul(x, w, out=y)

        rates = kernel_rate(comm, MPI, barrier, fn, 2 * m * k * n, reps)
        out.append(((m, k, n), rates))
    return out


def copy_rates(comm, MPI, barrier, nbytes: int, reps: int) -> list[float]:
    """Bytes read + written per second by np.copyto of nbytes (a copy moves 2 x nbytes,
    STREAM's convention), per rank."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.zeros_like(src)
    return kernel_rate(comm, MPI, barrier, lambda: np.copyto(dst, src), 2 * src.nbytes, reps)


def add_rates(comm, MPI, barrier, nbytes: int, reps: int) -> list[float]:
    """Bytes of received data added per second: np.add(acc, recv, out=acc) on nbytes of
    float32, as a reduction step adds a received block into its own, per rank."""
    acc = np.zeros(nbytes // 4, dtype=np.float32)
    recv = np.zeros_like(acc)  # zeros: repeated sums stay finite; an add costs the same
    return kernel_rate(comm, MPI, barrier, lambda: np.add(acc, recv, out=acc), acc.nbytes, reps)


ALLREDUCE_SIZES = [8, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
QUICK_ALLREDUCE_SIZES = [8, 64 << 10]


def allreduce_measurements(
    comm,
    MPI,
    sizes: Sequence[int] = ALLREDUCE_SIZES,
    algorithms: Sequence[str] | None = None,
    *,
    reps: int = 5,
    warmup: int = 2,
    wait: Callable | None = None,
    barrier: Callable[[], None] | None = None,
    ranks_per_node: int | None = None,
) -> dict[str, list[tuple[int, float]]]:
    """Seconds per in-place float32 allreduce (sum) of each algorithm of
    proxies.collectives at each size (bytes per rank) on the whole of `comm`:
    {alg: [(bytes, seconds), ...]}. Per size and algorithm: `warmup` untimed calls, then
    `reps` calls each started after a barrier and timed alone; a call's time is the slowest
    rank's, the figure the median over calls. Algorithms alternate within a size, so load
    that drifts touches them alike. `wait` (e.g. the engine's Waiter.waitall) completes
    requests, None for MPI's blocking waits; ranks_per_node is for hier."""
    from proxies.core.collectives import ALGORITHMS, allreduce

    algs = list(algorithms or ALGORITHMS)
    barrier = barrier or comm.Barrier
    arena = Arena(max(sizes), np.float32)
    arena.data[...] = 0  # zeros: repeated sums stay finite
    out: dict[str, list[tuple[int, float]]] = {a: [] for a in algs}
    for size in sizes:
        for alg in algs:

            def call(buf, alg=alg):
                allreduce(comm, buf, alg, wait=wait, ranks_per_node=ranks_per_node)

            seconds = cold_calls(comm, MPI, call, arena.take, size, reps, warmup, barrier)
            out[alg].append((max(1, size // 4) * 4, seconds))  # the slices' bytes
    return out


def slowest(comm, MPI, call: Callable[[], object], barrier: Callable[[], None]) -> float:
    """One call after a barrier, timed on every rank of comm: the slowest rank's seconds."""
    barrier()
    t0 = MPI.Wtime()
    call()
    return comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX)


def cold_calls(comm, MPI, call, take: Callable, nbytes: int, reps: int, warmup: int, barrier):
    """call(take(nbytes)) each time (Arena.take: a fresh slice, cold, as a proxy's buffers
    are): `warmup` untimed, then the median of `reps` timed by slowest()."""
    for _ in range(warmup):
        call(take(nbytes))
    times = []
    for _ in range(reps):
        buf = take(nbytes)
        times.append(slowest(comm, MPI, lambda buf=buf: call(buf), barrier))
    return statistics.median(times)


ALLTOALL_SIZES = [64 << 10, 1 << 20, 16 << 20, 32 << 20, 64 << 20]  # the whole array per rank
QUICK_ALLTOALL_SIZES = [64 << 10]


def mpi_alltoall(
    comm,
    MPI,
    sizes: Sequence[int] = ALLTOALL_SIZES,
    *,
    reps: int = 5,
    warmup: int = 2,
    wait: Callable | None = None,
    barrier: Callable[[], None] | None = None,
    untouched: bool = False,
) -> list[tuple[int, float]]:
    """Seconds per MPI_Alltoall of float32 arrays of each size (bytes per rank, the whole
    array, in comm.size equal blocks), as the proxies' embedding and expert exchanges call
    it: out of place, into a buffer kept across calls (the engine's pooled receive buffer),
    from a cold buffer (a fresh arena slice each call) or, `untouched`, from one never
    written (a runtime's send buffer without real compute: every page the kernel's zero
    page, so reading it moves no memory): [(bytes, seconds)], each the slowest rank's, the
    median of `reps` after `warmup`. `wait`: Ialltoall completed by it instead."""
    barrier = barrier or comm.Barrier
    n = comm.size
    most = max(max(s // 4 // n, 1) * n for s in sizes)
    if untouched:
        never = pages.zeros(most, np.float32)
        take = lambda nbytes: never[: nbytes // 4]  # noqa: E731
    else:
        take = Arena(4 * most, np.float32).take
    kept = pages.zeros(most, np.float32)
    kept[...] = 0  # touched: the pool's buffer has been received into before
    out = []
    for size in sizes:
        count = max(size // 4 // n, 1) * n

        def call(buf):
            recv = kept[: buf.size]
            if wait is None:
                comm.Alltoall(buf, recv)
            else:
                wait([comm.Ialltoall(buf, recv)])

        seconds = cold_calls(comm, MPI, call, take, count * 4, reps, warmup, barrier)
        out.append((count * 4, seconds))
    return out


# -- fresh memory: MPI's temporaries above glibc's mmap threshold ----------------------------

PAGE = 4096
FRESH_SIZES = [16 << 20, 24 << 20, 32 << 20, 48 << 20, 64 << 20]  # around glibc's 32 MiB cap
QUICK_FRESH_SIZES = [16 << 20, 48 << 20]


def _minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def mpi_fresh(comm, MPI, sizes: Sequence[int], reps: int) -> list[tuple[int, float]]:
    """Per size (bytes per rank) of an in-place float32 MPI_Allreduce: bytes of fresh memory
    faulted in per call (minor page faults x 4 KiB, counted with getrusage around calls on
    warm buffers after one warm-up call, the median of `reps`, the most of any rank). Near
    zero while MPI's temporary is reused heap; about what the call receives into it once
    the temporary is a new mapping every call (glibc serves allocations above its mmap
    threshold, at most 32 MiB on 64-bit, with fresh mappings)."""
    whole = pages.zeros(max(sizes) // 4, np.float32)
    out = []
    for size in sizes:
        buf = whole[: size // 4]
        for _ in range(2):  # warm-up: glibc raises its threshold, the heap settles
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        faults = []
        for _ in range(reps):
            comm.Barrier()
            f0 = _minor_faults()
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            faults.append((_minor_faults() - f0) * PAGE)
        out.append((size, comm.allreduce(statistics.median(faults), op=MPI.MAX)))
    return out


def fresh_above(points: Sequence[tuple[int, float]]) -> int | None:
    """The size above which MPI's temporaries are fresh: the largest measured size whose
    calls faulted in less than an eighth of the message, below the first that faulted in
    more (None: no measured size did; half the smallest size when even that faulted, the
    threshold then lies below what was measured and that is said in the file)."""
    below = None
    for size, faulted in points:
        if faulted > size / 8:
            return below if below is not None else size // 2
        below = size
    return None


def _mallopt(param: int, value: int) -> bool:
    """glibc's mallopt; False where there is none (not glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)))
    except (OSError, AttributeError):
        return False


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def mpi_fault_rate(comm, MPI, size: int, faulted: float, reps: int) -> dict | None:
    """The rate at which MPI's own temporaries fault in, from MPI itself: an in-place
    MPI_Allreduce of `size` bytes (per rank) timed as glibc serves it (a fresh mapping every
    call, `faulted` bytes of faults), then again after mallopt moves the mmap threshold
    above it and stops heap trimming (the temporary is then reused heap, no faults):
    faulted / (the first time - the second). Medians of `reps` calls, slowest rank. Ends
    with glibc's thresholds raised in this process: call it last. None without glibc's
    mallopt or when the difference is not positive (noise)."""
    buf = pages.zeros(size // 4, np.float32)

    def timed() -> float:
        for _ in range(2):
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        times = []
        for _ in range(reps):
            comm.Barrier()
            t0 = MPI.Wtime()
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            times.append(comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX))
        return statistics.median(times)

    fresh = timed()
    ok = _mallopt(M_MMAP_THRESHOLD, 1 << 30) and _mallopt(M_TRIM_THRESHOLD, 1 << 30)
    if not comm.allreduce(ok, op=MPI.LAND):
        return None
    heap = timed()
    f0 = _minor_faults()
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    left = comm.allreduce((_minor_faults() - f0) * PAGE, op=MPI.MAX)
    out = {"bytes": size, "fresh_s": fresh, "heap_s": heap, "heap_faulted": left}
    if fresh <= heap or faulted <= 0:
        return out | {"rate": None}
    return out | {"rate": faulted / (fresh - heap)}


def fault_rates(comm, MPI, barrier: Callable[[], None], nbytes: int, reps: int) -> list[float]:
    """Bytes per second at which fresh memory is faulted in, per rank, every rank at once:
    the time to fill a new anonymous mapping of nbytes (4 KiB pages, as glibc's mmap gives
    MPI) minus the time to fill the same bytes already mapped."""
    import mmap

    warm = np.ones(nbytes, dtype=np.uint8)

    def fresh() -> None:
        m = mmap.mmap(-1, nbytes)
        a = np.frombuffer(m, dtype=np.uint8)
        a.fill(1)
        del a
        m.close()

    fill = lambda: warm.fill(1)  # noqa: E731
    fresh_s = [nbytes / r for r in kernel_rate(comm, MPI, barrier, fresh, nbytes, reps)]
    warm_s = [nbytes / r for r in kernel_rate(comm, MPI, barrier, fill, nbytes, reps)]
    return [nbytes / max(f - w, 1e-9) for f, w in zip(fresh_s, warm_s, strict=True)]


# -- how late a yielding wait's sleeps end ------------------------------------------------------


def sleep_overshoot(comm, MPI, reps: int) -> float:
    """Seconds a time.sleep of the yielding waits' lengths (20 us .. 1 ms) lasts longer than
    asked, every rank of `comm` at once (the kernel's timer slack, the wake-up): the median
    over lengths and repetitions per rank, then over ranks."""
    import time

    from proxies.core.waiting import sleep_lengths

    lengths = sleep_lengths()
    comm.Barrier()
    over = []
    for _ in range(reps):
        for d in lengths:
            t0 = time.perf_counter()
            time.sleep(d)
            over.append(time.perf_counter() - t0 - d)
    return statistics.median(comm.allgather(statistics.median(over)))


# -- the engine's own cost per op --------------------------------------------------------------


class TinyRuntime:
    """A runtime of 1-element buffers ("r" receives, any other name sends or reduces) and
    no compute: only the engine's own work."""

    def __init__(self) -> None:
        self.x = np.zeros(1, dtype=np.float32)
        self.r = np.zeros(1, dtype=np.float32)

    def buffer(self, name: str, mb: int, chunk: int) -> np.ndarray:
        return self.r if name == "r" else self.x

    def compute(self, op, iteration: int) -> None:
        pass

    def finish_iteration(self, iteration: int) -> tuple[float, int]:
        return 0.0, 0


def engine_overhead(comm, MPI, ops: int, iters: int, wait: str, kinds: bool = False):
    """Seconds the engine spends of its own per plan op, as a run books them (overhead =
    an iteration's time less its ops' own), run through the real engine on `comm` with the
    runs' wait mode and the watchdog's bookkeeping (its texts, no timer): the median over
    iterations (after one warm-up) of the slowest rank. Returns (per op of a mixed plan,
    {kind: per op} where `kinds`, else {}). The mixed plan: `ops` ops, cycles of a
    non-blocking 1-element allreduce, two empty computes under it (the engine tests what
    is pending after each op, as under the proxies' overlapped gradients), its Wait and a
    blocking 1-element allreduce. One plan per kind (machine.OVERHEAD_KINDS): empty
    computes; blocking batches, each rank of `comm` sending 1 element to the next and
    receiving one from the previous; blocking 1-element allreduces; non-blocking ones
    waited for at once (the start and the Wait each an op)."""
    from proxies.core.plan import P2P, Collective, Compute, Msg, Wait

    cycle = (
        Collective("allreduce", "world", "x", 1, req="q"),
        Compute("forward"),
        Compute("forward"),
        Wait("q"),
        Collective("allreduce", "world", "x", 1),
    )
    mixed = _own_per_op(comm, MPI, cycle * max(1, ops // 5), iters, wait)
    if not kinds:
        return mixed, {}
    ahead, behind = neighbours(comm, MPI)
    to, back = Msg(ahead, 7, "x", 0, 1), Msg(behind, 7, "r", 0, 1)
    batch = P2P("x", sends=(to,), recvs=(back,))
    plans = {
        "compute": (Compute("forward"),) * ops,
        "exchange": (batch,) * ops,
        "collective": (Collective("allreduce", "world", "x", 1),) * ops,
        "nonblocking": (Collective("allreduce", "world", "x", 1, req="q"), Wait("q"))
        * max(1, ops // 2),
    }
    return mixed, {kind: _own_per_op(comm, MPI, p, iters, wait) for kind, p in plans.items()}


def neighbours(comm, MPI) -> tuple[int, int]:
    """The world ranks of this rank's next and previous rank in `comm` (collective): the
    engine's messages name world ranks, so a plan on a split communicator needs them."""
    world = comm.allgather(MPI.COMM_WORLD.rank)
    return world[(comm.rank + 1) % comm.size], world[(comm.rank - 1) % comm.size]


def engine_iterations(comm, MPI, ops: tuple, runtime, iters: int, wait: str, mode: str):
    """`ops` as this rank's plan over group "world" (all of `comm`), run through the real
    engine with the watchdog's bookkeeping (its texts, no timer): one warm-up and `iters`
    timed iterations, each after a barrier. Returns the timed iterations' IterationTimes."""
    from proxies.core.engine import Engine
    from proxies.core.mpi import Watchdog
    from proxies.core.plan import Plan

    plan = Plan(comm.rank, ops, {"world": tuple(range(comm.size))})
    watchdog = Watchdog(comm, "calibrate", 0)  # its texts as a run has them; no thread
    engine = Engine(MPI, plan, runtime, {"world": comm}, mode=mode, wait=wait, watchdog=watchdog)
    times = []
    try:
        for i in range(1 + iters):
            comm.Barrier()
            t = engine.run_iteration(i)
            if i:
                times.append(t)
    finally:
        engine.close()
    return times


def _own_per_op(comm, MPI, ops: tuple, iters: int, wait: str) -> float:
    times = engine_iterations(comm, MPI, ops, TinyRuntime(), iters, wait, "model")
    per_op = [(t.total - t.booked()) / len(ops) for t in times]
    return comm.allreduce(max(0.0, statistics.median(per_op)), op=MPI.MAX)
