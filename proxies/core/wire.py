"""What crosses the wire: 16-bit floats for activations and gradients, computed in float32.

`--dtype` sets the element type of activations and of tensor-, sequence- and
expert-parallel traffic, `--grad-dtype` that of gradient reductions: fp32, bf16 or fp16.
A plan's Msg and Collective carry that wire dtype. NumPy computes in float32, so the engine
rounds a float32 buffer into a staging buffer of the wire dtype before it leaves (round to
nearest even, as a GPU's conversion does), and widens what arrives back into the float32
buffer. A buffer already of the wire dtype goes as it is; without real compute (model,
none) the staging buffer is used without the rounding pass, since the values mean nothing.

MPI has no standard bfloat16 or float16 type (MPI 4.1), so 16-bit floats travel as
MPI_UINT16_T words: their bytes are exactly what a bf16 training run would send. Sums use
a user-defined MPI operation that widens both operands to float32, adds, and rounds the
sum back to the wire type: one rounding per pairwise addition, as NCCL reduces bf16 (it
accumulates each step in float and stores bf16), whichever algorithm MPI picks. A result
element therefore carries at most n - 1 roundings of 2^-8 (bf16) or 2^-11 (fp16) relative
to its partial sums, which is the bound `--check` verifies. bfloat16 comes from the
`ml_dtypes` package (the bfloat16 NumPy type JAX and TensorFlow use), imported only by a run
that uses bfloat16: with NumPy 2.4 the import alone takes 0.7 - 0.9 s of CPU here, in every
rank.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import numpy as np

from proxies.core import pages


@functools.cache
def bfloat16() -> np.dtype:
    """ml_dtypes' bfloat16 (imported here, on first use: see above)."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


@functools.cache
def numpy_dtype(name: str) -> np.dtype:
    """np.dtype for a plan's dtype name, bfloat16 included (cached: the engine asks per
    message)."""
    return bfloat16() if name == "bfloat16" else np.dtype(name)


def _sixteen(dt: np.dtype) -> bool:
    # float16, or ml_dtypes' bfloat16 (a dtype of kind "V" named so): floats MPI cannot
    # reduce, sent as uint16. By name, so that asking does not import ml_dtypes.
    return dt.itemsize == 2 and (dt.kind == "f" or dt.name == "bfloat16")


def is_sixteen(dtype) -> bool:
    return _sixteen(np.dtype(dtype))


def transport(arr: np.ndarray) -> np.ndarray:
    """The array as MPI sees it: 16-bit floats as their raw uint16 words."""
    return arr.view(np.uint16) if _sixteen(arr.dtype) else arr


@functools.cache
def mpi_type(MPI, dtype):
    """The MPI datatype a transported array of `dtype` travels as (cached: mpi4py's lookup
    costs microseconds, asked per received message)."""
    from mpi4py.util import dtlib

    return MPI.UINT16_T if is_sixteen(dtype) else dtlib.from_numpy_dtype(dtype)


def finfo(dtype):
    """Machine limits of a float dtype, NumPy's or bfloat16."""
    dt = np.dtype(dtype)
    if dt.name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.finfo(dt)
    return np.finfo(dt)


def epsilon(dtype) -> float:
    """Unit roundoff bound used by --check: the dtype's machine epsilon."""
    return float(finfo(dtype).eps)


_ops: dict = {}


def sum_op(MPI, dtype):
    """MPI.SUM, or for a 16-bit float the float32-accumulating sum described above."""
    dtype = np.dtype(dtype)
    if not _sixteen(dtype):
        return MPI.SUM
    if dtype not in _ops:

        def add(inbuf, inoutbuf, datatype, dtype=dtype):
            a = np.frombuffer(inbuf, dtype=dtype)
            b = np.frombuffer(inoutbuf, dtype=dtype)
            b[...] = (a.astype(np.float32) + b.astype(np.float32)).astype(dtype)

        _ops[dtype] = MPI.Op.Create(add, commute=True)
    return _ops[dtype]


class Staging:
    """Wire-format buffers for float32 compute buffers, reused: a free list per (dtype,
    size), so memory stays at what is in flight at once (a pipeline batch, the gradient
    buckets not yet waited for)."""

    def __init__(self) -> None:
        self.free: dict[tuple[np.dtype, int], list[np.ndarray]] = defaultdict(list)

    def narrow(self, buf: np.ndarray, dtype: np.dtype, copy: bool = True) -> np.ndarray:
        """A wire buffer for `buf`, holding its values rounded when `copy`."""
        shelf = self.free[(dtype, buf.size)]
        wire = shelf.pop() if shelf else pages.zeros(buf.size, dtype)
        if copy:
            wire[...] = buf.reshape(-1)  # round to nearest even
        return wire

    def widen(self, wire: np.ndarray, buf: np.ndarray) -> None:
        """Copy what arrived into the compute buffer and take the wire buffer back."""
        buf.reshape(-1)[...] = wire
        self.release(wire)

    def release(self, wire: np.ndarray) -> None:
        self.free[(wire.dtype, wire.size)].append(wire)
