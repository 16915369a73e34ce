"""The GPT-2 kernels arranged for the machine: the same math as kernels.py, in less time.

kernels.py is the readable reference (llm.c's loops as whole-array NumPy, checked against
finite differences). This module computes the same results (tests: 1e-5 relative;
layernorm bit for bit) under the same names and signatures (`fresh=` included), so a model
takes either module as its kernels and never asks which it has:

- Elementwise work (GELU, layernorm, softmax, AdamW) runs over blocks of rows that fit in
  the L2 cache, so its several NumPy passes read main memory once instead of once per
  pass, and on as many threads as the rank has BLAS threads: NumPy releases the GIL inside
  ufuncs and BLAS calls, so the blocks of one kernel run in parallel. Applied to a block,
  a reference kernel is exact: rows do not interact. Every array operation is a pass
  (about 0.2-0.4 ns per float32 element here, even in cache), so GELU and AdamW are
  rewritten in fewer of them.
- Weight gradients accumulate (dW += dout^T x) through a temporary of a few rows of dW
  instead of a whole-weight one: the LM head's would be V x C (154 MB for GPT-2).
- The classifier can leave dlogits behind in its forward (llm.c's fused classifier), so
  the backward does not recompute the (B*T, V) logits: one of the LM head's three big
  matmuls fewer.
- AdamW makes one pass over memory in cache-sized blocks, its moments kept scaled so
  that a block takes 10 array operations.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, partial

import numpy as np

from proxies.core import threads
from proxies.transformer import kernels as ref
from proxies.transformer.kernels import (  # noqa: F401  (re-exported: same kernels, no faster form)
    CLASSIFIER_CHUNK,
    encoder_backward,
    encoder_forward,
    matmul_forward,
    residual_backward,
    residual_forward,
)

# Elements per cache block: 64 Ki float32 = 256 KiB per array, so the 3-5 arrays a kernel
# touches at once stay in a 1-4 MiB L2.
BLOCK = 1 << 16

# Per micro-batch, the classifier keeps its (B*T, V) dlogits for the backward when they take
# at most this many bytes (B=4, T=256 at GPT-2's V: 206 MB); beyond, the backward
# recomputes the logits chunk by chunk (one more matmul, no B*T*V buffer).
DLOGITS_BUDGET = 1 << 28

# Elements of the temporary through which weight gradients accumulate: 16 MiB of float32,
# a whole layer weight of GPT-2 XL (6400 x 1600); the LM head's V x C goes in row blocks.
DW_ELEMS = 1 << 22


def dw_temp_elems(shape: tuple[int, int]) -> int:
    """Elements of the temporary a weight gradient of `shape` (M, N) accumulates through
    (_add_at_b keeps one per shape): whole rows, at most DW_ELEMS elements (at least a row)."""
    M, N = shape
    return min(M, max(1, DW_ELEMS // N)) * N


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
# GELU and layernorm, block by block


# GELU: y = x (1 + tanh(z)) / 2 with z = c (x + a x^3), c = sqrt(2/pi), a = 0.044715
_GELU_A = 0.044715


def gelu_forward(out: np.ndarray, inp: np.ndarray) -> None:
    """As the reference, in 8 array operations a block instead of 9 (z = (c a x^2 + c) x)."""
    o, x = out.reshape(-1), inp.reshape(-1)
    c = ref.GELU_SCALE

    def block(i: int, j: int) -> None:
        y, xb = o[i:j], x[i:j]
        np.square(xb, out=y)
        y *= c * _GELU_A
        y += c
        y *= xb
        np.tanh(y, out=y)
        y += 1.0
        y *= xb
        y *= 0.5

    blocked(block, x.size, BLOCK)


def gelu_backward(dinp: np.ndarray, inp: np.ndarray, dout: np.ndarray, fresh: bool = False) -> None:
    """As the reference; fresh: dinp is written, not added to. With th = tanh(z),
    gelu'(x) = (1 + th) / 2 + k (1 - th^2) = (1 + th) (1/2 + k (1 - th)), where
    k = c x (1 + 3 a x^2) / 2: 12 array operations a block instead of 18."""
    d, x, g = dinp.reshape(-1), inp.reshape(-1), dout.reshape(-1)
    c = ref.GELU_SCALE

    def run(lo: int, hi: int) -> None:
        n = min(BLOCK, hi - lo)
        scratch = np.empty((3, n), dtype=dinp.dtype)  # this worker's temporaries
        for i in range(lo, hi, BLOCK):
            j = min(i + BLOCK, hi)
            xb, k, th, w = x[i:j], *scratch[:, : j - i]
            np.square(xb, out=k)
            np.multiply(k, c * _GELU_A, out=th)
            th += c
            th *= xb
            np.tanh(th, out=th)  # th
            k *= 1.5 * c * _GELU_A
            k += 0.5 * c
            k *= xb  # k
            np.subtract(1.0, th, out=w)
            k *= w
            k += 0.5
            th += 1.0
            th *= k  # gelu'(x)
            if fresh:
                np.multiply(th, g[i:j], out=d[i:j])
            else:
                th *= g[i:j]
                d[i:j] += th

    parallel(run, x.size, BLOCK)


def layernorm_forward(out, mean, rstd, inp, weight, bias) -> None:
    """As the reference: out (B,T,C), mean and rstd (B,T) from inp (B,T,C), over row blocks."""
    C = inp.shape[-1]
    o, x, mu, rs = out.reshape(-1, C), inp.reshape(-1, C), mean.reshape(-1), rstd.reshape(-1)
    blocked(
        lambda i, j: ref.layernorm_forward(o[i:j], mu[i:j], rs[i:j], x[i:j], weight, bias),
        x.shape[0],
        _rows(x),
    )


def layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, fresh=False) -> None:
    """As the reference: dinp (B,T,C) +=, dweight and dbias (C,) summed per worker, then
    added once (fresh: written)."""
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
    if fresh:
        dweight[...] = total[0]
        dbias[...] = total[1]
    else:
        dweight += total[0]
        dbias += total[1]


# ----------------------------------------------------------------------------------------
# matmul


_temps: dict[tuple, np.ndarray] = {}


def _temp(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A scratch array kept for reuse (calling thread only): a fresh allocation this large
    is page-faulted in again on every call."""
    key = (shape, np.dtype(dtype).str)
    buf = _temps.get(key)
    if buf is None:
        buf = _temps[key] = np.empty(shape, dtype=dtype)
    return buf


def _add_at_b(out: np.ndarray, a: np.ndarray, b: np.ndarray, fresh: bool = False) -> None:
    """out (M,N) += a.T (M,K) @ b (K,N); fresh: out = a.T @ b (out holds zeros or junk).

    One matmul into a kept temporary, then one add; beyond DW_ELEMS elements (the LM
    head's V x C) in blocks of rows, so the temporary stays that small."""
    if fresh:
        np.matmul(a.T, b, out=out)
        return
    M, N = out.shape
    rows = max(1, min(M, DW_ELEMS // N))
    tmp = _temp((rows, N), out.dtype)
    for i in range(0, M, rows):
        j = min(i + rows, M)
        np.matmul(a[:, i:j].T, b, out=tmp[: j - i])
        out[i:j] += tmp[: j - i]


def matmul_backward(
    dinp, dweight, dbias, dout, inp, weight, dinp_fresh: bool = False, fresh: bool = False
) -> None:
    """As the reference; dinp_fresh: dinp is written, not added to; fresh: so are dweight
    and dbias (the caller knows they hold zeros: the result is the same, one pass less)."""
    OC, C = weight.shape
    dout2 = dout.reshape(-1, OC)
    if dinp is not None:
        d = dinp.reshape(-1, C)
        if dinp_fresh:
            np.matmul(dout2, weight, out=d)
        else:
            d += dout2 @ weight
    _add_at_b(dweight, dout2, inp.reshape(-1, C), fresh)
    if dbias is not None:
        if fresh:
            np.sum(dout2, axis=0, out=dbias)
        else:
            dbias += dout2.sum(axis=0)


# ----------------------------------------------------------------------------------------
# attention: the batched matmuls on the calling thread (BLAS threads share them), the
# softmax and its backward over blocks of score rows on the workers. Worker threads never
# call BLAS: concurrent calls into a threaded OpenBLAS serialize and oversubscribe cores.


@lru_cache(maxsize=8)
def _causal_bias(T: int, dtype: str) -> np.ndarray:
    """(T,T): 0 where a query may see the key, -inf where the key is in its future."""
    return np.where(np.triu(np.ones((T, T), dtype=bool), k=1), -np.inf, 0.0).astype(dtype)


def _qkv(inp: np.ndarray, NH: int):
    """q, k, v as (B,NH,T,hs) strided views of inp (B,T,3C); and hs."""
    B, T, C3 = inp.shape
    hs = C3 // 3 // NH
    q, k, v = inp.reshape(B, T, 3, NH, hs).transpose(2, 0, 3, 1, 4)
    return q, k, v, hs


def attention_forward(
    out: np.ndarray, att: np.ndarray, inp: np.ndarray, NH: int, causal: bool = True
) -> None:
    """As the reference: att (B,NH,T,T) the saved softmax, out (B,T,C). The 1/sqrt(hs)
    scale goes on q (T x hs per head, not T x T); the causal mask is added (causal=False,
    BERT's encoder: none, every query sees every key); each row is scaled by its sum's
    reciprocal."""
    B, T, _ = inp.shape
    q, k, v, hs = _qkv(inp, NH)
    np.matmul(q * (1.0 / math.sqrt(hs)), k.swapaxes(-1, -2), out=att)
    bias = _causal_bias(T, inp.dtype.str) if causal else None
    rows = att.reshape(-1, T, T)

    def softmax(i: int, j: int) -> None:
        a = rows[i:j]
        if bias is not None:
            a += bias
        a -= a.max(axis=-1, keepdims=True)  # the diagonal is never masked: max is finite
        np.exp(a, out=a)
        s = a.sum(axis=-1, keepdims=True)
        np.divide(1.0, s, out=s)
        a *= s

    blocked(softmax, rows.shape[0], max(1, BLOCK // (T * T)), max(1, 4 * BLOCK // (T * T)))
    np.matmul(att, v, out=out.reshape(B, T, NH, hs).transpose(0, 2, 1, 3))


def attention_backward(
    dinp: np.ndarray,
    dout: np.ndarray,
    inp: np.ndarray,
    att: np.ndarray,
    NH: int,
    fresh: bool = False,
) -> None:
    """As the reference: dinp (B,T,3C) += from dout (B,T,C) (fresh: written), att
    (B,NH,T,T) saved; the scale goes on the T x hs operands, and the softmax backward runs
    over blocks of score rows on the workers."""
    B, T, _ = inp.shape
    q, k, v, hs = _qkv(inp, NH)
    dq, dk, dv = dinp.reshape(B, T, 3, NH, hs).transpose(2, 0, 3, 1, 4)
    do = dout.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)
    if fresh:  # matmuls straight into the strided views of dinp: no zeroing pass
        np.matmul(att.swapaxes(-1, -2), do, out=dv)
    else:
        dv += att.swapaxes(-1, -2) @ do
    datt = do @ v.swapaxes(-1, -2)
    a_rows, d_rows = att.reshape(-1, T, T), datt.reshape(-1, T, T)

    def softmax_backward(i: int, j: int) -> None:
        # dpreatt = att * (datt - sum(att * datt)); masked entries have att = 0
        a, d = a_rows[i:j], d_rows[i:j]
        d -= np.einsum("gij,gij->gi", a, d)[..., None]
        d *= a

    blocked(
        softmax_backward, d_rows.shape[0], max(1, BLOCK // (T * T)), max(1, 4 * BLOCK // (T * T))
    )
    scale = 1.0 / math.sqrt(hs)
    if fresh:
        np.matmul(datt, k * scale, out=dq)
        np.matmul(datt.swapaxes(-1, -2), q * scale, out=dk)
    else:
        dq += datt @ (k * scale)
        dk += datt.swapaxes(-1, -2) @ (q * scale)


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
    # into dlogits the logits go in one matmul (a small last chunk would run at a fraction
    # of the GEMM rate); without, in chunks of a kept buffer
    R = ref._chunk_rows(N, V, chunk) if dlogits is None else N
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
    dinp: np.ndarray,
    dwte: np.ndarray,
    inp: np.ndarray,
    wte: np.ndarray,
    dlogits: np.ndarray,
    dinp_fresh: bool = False,
    fresh: bool = False,
) -> None:
    """dinp (B,T,C) += dlogits @ wte and dwte (V,C) += dlogits.T @ inp, dlogits (B*T, V)
    left by classifier_forward; dinp_fresh, fresh: dinp, dwte written (as matmul_backward)."""
    matmul_backward(dinp, dwte, None, dlogits, inp, wte, dinp_fresh, fresh)  # no bias


def classifier_backward(
    dinp,
    dwte,
    inp,
    wte,
    targets,
    lse,
    dloss: float = 1.0,
    chunk: int = CLASSIFIER_CHUNK,
    dinp_fresh: bool = False,
    fresh: bool = False,
) -> None:
    """As the reference (recomputing the logits chunk by chunk): dinp (B,T,C), dwte (V,C)
    += (written when dinp_fresh, fresh), dwte accumulated through row blocks."""
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
        # the first chunk writes what is fresh, the later ones add
        first = i == 0
        matmul_backward(
            dx[i : i + n], dwte, None, dl, x[i : i + n], wte, dinp_fresh, fresh and first
        )


# ----------------------------------------------------------------------------------------
# AdamW


# AdamW's blocks: 512 KiB per array. Its five arrays then overflow a 2 MiB L2 a little, but
# half the calls (and GIL hand-overs between the workers) of 64 Ki blocks: measured faster.
ADAMW_BLOCK = 1 << 17


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
) -> None:
    """The reference AdamW, block by block in one pass over memory, in 10 array operations
    a block instead of the reference's 14 (11 with weight decay).

    The moments are kept scaled: m holds m / (1-b1) and v holds v / (1-b2) (both start at
    zero, so zeros are valid initial state), which makes their updates m = b1 m + g and
    v = b2 v + g^2; the bias corrections and those scales fold into two scalars:
    p -= lr c1 / sqrt(c2) * m / (sqrt(v) + eps / sqrt(c2)), with c1 = (1-b1) / (1-b1^t) and
    c2 = (1-b2) / (1-b2^t). The same value as the reference; rounding differs in the last
    bits."""
    lr, weight_decay = float(lr), float(weight_decay)  # NumPy float64 scalars would upcast
    c1 = (1.0 - beta1) / (1.0 - beta1**t)
    c2 = (1.0 - beta2) / (1.0 - beta2**t)
    step, eps_t = lr * c1 / math.sqrt(c2), eps / math.sqrt(c2)
    decay = 1.0 - lr * weight_decay

    def run(lo: int, hi: int) -> None:
        tmp = np.empty(min(ADAMW_BLOCK, hi - lo), dtype=params.dtype)  # this worker's own
        for i in range(lo, hi, ADAMW_BLOCK):
            j = min(i + ADAMW_BLOCK, hi)
            p, g, mm, vv, tt = params[i:j], grads[i:j], m[i:j], v[i:j], tmp[: j - i]
            mm *= beta1
            mm += g
            np.square(g, out=tt)
            vv *= beta2
            vv += tt
            np.sqrt(vv, out=tt)
            tt += eps_t
            np.divide(mm, tt, out=tt)
            tt *= step
            if weight_decay:
                p *= decay  # decoupled decay of the pre-update params
            p -= tt

    parallel(run, params.size, ADAMW_BLOCK)
