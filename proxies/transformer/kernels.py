"""GPT-2 layers as NumPy forward/backward kernel pairs, after llm.c's train_gpt2.c.

Letters: B batch (micro-batch), T time (sequence), C channels, NH heads, hs = C / NH head
size, V vocabulary, L layers. Activations are (B,T,C) C-contiguous arrays; weights use llm.c's
(and the HF checkpoint's nn.Linear) layout: a matmul weight is (OC, C) and out = inp @ weight.T.

Conventions, as in llm.c:
- outputs first in the signature; forward kernels write into preallocated arrays and save
  what backward needs (layernorm's mean and rstd, attention's softmax, the classifier's lse);
- backward kernels ACCUMULATE (+=) into their gradient buffers; with `fresh=True` they
  WRITE them instead (the first write of a gradient in an iteration: no zeroing pass), and
  `dinp_fresh=True` does the same for a matmul's input gradient;
- fast.py has the same names and signatures, so a model takes either module as its kernels;
- kernels are dtype-generic: float32 in runs, float64 in finite-difference tests. Scalars are
  Python floats, which NumPy keeps in the array's dtype (nothing is upcast to float64).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

GELU_SCALE = math.sqrt(2.0 / math.pi)
LN_EPS = 1e-5

# Logits elements the fused classifier keeps alive at once (64 MiB in float32). At V = 50257
# that is 333 rows per chunk: enough rows that each pass of wte through the matmul stays
# compute-bound, while B*T*V logits (1.6 GiB at B=8, T=1024) never exist in full.
CLASSIFIER_CHUNK = 1 << 24


# ----------------------------------------------------------------------------------------
# encoder: token + position embedding


def encoder_forward(out: np.ndarray, inp: np.ndarray, wte: np.ndarray, wpe: np.ndarray) -> None:
    """out (B,T,C) = wte[inp] + wpe[:T]; inp (B,T) int tokens, wte (V,C), wpe (maxT,C)."""
    T = inp.shape[1]
    np.take(wte, inp, axis=0, out=out)
    out += wpe[:T]


def encoder_backward(
    dwte: np.ndarray,
    dwpe: np.ndarray,
    dout: np.ndarray,
    inp: np.ndarray,
    fresh: bool = False,
    dwte_fresh: bool | None = None,
) -> None:
    """dwte (V,C) and dwpe (maxT,C) += from dout (B,T,C); inp (B,T) the tokens. fresh: dwpe
    written, and dwte unless dwte_fresh says otherwise (a tied LM head may have written it
    already); a written dwte is zeroed, then rows scattered in: no V x C temporary."""
    T, C = dout.shape[1:]
    if fresh if dwte_fresh is None else dwte_fresh:
        dwte.fill(0)
    if fresh:
        dwpe[T:] = 0  # positions past T get no gradient
        np.sum(dout, axis=0, out=dwpe[:T])
    else:
        dwpe[:T] += dout.sum(axis=0)
    np.add.at(dwte, inp.reshape(-1), dout.reshape(-1, C))  # repeated tokens add up


# ----------------------------------------------------------------------------------------
# layernorm


def layernorm_forward(
    out: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    inp: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray,
) -> None:
    """out (B,T,C) = (inp - mean) * rstd * weight + bias; saves mean, rstd (B,T)."""
    C = inp.shape[-1]
    np.mean(inp, axis=-1, out=mean)
    np.subtract(inp, mean[..., None], out=out)
    var = np.einsum("...c,...c->...", out, out)  # biased variance * C, no (B,T,C) temporary
    var *= 1.0 / C
    var += LN_EPS
    np.sqrt(var, out=var)
    np.divide(1.0, var, out=rstd)
    out *= rstd[..., None]
    out *= weight
    out += bias


def layernorm_backward(
    dinp: np.ndarray,
    dweight: np.ndarray,
    dbias: np.ndarray,
    dout: np.ndarray,
    inp: np.ndarray,
    weight: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    fresh: bool = False,
) -> None:
    """dinp (B,T,C), dweight (C,), dbias (C,) += from dout (B,T,C); mean, rstd (B,T) saved.
    fresh: dweight, dbias written (dinp is always added to: it is the residual stream's)."""
    C = inp.shape[-1]
    norm = inp - mean[..., None]
    norm *= rstd[..., None]
    if fresh:
        dbias.fill(0)
        dweight.fill(0)
    dbias += dout.reshape(-1, C).sum(axis=0)
    dweight += np.einsum("nc,nc->c", dout.reshape(-1, C), norm.reshape(-1, C))
    dnorm = dout * weight
    # dinp = rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)), with norm reused in place
    dnorm_mean = dnorm.mean(axis=-1, keepdims=True)
    dnorm_norm_mean = np.einsum("...c,...c->...", dnorm, norm)[..., None]
    dnorm_norm_mean *= 1.0 / C
    norm *= dnorm_norm_mean
    dnorm -= dnorm_mean
    dnorm -= norm
    dnorm *= rstd[..., None]
    dinp += dnorm


# ----------------------------------------------------------------------------------------
# matmul with bias


def matmul_forward(
    out: np.ndarray, inp: np.ndarray, weight: np.ndarray, bias: np.ndarray | None
) -> None:
    """out (B,T,OC) = inp (B,T,C) @ weight.T + bias; weight (OC,C), bias (OC,) or None."""
    OC, C = weight.shape
    np.matmul(inp.reshape(-1, C), weight.T, out=out.reshape(-1, OC))
    if bias is not None:
        out += bias


def matmul_backward(
    dinp: np.ndarray | None,
    dweight: np.ndarray,
    dbias: np.ndarray | None,
    dout: np.ndarray,
    inp: np.ndarray,
    weight: np.ndarray,
    dinp_fresh: bool = False,
    fresh: bool = False,
) -> None:
    """dinp (B,T,C) (skipped if None), dweight (OC,C), dbias (OC,) += from dout (B,T,OC).
    dinp_fresh: dinp written; fresh: dweight and dbias written."""
    OC, C = weight.shape
    dout2 = dout.reshape(-1, OC)
    if dinp is not None:
        d = dinp.reshape(-1, C)  # a view: dinp must be C-contiguous
        if dinp_fresh:
            d.fill(0)
        d += dout2 @ weight
    if fresh:
        dweight.fill(0)
    dweight += dout2.T @ inp.reshape(-1, C)
    if dbias is not None:
        if fresh:
            dbias.fill(0)
        dbias += dout2.sum(axis=0)


# ----------------------------------------------------------------------------------------
# causal multi-head self-attention


@lru_cache(maxsize=8)
def _future(T: int) -> np.ndarray:
    """(T,T) bool, True where key position > query position (masked out)."""
    return np.triu(np.ones((T, T), dtype=bool), k=1)


def attention_forward(
    out: np.ndarray, att: np.ndarray, inp: np.ndarray, NH: int, causal: bool = True
) -> None:
    """out (B,T,C), att (B,NH,T,T) saved softmax; inp (B,T,3C) holds q, k, v side by side.

    att = softmax(q @ k^T / sqrt(hs)) with future keys masked (causal=False: none, BERT's
    bidirectional encoder), out = att @ v. The batched
    matmuls run over (B,NH) on strided views, each (T,hs) slice a plain BLAS operand.
    """
    B, T, C3 = inp.shape
    hs = C3 // 3 // NH
    q, k, v = inp.reshape(B, T, 3, NH, hs).transpose(2, 0, 3, 1, 4)  # each (B,NH,T,hs)
    np.matmul(q, k.swapaxes(-1, -2), out=att)
    att *= 1.0 / math.sqrt(hs)
    if causal:
        np.copyto(att, -np.inf, where=_future(T))
    att -= att.max(axis=-1, keepdims=True)  # the diagonal is never masked: max is finite
    np.exp(att, out=att)
    att /= att.sum(axis=-1, keepdims=True)
    np.matmul(att, v, out=out.reshape(B, T, NH, hs).transpose(0, 2, 1, 3))


def attention_backward(
    dinp: np.ndarray,
    dout: np.ndarray,
    inp: np.ndarray,
    att: np.ndarray,
    NH: int,
    fresh: bool = False,
) -> None:
    """dinp (B,T,3C) += from dout (B,T,C); inp (B,T,3C) and att (B,NH,T,T) from forward.
    fresh: dinp written."""
    if fresh:
        dinp.fill(0)
    B, T, C3 = inp.shape
    hs = C3 // 3 // NH
    q, k, v = inp.reshape(B, T, 3, NH, hs).transpose(2, 0, 3, 1, 4)
    dq, dk, dv = dinp.reshape(B, T, 3, NH, hs).transpose(2, 0, 3, 1, 4)  # views into dinp
    do = dout.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)
    dv += att.swapaxes(-1, -2) @ do
    datt = do @ v.swapaxes(-1, -2)
    # softmax backward: dpreatt = att * (datt - sum(att * datt)); masked entries have att = 0
    datt -= np.einsum("...ij,...ij->...i", att, datt)[..., None]
    datt *= att
    datt *= 1.0 / math.sqrt(hs)
    dq += datt @ k
    dk += datt.swapaxes(-1, -2) @ q


# ----------------------------------------------------------------------------------------
# residual add and GELU


def residual_forward(out: np.ndarray, inp1: np.ndarray, inp2: np.ndarray) -> None:
    """out = inp1 + inp2, all (B,T,C)."""
    np.add(inp1, inp2, out=out)


def residual_backward(dinp1: np.ndarray, dinp2: np.ndarray, dout: np.ndarray) -> None:
    """dinp1, dinp2 += dout, all (B,T,C)."""
    dinp1 += dout
    dinp2 += dout


def gelu_forward(out: np.ndarray, inp: np.ndarray) -> None:
    """out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), any shape; in place, no temps."""
    np.multiply(inp, inp, out=out)
    out *= inp
    out *= 0.044715
    out += inp
    out *= GELU_SCALE
    np.tanh(out, out=out)
    out += 1.0
    out *= inp
    out *= 0.5


def gelu_backward(dinp: np.ndarray, inp: np.ndarray, dout: np.ndarray, fresh: bool = False) -> None:
    """dinp += gelu'(inp) * dout, any shape; recomputes tanh from inp like llm.c. fresh:
    dinp written."""
    x2 = inp * inp
    th = x2 * 0.044715
    th += 1.0
    th *= inp
    th *= GELU_SCALE
    np.tanh(th, out=th)
    # gelu'(x) = 0.5 (1 + th) + 0.5 x (1 - th^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
    x2 *= 3 * 0.044715
    x2 += 1.0
    x2 *= inp
    x2 *= 0.5 * GELU_SCALE
    sech2 = th * th
    np.subtract(1.0, sech2, out=sech2)
    x2 *= sech2
    th += 1.0
    th *= 0.5
    th += x2
    th *= dout
    if fresh:
        dinp[...] = th
    else:
        dinp += th


# ----------------------------------------------------------------------------------------
# fused classifier: LM head (tied wte) + softmax + cross-entropy, like llm.c's fused_classifier


def _chunk_rows(N: int, V: int, chunk: int) -> int:
    return max(1, min(N, chunk // V))


def classifier_forward(
    lse: np.ndarray,
    inp: np.ndarray,
    wte: np.ndarray,
    targets: np.ndarray,
    dlogits: np.ndarray | None = None,
    dloss: float = 1.0,
    chunk: int = CLASSIFIER_CHUNK,
) -> float:
    """Mean over B*T of -log softmax(inp @ wte.T)[target]; inp (B,T,C), wte (V,C).

    targets (B,T) int. Writes lse (B,T), each row's log-sum-exp of logits, for backward.
    Logits are made chunk // V rows at a time and never kept; with dlogits (B*T, V) given,
    the gradient of dloss * mean loss w.r.t. the logits is left there instead, for
    classifier_backward_saved (llm.c's fused classifier).
    """
    V, C = wte.shape
    x, t, lse1 = inp.reshape(-1, C), targets.reshape(-1), lse.reshape(-1)
    N = x.shape[0]
    R = _chunk_rows(N, V, chunk)
    buf = np.empty((R, V), dtype=inp.dtype)
    total = 0.0
    for i in range(0, N, R):
        n = min(R, N - i)
        logits = buf[:n]
        np.matmul(x[i : i + n], wte.T, out=logits)
        target_logit = logits[np.arange(n), t[i : i + n]]  # a copy, taken before exp
        mx = logits.max(axis=1)
        logits -= mx[:, None]
        np.exp(logits, out=logits)
        np.log(logits.sum(axis=1), out=lse1[i : i + n])
        lse1[i : i + n] += mx
        total += float((lse1[i : i + n] - target_logit).sum())
        if dlogits is not None:  # (softmax - onehot) * dloss / N
            d = dlogits[i : i + n]
            np.divide(logits, logits.sum(axis=1, keepdims=True), out=d)
            d[np.arange(n), t[i : i + n]] -= 1.0
            d *= float(dloss) / N
    return total / N


def classifier_backward_saved(
    dinp: np.ndarray,
    dwte: np.ndarray,
    inp: np.ndarray,
    wte: np.ndarray,
    dlogits: np.ndarray,
    dinp_fresh: bool = False,
    fresh: bool = False,
) -> None:
    """dinp (B,T,C) += dlogits @ wte, dwte (V,C) += dlogits.T @ inp; dlogits (B*T,V) left by
    classifier_forward. dinp_fresh, fresh: dinp, dwte written (as matmul_backward)."""
    matmul_backward(dinp, dwte, None, dlogits, inp, wte, dinp_fresh, fresh)  # no bias


def classifier_backward(
    dinp: np.ndarray,
    dwte: np.ndarray,
    inp: np.ndarray,
    wte: np.ndarray,
    targets: np.ndarray,
    lse: np.ndarray,
    dloss: float = 1.0,
    chunk: int = CLASSIFIER_CHUNK,
    dinp_fresh: bool = False,
    fresh: bool = False,
) -> None:
    """dinp (B,T,C) and dwte (V,C) += gradient of dloss * mean loss; lse (B,T) from forward.
    dinp_fresh, fresh: dinp, dwte written.

    Recomputes each chunk's logits (one more matmul than keeping them, the price of never
    holding B*T*V), then dlogits = (softmax - onehot(target)) * dloss / (B*T).
    """
    if dinp_fresh:
        dinp.fill(0)
    if fresh:
        dwte.fill(0)
    V, C = wte.shape
    x, t, lse1 = inp.reshape(-1, C), targets.reshape(-1), lse.reshape(-1)
    dx = dinp.reshape(-1, C)  # a view: dinp must be C-contiguous
    N = x.shape[0]
    R = _chunk_rows(N, V, chunk)
    buf = np.empty((R, V), dtype=inp.dtype)
    for i in range(0, N, R):
        n = min(R, N - i)
        dlogits = buf[:n]
        np.matmul(x[i : i + n], wte.T, out=dlogits)
        dlogits -= lse1[i : i + n, None]
        np.exp(dlogits, out=dlogits)  # softmax probabilities
        dlogits[np.arange(n), t[i : i + n]] -= 1.0
        dlogits *= float(dloss) / N  # a Python float: a NumPy float64 would upcast the loop
        dx[i : i + n] += dlogits @ wte
        dwte += dlogits.T @ x[i : i + n]


# ----------------------------------------------------------------------------------------
# AdamW, like llm.c's gpt2_update


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
    """One AdamW step in place on flat arrays; t is the step number counted from 1.

    m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
    p -= lr * (m / (1-b1^t) / (sqrt(v / (1-b2^t)) + eps) + weight_decay * p)
    """
    lr, weight_decay = float(lr), float(weight_decay)  # NumPy float64 scalars would upcast
    tmp = np.multiply(grads, 1.0 - beta1)  # the one temporary, reused below
    m *= beta1
    m += tmp
    np.multiply(grads, grads, out=tmp)
    tmp *= 1.0 - beta2
    v *= beta2
    v += tmp
    np.multiply(v, 1.0 / (1.0 - beta2**t), out=tmp)
    np.sqrt(tmp, out=tmp)
    tmp += eps
    np.divide(m, tmp, out=tmp)
    tmp *= lr / (1.0 - beta1**t)
    if weight_decay:
        params *= 1.0 - lr * weight_decay  # decoupled decay of the pre-update params
    params -= tmp
