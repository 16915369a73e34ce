"""Causal attention split over N context-parallel ranks by tokens (cp.py's splits): the
kernels of a rank's share and the buffer layouts of the collectives around them.

Conventions as fast.py: float32 (any float dtype works), q, k, v from a (B,T,3C) qkv buffer
(q | k | v, each NH heads of hs), the 1/sqrt(hs) scale on the T x hs operands, results into
out= buffers, `fresh=` gradients written instead of added to. Letters: B batch, T the whole
sequence, Tl = T/N a rank's tokens (pos, its ascending positions), C channels, NH heads,
hs = C/NH. Keys and values travel as kv (B,*,2C) buffers (k | v): a third less than qkv.

Three families, as real context parallelism issues them:
- all-gather (llm.c's MPI port, Llama 3): every rank gathers all tokens' kv (kv_pack, an
  all-gather in rank order, place), computes its queries against them
  (allgather_forward / allgather_backward), and the partial dkv of every token is summed
  back to the token's owner (take, a reduce-scatter, kv_unpack_add).
- ring (ring attention): kv blocks go round the ranks point to point; a rank computes its
  queries against each block (ring_forward_block, log-sum-exp per row) and merges the
  partials (ring_merge, the online softmax); the backward, given the final out and lse
  (as FlashAttention's), redoes each block (ring_backward_block), dkv of the block sent
  on with it back to its owner.
- Ulysses (DeepSpeed): all-to-all from sequence-sharded (B,Tl,3C) to head-sharded
  (B,T,3C/N) (ulysses_pack, the all-to-all, place), unsplit attention over NH/N heads
  (fast.attention_forward / _backward), and back for out (take, all-to-all,
  ulysses_unpack); the backward the same way in reverse. NH % N == 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

# Queries per block of the all-gather kernels: a block multiplies the keys up to its last
# query's position, its queries' keys past their own positions masked (cp.computed_pairs).
# 64 rows keep the GEMMs efficient; the waste is at most 64/Tl of a contiguous or zigzag
# rank's pairs, about N x 64/T of an interleaved one's (queries N positions apart). Blocks
# of 64/N interleaved queries waste no more but ran 1.5x slower at T = 4096 (k and v read
# N times as often, smaller GEMMs): README, "Context parallelism".
BLOCK_Q = 64


# ----------------------------------------------------------------------------------------
# views and layouts


def _q(qkv: np.ndarray, NH: int) -> np.ndarray:
    """q as a (B,NH,Tq,hs) strided view of qkv (B,Tq,3C)."""
    B, T, C3 = qkv.shape
    return qkv.reshape(B, T, 3, NH, C3 // 3 // NH)[:, :, 0].transpose(0, 2, 1, 3)


def _kv(kv: np.ndarray, NH: int) -> tuple[np.ndarray, np.ndarray]:
    """k, v as (B,NH,Tk,hs) strided views of kv (B,Tk,2C)."""
    B, T, C2 = kv.shape
    k, v = kv.reshape(B, T, 2, NH, C2 // 2 // NH).transpose(2, 0, 3, 1, 4)
    return k, v


def _heads(x: np.ndarray, NH: int) -> np.ndarray:
    """(B,T,C) -> (B,NH,T,hs) strided view."""
    B, T, C = x.shape
    return x.reshape(B, T, NH, C // NH).transpose(0, 2, 1, 3)


# Grouped-query attention (LLaMA): KVH key/value heads, each shared by G = NH/KVH query
# heads. The kernels below take KVH (None: NH) and then see q as (B,KVH,G,Tq,hs) and k, v
# as (B,KVH,1,Tk,hs), so one kv head's scores broadcast over its G query heads; a kv
# gradient sums its G heads' (_sum_groups). qkv is (B,Tq,(NH + 2 KVH) hs), kv (B,Tk,2 KVH hs).


def _qg(qkv: np.ndarray, NH: int, KVH: int | None) -> np.ndarray:
    """q as _q's (B,NH,Tq,hs), or grouped (B,KVH,G,Tq,hs)."""
    if KVH is None or KVH == NH:
        return _q(qkv, NH)
    B, T, W = qkv.shape
    hs = W // (NH + 2 * KVH)
    return qkv[..., : NH * hs].reshape(B, T, KVH, NH // KVH, hs).transpose(0, 2, 3, 1, 4)


def _kvg(kv: np.ndarray, NH: int, KVH: int | None) -> tuple[np.ndarray, np.ndarray]:
    """k, v as _kv's (B,NH,Tk,hs), or grouped (B,KVH,1,Tk,hs)."""
    if KVH is None or KVH == NH:
        return _kv(kv, NH)
    B, T, W = kv.shape
    k, v = kv.reshape(B, T, 2, KVH, 1, W // 2 // KVH).transpose(2, 0, 3, 4, 1, 5)
    return k, v


def _like_q(x: np.ndarray, q: np.ndarray) -> np.ndarray:
    """x (B,T,NH hs) (an output) as a view with q's head axes: (B,NH,T,hs) or grouped."""
    B, T = x.shape[:2]
    return np.moveaxis(x.reshape(B, T, *q.shape[1:-2], q.shape[-1]), 1, -2)


def _sum_groups(x: np.ndarray) -> np.ndarray:
    """A key/value gradient from every query head: summed over each kv head's group."""
    return x.sum(axis=2, keepdims=True) if x.ndim == 5 else x


def _mask(s: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray) -> None:
    """Scores s (..., len(q_pos), len(k_pos)) get -inf where the key is after the query.
    Keys up to the first query's position are seen by every row: only the rest is touched."""
    j = int(np.searchsorted(k_pos, q_pos[0], side="right"))
    if j < len(k_pos):
        s[..., j:] += np.where(k_pos[None, j:] > q_pos[:, None], -np.inf, 0.0).astype(s.dtype)


def kv_pack(send: np.ndarray, qkv: np.ndarray) -> int:
    """send (B,Tl,2C) contiguous <- the k | v of qkv (B,Tl,3C): what a rank all-gathers or
    sends round the ring (GQA: the last 2 KVH hs of each row). Returns the element count."""
    send[...] = qkv[..., qkv.shape[-1] - send.shape[-1] :]
    return send.size


def kv_unpack_add(dqkv: np.ndarray, dkv: np.ndarray, fresh: bool = False) -> None:
    """dqkv's k | v part (B,Tl,2C of the 3C) += dkv (B,Tl,2C), this rank's tokens' summed
    key/value gradients (fresh: written). GQA: the last 2 KVH hs of each row."""
    C = dqkv.shape[-1] - dkv.shape[-1]
    if fresh:
        dqkv[..., C:] = dkv
    else:
        dqkv[..., C:] += dkv


def place(xg: np.ndarray, recv: np.ndarray, positions: list[np.ndarray]) -> None:
    """xg (B,T,W) in global token order <- recv (N,B,Tl,W), block r from rank r holding
    positions[r]: the receive side of the all-gather (W = 2C, kv) and of Ulysses' all-to-all
    (W = 3C/N, a head shard). With the contiguous split a plain copy."""
    for r, pos in enumerate(positions):
        xg[:, pos] = recv[r]


def take(send: np.ndarray, xg: np.ndarray, positions: list[np.ndarray]) -> int:
    """send (N,B,Tl,W) contiguous, block r = xg (B,T,W)'s rows at positions[r]: the send
    side of the reduce-scatter of dkv (summed over ranks, block r lands on rank r) and of
    Ulysses' all-to-all back to sequence shards. Returns the count per peer."""
    for r, pos in enumerate(positions):
        send[r] = xg[:, pos]
    return send[0].size


# ----------------------------------------------------------------------------------------
# all-gather family


def _blocks(
    pos: np.ndarray, B: int, NH: int, block: int | None
) -> Iterator[tuple[int, int, int, int]]:
    """(a, b, n, offset): query rows [a, b), keys [0, n) up to row b-1's position, and
    where the block's (B,NH,b-a,n) softmax starts in the saved att buffer."""
    off = 0
    for a in range(0, len(pos), block):
        b = min(a + block, len(pos))
        n = int(pos[b - 1]) + 1
        yield a, b, n, off
        off += B * NH * (b - a) * n


def att_size(pos: np.ndarray, B: int, NH: int, block: int = BLOCK_Q) -> int:
    """Elements of the att buffer allgather_forward saves: B NH cp.computed_pairs."""
    return sum(B * NH * (b - a) * n for a, b, n, _ in _blocks(pos, B, NH, block))


def allgather_forward(
    out: np.ndarray,
    att: np.ndarray,
    qkv: np.ndarray,
    kv: np.ndarray,
    pos: np.ndarray,
    NH: int,
    block: int = BLOCK_Q,
    KVH: int | None = None,
) -> None:
    """Causal attention of this rank's queries against all tokens' keys and values.

    out (B,Tl,C) written; att (att_size,) the saved softmax, block after block; qkv
    (B,Tl,3C) this rank's tokens (its q used); kv (B,T,2C) every token's k | v in global
    order (gathered); pos (Tl,) the query positions, ascending. Queries go in blocks of
    `block` rows, each against keys [0, its last position]: no key block past the causal
    frontier is computed."""
    B, Tl, _ = qkv.shape
    q, (k, v) = _qg(qkv, NH, KVH), _kvg(kv, NH, KVH)
    o = _like_q(out, q)
    heads = q.shape[1:-2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    keys = np.arange(kv.shape[1])
    for a, b, n, off in _blocks(pos, B, NH, block):
        s = att[off : off + B * NH * (b - a) * n].reshape(B, *heads, b - a, n)
        np.matmul(q[..., a:b, :] * scale, k[..., :n, :].swapaxes(-1, -2), out=s)
        _mask(s, pos[a:b], keys[:n])
        s -= s.max(axis=-1, keepdims=True)  # every query sees its own key: finite
        np.exp(s, out=s)
        s *= 1.0 / s.sum(axis=-1, keepdims=True)
        np.matmul(s, v[..., :n, :], out=o[..., a:b, :])


def allgather_backward(
    dqkv: np.ndarray,
    dkv: np.ndarray,
    dout: np.ndarray,
    qkv: np.ndarray,
    kv: np.ndarray,
    att: np.ndarray,
    pos: np.ndarray,
    NH: int,
    block: int = BLOCK_Q,
    fresh: bool = False,
    KVH: int | None = None,
) -> None:
    """The backward of allgather_forward (same qkv, kv, att, pos, block), from dout (B,Tl,C).

    dqkv (B,Tl,3C): its q part += the queries' gradient (fresh: written), k | v untouched.
    dkv (B,T,2C): += this rank's share of every token's key/value gradient (fresh: written,
    zeros past its last query), partial: summed over the ranks by a reduce-scatter (take,
    then kv_unpack_add)."""
    B, Tl, _ = qkv.shape
    q, (k, v) = _qg(qkv, NH, KVH), _kvg(kv, NH, KVH)
    dq, (dk, dv) = _qg(dqkv, NH, KVH), _kvg(dkv, NH, KVH)
    do = _like_q(dout, q)
    heads = q.shape[1:-2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    if fresh:
        dkv[...] = 0.0  # blocks overlap in keys: they add
    for a, b, n, off in _blocks(pos, B, NH, block):
        p = att[off : off + B * NH * (b - a) * n].reshape(B, *heads, b - a, n)
        dv[..., :n, :] += _sum_groups(p.swapaxes(-1, -2) @ do[..., a:b, :])
        ds = do[..., a:b, :] @ v[..., :n, :].swapaxes(-1, -2)  # dP (B,NH,b-a,n)
        ds -= np.einsum("...ij,...ij->...i", p, ds)[..., None]  # softmax backward; masked p = 0
        ds *= p
        if fresh:
            np.matmul(ds, k[..., :n, :], out=dq[..., a:b, :])
            dq[..., a:b, :] *= scale
        else:
            dq[..., a:b, :] += (ds @ k[..., :n, :]) * scale
        dk[..., :n, :] += _sum_groups(ds.swapaxes(-1, -2) @ (q[..., a:b, :] * scale))


# ----------------------------------------------------------------------------------------
# ring family


def _ring_range(q_pos: np.ndarray, k_pos: np.ndarray) -> tuple[int, int]:
    """(qa, kn): only queries [qa:] (at or after the block's first key) and keys [:kn] (at or
    before the last query) meet causally; qa == len(q_pos) or kn == 0: none do."""
    qa = int(np.searchsorted(q_pos, k_pos[0], side="left"))
    kn = int(np.searchsorted(k_pos, q_pos[-1], side="right"))
    return qa, kn


def ring_forward_block(
    out: np.ndarray,
    lse: np.ndarray,
    qkv: np.ndarray,
    q_pos: np.ndarray,
    kv: np.ndarray,
    k_pos: np.ndarray,
    NH: int,
    KVH: int | None = None,
) -> bool:
    """One ring step: this rank's queries (qkv (B,Tq,3C) at q_pos) against one kv block
    (kv (B,Tk,2C) at k_pos; both ascending).

    out (B,Tq,C) written: each query's values weighted by its softmax over this block's
    keys only; lse (B,NH,Tq) written: the log-sum-exp of its scaled scores, -inf (out 0)
    for a query that sees none of them. Only the queries at or after the block's first key
    and the keys up to the last query are computed (zigzag's half blocks). False when no
    pair is causal: the step can be skipped (ring_merge with it changes nothing)."""
    qa, kn = _ring_range(q_pos, k_pos)
    out[:, :qa] = 0.0
    lse[:, :, :qa] = -np.inf
    if qa == len(q_pos) or kn == 0:
        return False
    q, (k, v) = _qg(qkv, NH, KVH), _kvg(kv, NH, KVH)
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = (q[..., qa:, :] * scale) @ k[..., :kn, :].swapaxes(-1, -2)  # (B,NH,Tq-qa,kn)
    _mask(s, q_pos[qa:], k_pos[:kn])
    m = s.max(axis=-1, keepdims=True)  # query qa: sees the first key: finite
    s -= m
    np.exp(s, out=s)
    total = s.sum(axis=-1, keepdims=True)
    s /= total
    np.matmul(s, v[..., :kn, :], out=_like_q(out, q)[..., qa:, :])
    lse.reshape(*q.shape[:-2], -1)[..., qa:] = (m + np.log(total))[..., 0]
    return True


def ring_merge(out: np.ndarray, lse: np.ndarray, out_b: np.ndarray, lse_b: np.ndarray) -> None:
    """The online softmax: (out, lse) (B,Tq,C), (B,NH,Tq), the keys merged so far, <- merged
    with one block's (out_b, lse_b): lse' = log(e^lse + e^lse_b), out' = out e^(lse - lse')
    + out_b e^(lse_b - lse'). A row at -inf on both sides stays 0 / -inf."""
    new = np.logaddexp(lse, lse_b)
    seen = np.isfinite(new)
    with np.errstate(invalid="ignore"):  # -inf - -inf where a row has no key yet
        w = np.where(seen, np.exp(lse - new), 0.0).astype(out.dtype)
        w_b = np.where(seen, np.exp(lse_b - new), 0.0).astype(out.dtype)
    o, o_b = _heads(out, lse.shape[1]), _heads(out_b, lse.shape[1])
    o *= w[..., None]
    o += o_b * w_b[..., None]
    lse[...] = new


def ring_delta(delta: np.ndarray, dout: np.ndarray, out: np.ndarray, NH: int) -> None:
    """delta (B,NH,Tq) = per head, the row sums of dout * out (final out): FlashAttention's
    D, the softmax backward's sum(P * dP) without P."""
    np.einsum("bhtd,bhtd->bht", _heads(dout, NH), _heads(out, NH), out=delta)


def ring_backward_block(
    dqkv: np.ndarray,
    dkv: np.ndarray,
    dout: np.ndarray,
    qkv: np.ndarray,
    q_pos: np.ndarray,
    kv: np.ndarray,
    k_pos: np.ndarray,
    lse: np.ndarray,
    delta: np.ndarray,
    NH: int,
    dq_fresh: bool = False,
    fresh: bool = False,
    KVH: int | None = None,
) -> None:
    """The backward of one ring step, given the merged (final) lse and delta (ring_delta):
    the block's softmax is recomputed as exp(scores - lse), nothing saved per block.

    dqkv (B,Tq,3C): its q part += this block's share of dq (dq_fresh: written), k | v
    untouched. dkv (B,Tk,2C): += the block's key/value gradient from these queries (fresh:
    written), sent on round the ring with the block to its owner."""
    qa, kn = _ring_range(q_pos, k_pos)
    dq = _qg(dqkv, NH, KVH)
    if dq_fresh:
        dq[...] = 0.0
    if fresh:
        dkv[...] = 0.0
    if qa == len(q_pos) or kn == 0:
        return
    q, (k, v) = _qg(qkv, NH, KVH), _kvg(kv, NH, KVH)
    dk, dv = _kvg(dkv, NH, KVH)
    do = _like_q(dout, q)[..., qa:, :]
    heads = q.shape[:-2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    qs = q[..., qa:, :] * scale
    p = qs @ k[..., :kn, :].swapaxes(-1, -2)  # (B,NH,Tq-qa,kn)
    _mask(p, q_pos[qa:], k_pos[:kn])
    p -= lse.reshape(*heads, -1)[..., qa:, None]
    np.exp(p, out=p)  # the final softmax's columns of this block
    dv[..., :kn, :] += _sum_groups(p.swapaxes(-1, -2) @ do)
    ds = do @ v[..., :kn, :].swapaxes(-1, -2)  # dP
    ds -= delta.reshape(*heads, -1)[..., qa:, None]
    ds *= p
    dq[..., qa:, :] += (ds @ k[..., :kn, :]) * scale
    dk[..., :kn, :] += _sum_groups(ds.swapaxes(-1, -2) @ qs)


# ----------------------------------------------------------------------------------------
# Ulysses family


def ulysses_pack(
    send: np.ndarray, x: np.ndarray, N: int, parts: int, widths: tuple[int, ...] | None = None
) -> int:
    """Sequence- to head-sharded, the send side: x (B,Tl,parts*C), this rank's tokens with
    all heads (parts = 3 for qkv, 1 for dout), -> send (N,B,Tl,parts*C/N) contiguous, block j
    (for rank j) = heads [j NH/N, (j+1) NH/N) of each part. The receiver places the blocks
    in global order (place) into (B,T,parts*C/N): a qkv of NH/N heads. Count per peer.
    widths: the parts' unequal widths (GQA's qkv: NH hs, KVH hs, KVH hs), each split in N."""
    if widths is not None:
        B, Tl, _ = x.shape
        blocks, lo, at = send.reshape(N, B, Tl, -1), 0, 0
        for w in widths:
            part = x[..., lo : lo + w].reshape(B, Tl, N, w // N).transpose(2, 0, 1, 3)
            blocks[..., at : at + w // N] = part
            lo, at = lo + w, at + w // N
        return send[0].size
    B, Tl, W = x.shape
    C = W // parts
    send.reshape(N, B, Tl, parts, C // N)[...] = x.reshape(B, Tl, parts, N, C // N).transpose(
        3, 0, 1, 2, 4
    )
    return send[0].size


def ulysses_unpack(
    x: np.ndarray, recv: np.ndarray, parts: int, widths: tuple[int, ...] | None = None
) -> None:
    """Head- to sequence-sharded, the receive side: recv (N,B,Tl,parts*C/N), block j from
    rank j (its heads, this rank's tokens: take on the sender), -> x (B,Tl,parts*C) all
    heads. The inverse of ulysses_pack (parts = 1 for out, 3 for dqkv; widths as there)."""
    N, B, Tl, Wn = recv.shape
    if widths is not None:
        lo, at = 0, 0
        for w in widths:
            part = x[..., lo : lo + w].reshape(B, Tl, N, w // N)
            part[...] = recv[..., at : at + w // N].transpose(1, 2, 0, 3)
            lo, at = lo + w, at + w // N
        return
    x.reshape(B, Tl, parts, N, Wn // parts)[...] = recv.reshape(
        N, B, Tl, parts, Wn // parts
    ).transpose(1, 2, 3, 0, 4)
