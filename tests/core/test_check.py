"""--check's guarantees (proxies/core/check.py's docstring), clause by clause: every hole
of the hardening issue injected and caught, and no false alarm on correct results.

In one process: n ranks are n threads sharing a fake communicator that implements the
collectives check.py calls over lists (a barrier with a timeout: a rank that skipped a
call fails the test instead of hanging it). Correct reductions are computed as MPI's would
be, one rounding per addition in the wire dtype (wire.py), in several orders."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from launch import mpirun

from proxies.core import check, exits, wire

MPI = SimpleNamespace(SUM="sum")
F32, BF16, F16 = np.dtype(np.float32), wire.bfloat16(), np.dtype(np.float16)
DTYPES = [F32, BF16, F16]
# The 3.5M-element cases in 16 bits take a second each (NumPy converts every block): `slow`,
# out of the inner loop, which keeps float32; the full suite runs all three.
DTYPES_16_SLOW = [F32, *(pytest.param(d, marks=pytest.mark.slow) for d in (BF16, F16))]
REDUCTIONS = ["allreduce", "reduce", "reduce_scatter"]


class Hub:
    """What the n threads exchange: each call posts its rank's part and reads everyone's."""

    def __init__(self, n: int) -> None:
        self.n, self.slots = n, [None] * n
        self.barrier = threading.Barrier(n, timeout=60)

    def exchange(self, rank: int, value: np.ndarray) -> list[np.ndarray]:
        self.slots[rank] = np.array(value, copy=True)
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()  # nobody posts the next call's part before all have read
        return got


class FakeComm:
    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub, self.rank, self.size = hub, rank, hub.n

    def _sum(self, send) -> np.ndarray:
        return np.sum(self.hub.exchange(self.rank, send), axis=0)

    def Allreduce(self, send, recv, op) -> None:
        recv[...] = self._sum(send)

    def Reduce(self, send, recv, op, root) -> None:
        total = self._sum(send)
        if self.rank == root:
            recv[...] = total

    def Reduce_scatter(self, send, recv, counts, op) -> None:
        lo = sum(counts[: self.rank])
        recv[...] = self._sum(send).reshape(-1)[lo : lo + counts[self.rank]]

    def Allgather(self, send, recv) -> None:
        recv[...] = np.concatenate(self.hub.exchange(self.rank, send))

    def Alltoall(self, send, recv) -> None:
        parts = self.hub.exchange(self.rank, send)
        recv[...] = np.concatenate([np.array_split(p, self.size)[self.rank] for p in parts])

    def Bcast(self, buf, root) -> None:
        buf[...] = self.hub.exchange(self.rank, buf)[root]


def on_ranks(n: int, fn) -> list:
    """fn(comm) on n threads; their results by rank (an exception re-raised)."""
    hub, out = Hub(n), [None] * n

    def body(r: int) -> None:
        try:
            out[r] = fn(FakeComm(hub, r))
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            out[r] = e
            hub.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


def verdicts(kind: str, xs: list[np.ndarray], ys, unit: int = 1) -> list[str | None]:
    """before() on each rank's input, verify() on its result (one array: the same on all)."""
    ys = ys if isinstance(ys, list) else [ys] * len(xs)

    def one(comm):
        state = check.before(MPI, kind, comm, xs[comm.rank].copy(), unit)
        return check.verify(MPI, kind, comm, ys[comm.rank], state, unit)

    return on_ranks(len(xs), one)


def reduce(xs: list[np.ndarray], order=None, tree: bool = False) -> np.ndarray:
    """The sum as MPI computes it: float32 adds, or 16-bit floats widened to float32, added
    and rounded back, one rounding per addition; in the given order or as a pairwise tree."""
    dtype = xs[0].dtype
    parts = [xs[r] for r in (order or range(len(xs)))]
    with np.errstate(over="ignore"):  # a float16 sum may overflow, as MPI's would
        return _reduce(parts, dtype, tree)


def _reduce(parts: list[np.ndarray], dtype, tree: bool) -> np.ndarray:
    while len(parts) > 1:
        if tree:
            pairs = [(parts[i], parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
            parts = [(a.astype(F32) + b.astype(F32)).astype(dtype) for a, b in pairs] + (
                [parts[-1]] if len(parts) % 2 else []
            )
        else:
            parts = [(parts[0].astype(F32) + parts[1].astype(F32)).astype(dtype)] + parts[2:]
    return parts[0].copy()


def inputs(kind: str, n: int, size: int, dtype, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        xs = [rng.standard_normal(size) for _ in range(n)]
    elif kind == "around1":  # the issue's "values around 1"
        xs = [rng.uniform(0.5, 1.5, size) for _ in range(n)]
    elif kind == "cancel":  # large terms that cancel: the sum is small against the bound
        big = 1000 * rng.standard_normal(size)
        xs = [big, -big + rng.standard_normal(size)] + [
            1e-3 * rng.standard_normal(size) for _ in range(n - 2)
        ]
    elif kind == "wide":  # mixed signs over 10 decades (fp16: within its range)
        top = 3 if dtype == F16 else 6
        xs = [rng.choice([-1, 1], size) * 10 ** rng.uniform(-6, top, size) for _ in range(n)]
    elif kind == "tiny":  # subnormal in the wire dtype
        scale = 1e-6 if dtype == F16 else 1e-40
        xs = [scale * rng.standard_normal(size) for _ in range(n)]
    else:
        raise ValueError(kind)
    return [x.astype(np.float32).astype(dtype) for x in xs]


def first_error(kind: str, got: list) -> str | None:
    """The reports of the ranks that judge: all for allreduce and reduce_scatter (the
    owner of a corrupted block), the root for reduce."""
    errors = [e for e in (got[:1] if kind == "reduce" else got) if e]
    return errors[0] if errors else None


def bound(xs: list[np.ndarray], k: int) -> float:
    """Clause 2 of the docstring by hand: 4 n (eps A_b + sig B) + 2^-34 A_b for the check
    block holding element k of a whole-buffer reduction."""
    n, info = len(xs), ml_dtypes.finfo(xs[0].dtype)
    lo = k // check.BLOCK * check.BLOCK
    a = sum(np.abs(x[lo : lo + check.BLOCK].astype(np.float64)).sum() for x in xs)
    return 4 * n * (float(info.eps) * a + float(info.smallest_subnormal) * check.BLOCK) + a / 2**34


# -- the weights --------------------------------------------------------------------------


def test_weights_are_distinct_and_neighbours_far_apart():
    w = check.WEIGHTS
    assert w.size == check.BLOCK and len(np.unique(w)) == w.size
    assert w.min() >= 1 and w.max() < 2
    assert np.abs(np.diff(w)).min() >= 0.38  # the docstring's "0.38 for neighbours"


# -- clause 1: no false alarm --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("data", ["normal", "cancel", "wide", "tiny"])
def test_no_false_alarm_on_correct_reductions(dtype, data):
    # The large cancelling case runs on n = 3 ranks (i = 7): 3.2M elements give each
    # reduce_scatter segment more than check._ROWS blocks (two float64 chunks, the last with a
    # partial block) and the whole buffer four; the tolerance is per block, so more elements
    # (it was 5M) only repeat chunks.
    sizes = [1, 2, 3, 4095, 4096, 4097, 100_003] + ([3_200_003] if data == "cancel" else [])
    for i, size in enumerate(sizes):
        n = 2 + i % 3
        xs = inputs(data, n, size, dtype, seed=i)
        for kind, y in zip(
            REDUCTIONS,
            [reduce(xs), reduce(xs, order=list(range(n))[::-1]), reduce(xs, tree=True)],
            strict=True,
        ):
            assert verdicts(kind, xs, y) == [None] * n, (kind, size, n)


def test_no_false_alarm_when_a_float16_sum_truly_overflows():
    xs = [np.full(5000, 30000, dtype=F16) for _ in range(4)]
    y = reduce(xs)
    assert np.isinf(y).all()
    assert verdicts("allreduce", xs, y) == [None] * 4


def test_no_false_alarm_on_an_empty_buffer_or_ranks_without_a_block():
    for size in (0, 2):  # reduce_scatter of 2 elements over 4 ranks: two ranks hold none
        xs = inputs("normal", 4, size, F32)
        for kind in REDUCTIONS:
            assert verdicts(kind, xs, reduce(xs)) == [None] * 4


def test_reduce_scatter_blocks_of_units_are_checked_where_they_lie():
    xs = inputs("normal", 3, 7 * 6428, F32)  # units of 7: blocks of 2143, 2143, 2142 units
    y = reduce(xs)
    assert verdicts("reduce_scatter", xs, y, unit=7) == [None] * 3
    y[2143 * 7 + 5] += 1.0  # in rank 1's block
    got = verdicts("reduce_scatter", xs, y, unit=7)
    assert got[0] is None and got[2] is None and "weighted sum" in got[1]


# -- the issue's holes, injected on every rank identically --------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", REDUCTIONS)
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_nan_or_inf_in_the_result_is_caught(dtype, kind, value):
    xs = inputs("normal", 4, 100_003, dtype)
    y = reduce(xs)
    y[77_777] = value
    error = first_error(kind, verdicts(kind, xs, y))
    assert error and f"element 77777 is {value}" in error, error
    assert "though every input was finite" in error


def test_the_issues_half_in_a_3_5m_float32_buffer_is_caught():
    """One element +0.5 in 3.5M float32 values around 1: the whole-buffer tolerance of the
    old check (~4 n eps sum|x| = 27) let it pass; a block's is 4 n eps A_b ~ 0.03."""
    xs = inputs("around1", 4, 3_500_000, F32)
    y = reduce(xs)
    assert bound(xs, 2_000_000) < 0.1
    y[2_000_000] += 0.5
    for kind in REDUCTIONS:
        error = first_error(kind, verdicts(kind, xs, y))
        assert error and "weighted sum" in error, kind


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", REDUCTIONS)
def test_a_single_element_beyond_the_stated_bound_is_caught(dtype, kind):
    xs = inputs("around1", 4, 100_003, dtype)
    y = reduce(xs)
    k = 55_555
    before, e = float(y[k]), 1.1 * bound(xs, k)
    y[k] = before + e
    assert float(y[k]) - before > bound(xs, k)  # still beyond it, rounded to the dtype
    assert first_error(kind, verdicts(kind, xs, y))
    y[k] = before - e
    assert first_error(kind, verdicts(kind, xs, y))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", REDUCTIONS)
@pytest.mark.parametrize("data", ["around1", "normal"])
@pytest.mark.parametrize("how", ["lost", "doubled"])
def test_a_lost_or_doubled_contribution_is_caught(dtype, kind, data, how):
    xs = inputs(data, 4, 100_003, dtype)
    if how == "lost":
        y = reduce([x for r, x in enumerate(xs) if r != 2])
    else:
        y = reduce(xs + [xs[2]])
    assert first_error(kind, verdicts(kind, xs, y))


@pytest.mark.parametrize("dtype", DTYPES_16_SLOW, ids=str)
@pytest.mark.parametrize("kind", REDUCTIONS)
def test_two_swapped_blocks_of_2_20_elements_are_caught(dtype, kind):
    """The old weights repeated every 2^20 elements: this swap left their sum unchanged."""
    xs = inputs("normal", 4, 3_500_000, dtype)
    y = reduce(xs)
    m = 1 << 20
    y[:m], y[m : 2 * m] = y[m : 2 * m].copy(), y[:m].copy()
    error = first_error(kind, verdicts(kind, xs, y))
    assert error and ("weighted sum" in error or "sum of the inputs" in error)


def test_neighbours_exchanged_within_a_block_are_caught():
    xs = inputs("normal", 4, 10_000, F32)
    y = reduce(xs)
    y[4100], y[4101] = y[4101], y[4100]
    assert "check block 1 " in verdicts("allreduce", xs, y)[0]


def test_a_sampled_element_catches_what_16_bit_block_sums_cannot():
    """bf16: a block's tolerance is ~ B n eps |x| = 500 here, but the sampled element's is
    n eps |x_s|: replacing the block's sampled value by another element's is caught."""
    xs = inputs("normal", 4, check.BLOCK, BF16)
    y = reduce(xs)
    s = int(check._samples(0, np.array([check.BLOCK]))[0])
    other = (s + 1) % check.BLOCK
    assert abs(float(y[s]) - float(y[other])) > 0.5
    y[s] = y[other]
    assert "element" in verdicts("allreduce", xs, y)[0]


# -- inputs already non-finite, ranks that disagree ---------------------------------------


@pytest.mark.parametrize("kind", REDUCTIONS)
def test_inputs_already_non_finite_are_not_a_transport_error(kind):
    xs = inputs("normal", 3, 10_000, F32)
    xs[1][6000] = np.nan
    y = reduce(xs)
    assert np.isnan(y[6000])
    assert verdicts(kind, xs, y) == [None] * 3  # the run's loss reports it
    y[6000] = 0.0  # but a NaN that vanished on the way is caught, and said so
    error = first_error(kind, verdicts(kind, xs, y))
    assert error and "inputs held NaN or inf (before the collective)" in error


def test_ranks_holding_different_results_are_caught_without_a_hang():
    xs = inputs("normal", 4, 10_000, F32)
    y = reduce(xs)
    wrong = y.copy()
    wrong[9000] += 1.0  # on rank 0 only: it fails its sums and leaves the check last
    got = verdicts("allreduce", xs, [wrong, y, y, y])
    assert "weighted sum" in got[0]
    assert all("ranks hold different results" in e for e in got[1:])


# -- copies: crc32 per block ----------------------------------------------------------------


def copies(kind: str, n: int, size: int, dtype) -> tuple[list, list]:
    """Correct inputs and results of allgather, alltoall, bcast over n ranks."""
    xs = inputs("normal", n, size, dtype)
    if kind == "allgather":
        whole = np.concatenate([check.blocks(x, n)[r] for r, x in enumerate(xs)])
        return xs, [whole.copy() for _ in range(n)]
    if kind == "alltoall":
        ys = [np.concatenate([check.blocks(xs[i], n)[r] for i in range(n)]) for r in range(n)]
        return xs, ys
    return xs, [xs[0].copy() for _ in range(n)]  # bcast from rank 0


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("kind", ["allgather", "alltoall", "bcast"])
@pytest.mark.parametrize("fault", ["none", "nan", "swap blocks", "swap neighbours"])
def test_copies_catch_nan_and_swaps(dtype, kind, fault):
    n, size = 4, 4 * 3000
    xs, ys = copies(kind, n, size, dtype)
    for y in ys:  # the same corruption on every rank
        if fault == "nan":
            y[4500] = np.nan
        elif fault == "swap blocks":
            y[:3000], y[3000:6000] = y[3000:6000].copy(), y[:3000].copy()
        elif fault == "swap neighbours":
            y[4500], y[4501] = y[4501], y[4500]
    got = verdicts(kind, xs, ys)
    if fault == "none":
        assert got == [None] * n
    elif kind == "bcast":
        assert all("differs from the root's buffer" in e for e in got), got
    else:
        first = 0 if fault == "swap blocks" else 1
        assert all(f"block {first} of 4 differs" in e for e in got), got


@pytest.mark.parametrize("fault", ["none", "nan", "swap"])
def test_alltoallv_catches_nan_and_swaps(fault):
    n = 3
    counts = [[1, 4, 2], [3, 0, 5], [2, 2, 2]]  # counts[i][j]: rank i sends to j
    rng = np.random.default_rng(1)
    sends = [rng.standard_normal(sum(c)).astype(np.float32) for c in counts]
    recvs = [
        np.concatenate([check.split(sends[i], counts[i])[r] for i in range(n)]) for r in range(n)
    ]
    if fault == "nan":
        recvs[1][4] = np.nan  # from rank 2
    elif fault == "swap":
        recvs[0][[0, 1]] = recvs[0][[1, 0]]  # rank 0's blocks from ranks 0 and 1

    def one(comm):
        r = comm.rank
        state = check.before_v(comm, sends[r], counts[r])
        return check.verify_v(recvs[r], [counts[i][r] for i in range(n)], state)

    got = on_ranks(n, one)
    if fault == "none":
        assert got == [None] * n
    elif fault == "nan":
        assert got[0] is None and got[2] is None and "block 2 of 3" in got[1]
    else:
        assert got[0] and "block 0 of 3" in got[0] and got[1:] == [None, None]


# -- end to end: the engine's hook corrupts a reduction's result on every rank -------------

GPT2 = ["2", "1", "2", "--model", "gpt2-tiny", "--seq-len", "32", "--iters", "1"]
GPT2 += ["--warmup", "0", "--quiet", "--check", "--compute", "none"]


@pytest.mark.mpi
@pytest.mark.parametrize(
    "fault, extra, kind, says",
    [
        ("corrupt-nan", [], "allreduce", "is nan though every input was finite"),
        ("corrupt-add", [], "allreduce", "weighted sum of the result"),
        ("corrupt-nan", ["--grad-dtype", "bf16"], "allreduce", "is nan though every input"),
        ("corrupt-add", ["--zero", "1"], "reduce_scatter", "weighted sum of the result"),
    ],
)
def test_a_result_corrupted_on_every_rank_ends_the_run_with_check(fault, extra, kind, says):
    """Identical on both ranks, so their crc32s agree: only the sums can notice. (Exit 1
    with a traceback after the --check line is MPI_Abort returning on a rank: the runner's
    abort path, not this check.)"""
    r = mpirun(2, "proxies.gpt2", *GPT2, *extra, timeout=120, env={"PROXIES_FAULT": f"{fault}:all"})
    lines = [x for x in r.stderr.splitlines() if "--check:" in x]
    assert r.returncode == exits.CHECK, r.stderr
    assert lines and all(f"--check: {kind} over group dp (grads, iteration 0)" in x for x in lines)
    assert says in lines[0]
