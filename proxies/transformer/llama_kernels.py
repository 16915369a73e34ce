"""LLaMA's kernels beside GPT's (kernels.py, fast.py): RMSNorm, rotary position embeddings,
SwiGLU and grouped-query causal attention, forward and backward, in NumPy.

Conventions as kernels.py: shapes (B,T,*), backward kernels accumulate into their outputs
unless `fresh` (then they write). Letters: NH query heads, KVH key/value heads, G = NH/KVH
query heads per kv head (query head h reads kv head h // G, as Meta's repeat_kv), hs head
size, F the SwiGLU hidden width.
"""

from __future__ import annotations

import math

import numpy as np

# ----------------------------------------------------------------------------------------
# RMSNorm: out = inp / sqrt(mean(inp^2) + eps) * weight


def rmsnorm_forward(
    out: np.ndarray, rstd: np.ndarray, inp: np.ndarray, weight: np.ndarray, eps: float = 1e-5
) -> None:
    """out (B,T,C), rstd (B,T) saved for the backward."""
    ms = np.einsum("...c,...c->...", inp, inp) / inp.shape[-1]
    np.divide(1.0, np.sqrt(ms + eps), out=rstd)
    np.multiply(inp, rstd[..., None], out=out)
    out *= weight


def rmsnorm_backward(
    dinp: np.ndarray,
    dweight: np.ndarray,
    dout: np.ndarray,
    inp: np.ndarray,
    weight: np.ndarray,
    rstd: np.ndarray,
    fresh: bool = False,
) -> None:
    """dinp (B,T,C) += ; dweight (C,) += (written if fresh). With n = inp * rstd:
    dinp = rstd * (dout*w - n * mean(dout*w . n))."""
    C = inp.shape[-1]
    norm = inp * rstd[..., None]
    dw = np.einsum("nc,nc->c", dout.reshape(-1, C), norm.reshape(-1, C))
    if fresh:
        dweight[...] = dw
    else:
        dweight += dw
    dn = dout * weight
    dot = np.einsum("...c,...c->...", dn, norm)[..., None] / C
    dn -= norm * dot
    dn *= rstd[..., None]
    dinp += dn


# ----------------------------------------------------------------------------------------
# rotary position embeddings (Su et al. 2021; Meta's pairing: (x[2i], x[2i+1]) rotated by
# position * theta^(-2i/hs))


def rope_tables(positions: np.ndarray, hs: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each (T, hs/2), at the tokens' true positions (a cp rank passes its own)."""
    inv = theta ** (-np.arange(0, hs, 2, dtype=np.float64) / hs)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang), np.sin(ang)


def rope_forward(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """Rotate x (B,T,H,hs) in place; cos, sin (T, hs/2)."""
    c, s = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    a = x0 * c - x1 * s
    x1[...] = x0 * s + x1 * c
    x0[...] = a


def rope_backward(dx: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """The rotation's transpose (by minus the angle), in place on the gradient dx (B,T,H,hs)."""
    rope_forward(dx, cos, -sin)


# ----------------------------------------------------------------------------------------
# SwiGLU: inp (B,T,2F) = [gate | up], out (B,T,F) = silu(gate) * up


def swiglu_forward(out: np.ndarray, inp: np.ndarray) -> None:
    F = out.shape[-1]
    g, u = inp[..., :F], inp[..., F:]
    np.multiply(g, 1.0 / (1.0 + np.exp(-g)), out=out)
    out *= u


def swiglu_backward(
    dinp: np.ndarray, inp: np.ndarray, dout: np.ndarray, fresh: bool = False
) -> None:
    """dinp (B,T,2F) += (written if fresh). silu'(g) = s (1 + g (1 - s)), s = sigmoid(g)."""
    F = dout.shape[-1]
    g, u = inp[..., :F], inp[..., F:]
    s = 1.0 / (1.0 + np.exp(-g))
    dg = dout * u * s * (1.0 + g * (1.0 - s))
    du = dout * g * s
    if fresh:
        dinp[..., :F], dinp[..., F:] = dg, du
    else:
        dinp[..., :F] += dg
        dinp[..., F:] += du


# ----------------------------------------------------------------------------------------
# grouped-query causal attention: inp (B,T,(NH + 2 KVH) hs) = [q | k | v]


def _split(inp: np.ndarray, NH: int, KVH: int):
    """q (B,KVH,G,T,hs), k and v (B,KVH,1,T,hs): views into inp."""
    B, T, W = inp.shape
    hs = W // (NH + 2 * KVH)
    G = NH // KVH
    q = inp[..., : NH * hs].reshape(B, T, KVH, G, hs).transpose(0, 2, 3, 1, 4)
    k = inp[..., NH * hs : (NH + KVH) * hs].reshape(B, T, KVH, 1, hs).transpose(0, 2, 3, 1, 4)
    v = inp[..., (NH + KVH) * hs :].reshape(B, T, KVH, 1, hs).transpose(0, 2, 3, 1, 4)
    return q, k, v, hs, G


def gqa_forward(out: np.ndarray, att: np.ndarray, inp: np.ndarray, NH: int, KVH: int) -> None:
    """out (B,T,NH hs), att (B,NH,T,T) the saved softmax; future keys masked. The k and v of a
    kv head broadcast over its G query heads (no repeated copy)."""
    B, T, _ = inp.shape
    q, k, v, hs, G = _split(inp, NH, KVH)
    a = att.reshape(B, KVH, G, T, T)
    np.matmul(q, k.swapaxes(-1, -2), out=a)
    a *= 1.0 / math.sqrt(hs)
    np.copyto(a, -np.inf, where=np.triu(np.ones((T, T), dtype=bool), k=1))
    a -= a.max(axis=-1, keepdims=True)
    np.exp(a, out=a)
    a /= a.sum(axis=-1, keepdims=True)
    np.matmul(a, v, out=out.reshape(B, T, KVH, G, hs).transpose(0, 2, 3, 1, 4))


def gqa_backward(
    dinp: np.ndarray,
    dout: np.ndarray,
    inp: np.ndarray,
    att: np.ndarray,
    NH: int,
    KVH: int,
    fresh: bool = False,
) -> None:
    """dinp (B,T,(NH + 2 KVH) hs) += from dout (B,T,NH hs); a kv head's gradient is the sum
    over the G query heads sharing it."""
    if fresh:
        dinp.fill(0)
    B, T, _ = inp.shape
    q, k, v, hs, G = _split(inp, NH, KVH)
    dq, dk, dv, _, _ = _split(dinp, NH, KVH)
    a = att.reshape(B, KVH, G, T, T)
    do = dout.reshape(B, T, KVH, G, hs).transpose(0, 2, 3, 1, 4)
    dv += (a.swapaxes(-1, -2) @ do).sum(axis=2, keepdims=True)
    datt = do @ v.swapaxes(-1, -2)
    datt -= np.einsum("...ij,...ij->...i", a, datt)[..., None]
    datt *= a
    datt *= 1.0 / math.sqrt(hs)
    dq += datt @ k
    dk += (datt.swapaxes(-1, -2) @ q).sum(axis=2, keepdims=True)
