"""The GPT-2 kernels arranged for the machine: the same math as kernels.py, in less time.

kernels.py is the readable reference (llm.c's loops as whole-array NumPy, checked against
finite differences). This module computes the same results (tests: 1e-5 relative; most
kernels bit for bit) with the same signatures, so StageModel can take either:

- Elementwise work (GELU, layernorm, softmax, AdamW) runs over blocks of rows that fit in
  the L2 cache, so its several NumPy passes read main memory once instead of once per
  pass, and on as many threads as the rank has BLAS threads: NumPy releases the GIL inside
  ufuncs and BLAS calls, so the blocks of one kernel run in parallel. Applied to a block,
  a reference kernel is exact: rows do not interact.
- Weight gradients accumulate (dW += dout^T x) through a temporary of a few rows of dW
  instead of a whole-weight one: the LM head's would be V x C (154 MB for GPT-2).
- The classifier can leave dlogits behind in its forward (llm.c's fused classifier), so
  the backward does not recompute the (B*T, V) logits: one of the LM head's three big
  matmuls fewer.
- AdamW zeroes the gradients it consumed while they are still in cache (optional), which
  replaces a separate pass over the whole gradient buffer.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np

from proxies.core import threads
from proxies.gpt2 import kernels as ref
from proxies.gpt2.kernels import (  # noqa: F401  (re-exported: same kernels, no faster form)
    CLASSIFIER_CHUNK,
    encoder_backward,
    encoder_forward,
    matmul_forward,
    residual_forward,
)

# Elements per cache block: 64 Ki float32 = 256 KiB per array, so the 3-5 arrays a kernel
# touches at once stay in a 1-4 MiB L2.
BLOCK = 1 << 16

# Per micro-batch, the classifier keeps its (B*T, V) dlogits for the backward when they take
# at most this many bytes (B=4, T=256 at GPT-2's V: 206 MB); beyond, the backward
# recomputes the logits chunk by chunk (one more matmul, no B*T*V buffer).
DLOGITS_BUDGET = 1 << 28

# Rows of dW computed per temporary in accumulating matmuls: 1 MiB of float32 at C = 768.
_DW_ELEMS = 1 << 18


# ----------------------------------------------------------------------------------------
# threads


def workers() -> int:
    """Threads for elementwise kernels: the rank's BLAS threads (core/threads.py decided
    them from cores / ranks on the node, or the user did), at most the cores available."""
    n = int(os.environ.get("PROXIES_KERNEL_THREADS", 0)) or (
        threads.decision[0] if threads.decision and threads.decision[0] > 0 else 1
    )
    return max(1, min(n, threads.cores_available()))


_pool: ThreadPoolExecutor | None = None


def parallel(fn, n: int, grain: int = BLOCK) -> None:
    """fn(lo, hi) over contiguous parts of range(n), one per worker; the caller runs the
    first part. Parts smaller than `grain` are not worth a thread."""
    k = min(workers(), max(1, n // grain))
    if k <= 1:
        fn(0, n)
        return
    global _pool
    if _pool is None or _pool._max_workers < k - 1:
        _pool = ThreadPoolExecutor(k - 1, thread_name_prefix="proxies-kernel")
    bounds = [n * i // k for i in range(k + 1)]
    futures = [_pool.submit(fn, bounds[i], bounds[i + 1]) for i in range(1, k)]
    fn(bounds[0], bounds[1])
    for f in futures:
        f.result()


def blocked(fn, n: int, block: int, grain: int | None = None) -> None:
    """fn(lo, hi) over blocks of at most `block` of range(n), the blocks shared by workers."""

    def run(lo: int, hi: int) -> None:
        for i in range(lo, hi, block):
            fn(i, min(i + block, hi))

    parallel(run, n, grain or block)


def _rows(x: np.ndarray) -> int:
    """Rows per block for a 2-D (rows, width) array: about BLOCK elements, at least one."""
    return max(1, BLOCK // max(1, x.shape[-1]))


# ----------------------------------------------------------------------------------------
# GELU and layernorm: the reference kernels, block by block


def gelu_forward(out: np.ndarray, inp: np.ndarray) -> None:
    o, x = out.reshape(-1), inp.reshape(-1)
    blocked(lambda i, j: ref.gelu_forward(o[i:j], x[i:j]), x.size, BLOCK)


def gelu_backward(dinp: np.ndarray, inp: np.ndarray, dout: np.ndarray) -> None:
    d, x, g = dinp.reshape(-1), inp.reshape(-1), dout.reshape(-1)
    blocked(lambda i, j: ref.gelu_backward(d[i:j], x[i:j], g[i:j]), x.size, BLOCK)


def layernorm_forward(out, mean, rstd, inp, weight, bias) -> None:
    C = inp.shape[-1]
    o, x, mu, rs = out.reshape(-1, C), inp.reshape(-1, C), mean.reshape(-1), rstd.reshape(-1)
    blocked(
        lambda i, j: ref.layernorm_forward(o[i:j], mu[i:j], rs[i:j], x[i:j], weight, bias),
        x.shape[0],
        _rows(x),
    )


def layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd) -> None:
    """As the reference; dweight and dbias are summed per worker, then added once."""
    C = inp.shape[-1]
    d, g, x = dinp.reshape(-1, C), dout.reshape(-1, C), inp.reshape(-1, C)
    mu, rs = mean.reshape(-1), rstd.reshape(-1)
    partial: list[np.ndarray] = []

    def run(lo: int, hi: int) -> None:
        acc = np.zeros((2, C), dtype=dweight.dtype)  # this worker's dweight, dbias
        for i in range(lo, hi, _rows(x)):
            j = min(i + _rows(x), hi)
            ref.layernorm_backward(d[i:j], acc[0], acc[1], g[i:j], x[i:j], weight, mu[i:j], rs[i:j])
        partial.append(acc)

    parallel(run, x.shape[0], _rows(x))
    total = partial[0] if len(partial) == 1 else sum(partial)
    dweight += total[0]
    dbias += total[1]


# ----------------------------------------------------------------------------------------
# matmul


def _add_at_b(out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """out (M,N) += a.T (M,K) @ b (K,N), a few rows of out at a time: the temporary stays
    in cache and is never the size of out."""
    M, N = out.shape
    rows = max(1, _DW_ELEMS // N)
    if rows >= M:
        out += a.T @ b
        return

    def run(lo: int, hi: int) -> None:
        tmp = np.empty((min(rows, hi - lo), N), dtype=out.dtype)
        for i in range(lo, hi, rows):
            j = min(i + rows, hi)
            np.matmul(a[:, i:j].T, b, out=tmp[: j - i])
            out[i:j] += tmp[: j - i]

    run(0, M)  # BLAS threads already share each block's matmul


def matmul_backward(dinp, dweight, dbias, dout, inp, weight) -> None:
    """As the reference; dweight accumulates through row blocks (_add_at_b)."""
    OC, C = weight.shape
    dout2 = dout.reshape(-1, OC)
    if dinp is not None:
        d = dinp.reshape(-1, C)
        d += dout2 @ weight
    _add_at_b(dweight, dout2, inp.reshape(-1, C))
    if dbias is not None:
        dbias += dout2.sum(axis=0)


# ----------------------------------------------------------------------------------------
# attention: the reference per group of (batch, head) slices


def attention_forward(out: np.ndarray, att: np.ndarray, inp: np.ndarray, NH: int) -> None:
    """As the reference, one batch row at a time (its T x T scores stay in cache), rows
    shared by workers."""
    blocked(
        lambda i, j: ref.attention_forward(out[i:j], att[i:j], inp[i:j], NH), inp.shape[0], 1, 1
    )


def attention_backward(
    dinp: np.ndarray, dout: np.ndarray, inp: np.ndarray, att: np.ndarray, NH: int
) -> None:
    blocked(
        lambda i, j: ref.attention_backward(dinp[i:j], dout[i:j], inp[i:j], att[i:j], NH),
        inp.shape[0],
        1,
        1,
    )


# ----------------------------------------------------------------------------------------
# fused classifier


def classifier_forward(
    lse: np.ndarray,
    inp: np.ndarray,
    wte: np.ndarray,
    targets: np.ndarray,
    dlogits: np.ndarray | None = None,
    dloss: float = 1.0,
    chunk: int = CLASSIFIER_CHUNK,
) -> float:
    """As the reference; with dlogits (B*T, V) given, also writes the gradient of
    dloss * mean loss w.r.t. the logits there, for classifier_backward_saved."""
    V, C = wte.shape
    x, t, lse1 = inp.reshape(-1, C), targets.reshape(-1), lse.reshape(-1)
    N = x.shape[0]
    R = ref._chunk_rows(N, V, chunk)
    buf = np.empty((R, V), dtype=inp.dtype) if dlogits is None else None
    losses = np.empty(N, dtype=np.float64)
    scale = float(dloss) / N

    def rows(logits: np.ndarray, i: int, lo: int, hi: int) -> None:
        """Rows lo:hi of a chunk starting at global row i: softmax stats, loss, dlogits."""
        z = logits[lo:hi]
        n = hi - lo
        target = z[np.arange(n), t[i + lo : i + hi]]
        mx = z.max(axis=1)
        z -= mx[:, None]
        np.exp(z, out=z)
        s = z.sum(axis=1)
        out = lse1[i + lo : i + hi]
        np.log(s, out=out)
        out += mx
        losses[i + lo : i + hi] = out - target
        if dlogits is not None:  # softmax * scale, minus scale at the target
            np.divide(scale, s, out=s)
            z *= s[:, None]
            z[np.arange(n), t[i + lo : i + hi]] -= scale

    for i in range(0, N, R):
        n = min(R, N - i)
        logits = buf[:n] if dlogits is None else dlogits[i : i + n]
        np.matmul(x[i : i + n], wte.T, out=logits)
        blocked(partial(rows, logits, i), n, max(1, BLOCK // V * 4), 1)
    return float(losses.sum()) / N


def classifier_backward_saved(
    dinp: np.ndarray, dwte: np.ndarray, inp: np.ndarray, wte: np.ndarray, dlogits: np.ndarray
) -> None:
    """dinp (B,T,C) += dlogits @ wte and dwte (V,C) += dlogits.T @ inp, dlogits (B*T, V)
    left by classifier_forward."""
    V, C = wte.shape
    d = dinp.reshape(-1, C)
    d += dlogits @ wte
    _add_at_b(dwte, dlogits, inp.reshape(-1, C))


def classifier_backward(
    dinp, dwte, inp, wte, targets, lse, dloss: float = 1.0, chunk: int = CLASSIFIER_CHUNK
) -> None:
    """As the reference (recomputing the logits chunk by chunk), with dwte accumulated
    through row blocks."""
    V, C = wte.shape
    x, t, lse1 = inp.reshape(-1, C), targets.reshape(-1), lse.reshape(-1)
    dx = dinp.reshape(-1, C)
    N = x.shape[0]
    R = ref._chunk_rows(N, V, chunk)
    buf = np.empty((R, V), dtype=inp.dtype)
    scale = float(dloss) / N

    def rows(dl: np.ndarray, i: int, lo: int, hi: int) -> None:
        z = dl[lo:hi]
        z -= lse1[i + lo : i + hi, None]
        np.exp(z, out=z)
        z[np.arange(hi - lo), t[i + lo : i + hi]] -= 1.0
        z *= scale

    for i in range(0, N, R):
        n = min(R, N - i)
        dl = buf[:n]
        np.matmul(x[i : i + n], wte.T, out=dl)
        blocked(partial(rows, dl, i), n, max(1, BLOCK // V * 4), 1)
        dx[i : i + n] += dl @ wte
        _add_at_b(dwte, dl, x[i : i + n])


# ----------------------------------------------------------------------------------------
# AdamW


def adamw_update(
    params: np.ndarray,
    grads: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    t: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    zero_grads: bool = False,
) -> None:
    """The reference AdamW, block by block (bit for bit the same); zero_grads: also set
    grads to 0 once consumed (the next step's accumulation starts from there)."""

    def block(i: int, j: int) -> None:
        ref.adamw_update(params[i:j], grads[i:j], m[i:j], v[i:j], t, lr, beta1, beta2, eps,
                         weight_decay)  # fmt: skip
        if zero_grads:
            grads[i:j].fill(0)

    blocked(block, params.size, BLOCK)
