"""DLRM layers as NumPy forward/backward kernel pairs.

Letters as in config.py: n rows of a batch (b locally, B for a table's lookups over the
global batch), C / OC a layer's input / output width, D embedding width, P pooling, R table
rows, NT tables, F = NT + 1 interaction vectors. A linear weight is (OC,C) (nn.Linear's
layout) and out = inp @ weight.T + bias.

Conventions, as in proxies/transformer/kernels.py (after llm.c):
- outputs first; forward kernels write into preallocated arrays and save what backward needs;
- backward kernels ACCUMULATE (+=) into dense gradient buffers, so callers zero them; the
  embedding bag's backward returns its gradient sparse (touched rows only), as DLRM's
  sparse embedding gradients;
- dtype-generic: float32 in runs, float64 in finite-difference tests.
"""

from __future__ import annotations

import numpy as np

# ----------------------------------------------------------------------------------------
# linear and ReLU (both MLPs)


def linear_forward(out: np.ndarray, inp: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> None:
    """out (n,OC) = inp (n,C) @ weight.T + bias; weight (OC,C), bias (OC,)."""
    np.matmul(inp, weight.T, out=out)
    out += bias


def linear_backward(
    dinp: np.ndarray | None,
    dweight: np.ndarray,
    dbias: np.ndarray,
    dout: np.ndarray,
    inp: np.ndarray,
    weight: np.ndarray,
) -> None:
    """dinp (n,C) (skipped if None), dweight (OC,C), dbias (OC,) += from dout (n,OC)."""
    if dinp is not None:
        dinp += dout @ weight
    dweight += dout.T @ inp
    dbias += dout.sum(axis=0)


def relu_forward(out: np.ndarray, inp: np.ndarray) -> None:
    """out = max(inp, 0); may run in place (out is inp)."""
    np.maximum(inp, 0, out=out)


def relu_backward(dinp: np.ndarray, dout: np.ndarray, out: np.ndarray) -> None:
    """dinp += dout where the forward's output was positive; out is the saved ReLU output."""
    dinp += np.where(out > 0, dout, 0)


# ----------------------------------------------------------------------------------------
# embedding bag: sum of P rows per sample


def embedding_bag_forward(out: np.ndarray, table: np.ndarray, idx: np.ndarray) -> None:
    """out (n,D) = sum over p of table[idx[:, p]]; table (R,D), idx (n,P) row ids."""
    np.sum(np.take(table, idx, axis=0), axis=1, out=out)


def embedding_bag_backward(dout: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The table's gradient from dout (n,D), sparse: (rows (U,) sorted and unique, drows (U,D)).
    idx (n,P): the bags of embedding_bag_forward (see embedding_bag_jagged_backward)."""
    n, P = idx.shape
    return embedding_bag_jagged_backward(dout, idx.reshape(-1), np.arange(n * P) // P)


def embedding_bag_jagged_forward(
    out: np.ndarray, table: np.ndarray, ids: np.ndarray, bag: np.ndarray
) -> None:
    """out (n,D): row g = the sum of table[ids[m]] over the m with bag[m] == g, zero where no
    id has that bag (a row-wise shard sees only the ids in its rows); ids, bag (M,), bag
    non-decreasing (ids grouped by bag, as a KeyedJaggedTensor's values)."""
    out[...] = 0
    if ids.size:
        starts = np.flatnonzero(np.concatenate(([True], bag[1:] != bag[:-1])))
        out[bag[starts]] = np.add.reduceat(np.take(table, ids, axis=0), starts, axis=0)


def embedding_bag_jagged_backward(
    dout: np.ndarray, ids: np.ndarray, bag: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The table's gradient from dout (n,D) for bags given as ids, bag (M,) (bag[m]: the row
    of dout id m was pooled into), sparse: (rows (U,) sorted and unique, drows (U,D)).

    Repeated rows add up. Sorting (stable) groups each row's contributions in bag order and
    they are added left to right, so the sum is the same whichever ranks the samples came
    from. The k-th contribution of every row that has one is added in one vectorised step:
    as many steps as the hottest row has hits, 7x faster than np.add.reduceat (one call per
    row) at B=2048, P=10, R=80,000.
    """
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    if not sorted_ids.size:
        return sorted_ids, np.zeros((0, dout.shape[1]), dtype=dout.dtype)
    starts = np.flatnonzero(np.concatenate(([True], sorted_ids[1:] != sorted_ids[:-1])))
    hits = np.diff(np.append(starts, sorted_ids.size))
    sample = bag[order]  # the bag each sorted id came from
    drows = dout[sample[starts]]
    for k in range(1, int(hits.max(initial=1))):
        more = np.flatnonzero(hits > k)
        drows[more] += dout[sample[starts[more] + k]]
    return sorted_ids[starts], drows


def embedding_sgd(table: np.ndarray, rows: np.ndarray, drows: np.ndarray, lr: float) -> None:
    """Sparse SGD: only the touched rows move (rows unique, so fancy indexing is exact)."""
    table[rows] -= lr * drows


# ----------------------------------------------------------------------------------------
# dot interaction (dlrm_s_pytorch's "dot", without self-interaction)


def pair_indices(F: int) -> tuple[np.ndarray, np.ndarray]:
    """(i, j) with i > j, in dlrm_s_pytorch's order: (1,0), (2,0), (2,1), (3,0) ..."""
    i, j = np.tril_indices(F, k=-1)
    return i, j


def interaction_forward(out: np.ndarray, Z: np.ndarray, x: np.ndarray, emb: np.ndarray) -> None:
    """out (n, D + F(F-1)/2) = [x, every dot Z_i . Z_j for i > j]; Z (n,F,D) = [x, emb] is
    saved for the backward; x (n,D) the bottom MLP output, emb (n,NT,D) the pooled bags."""
    n, F, D = Z.shape
    Z[:, 0] = x
    Z[:, 1:] = emb
    gram = Z @ Z.transpose(0, 2, 1)  # (n,F,F)
    i, j = pair_indices(F)
    out[:, :D] = x
    out[:, D:] = gram[:, i, j]


def interaction_backward(dx: np.ndarray, demb: np.ndarray, dout: np.ndarray, Z: np.ndarray) -> None:
    """dx (n,D), demb (n,NT,D) += from dout (n, D + F(F-1)/2); Z (n,F,D) saved."""
    n, F, D = Z.shape
    i, j = pair_indices(F)
    dgram = np.zeros((n, F, F), dtype=Z.dtype)
    dgram[:, i, j] = dout[:, D:]
    # d(Z_i . Z_j) reaches both Z_i and Z_j: dZ = (dgram + dgram^T) @ Z
    dZ = (dgram + dgram.transpose(0, 2, 1)) @ Z
    dx += dout[:, :D]
    dx += dZ[:, 0]
    demb += dZ[:, 1:]


# ----------------------------------------------------------------------------------------
# sigmoid + binary cross-entropy, on logits


def bce_forward(losses: np.ndarray, logits: np.ndarray, labels: np.ndarray) -> None:
    """losses (n,) = -y log s(z) - (1-y) log(1-s(z)) for logits z (n,), labels y (n,) in {0,1},
    computed stably as max(z,0) - z y + log(1 + exp(-|z|))."""
    np.maximum(logits, 0, out=losses)
    losses -= logits * labels
    losses += np.log1p(np.exp(-np.abs(logits)))


def bce_backward(dlogits: np.ndarray, logits: np.ndarray, labels: np.ndarray, scale: float) -> None:
    """dlogits (n,) += scale * (sigmoid(z) - y): the gradient of scale * sum(losses)."""
    s = 0.5 * (1.0 + np.tanh(0.5 * logits))  # sigmoid without overflow
    dlogits += scale * (s - labels)
