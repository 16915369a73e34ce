"""DLRM kernels: every backward against centered finite differences in float64.

Each forward is reduced to a scalar with a fake loss (out * dout).sum() for a fixed random
dout; dense backward kernels accumulate, so gradient buffers start at 1 and we check 1 + grad.
"""

from __future__ import annotations

import numpy as np
from gradcheck import check, numgrad, rand

from proxies.dlrm import kernels as K

n, C, OC, D, P, R, NT = 6, 5, 4, 3, 3, 7, 3


def test_linear():
    inp, w, b = rand(n, C, seed=1), rand(OC, C, seed=2), rand(OC, seed=3)
    dout = rand(n, OC, seed=4)
    out = np.empty((n, OC))

    def loss():
        K.linear_forward(out, inp, w, b)
        return (out * dout).sum()

    loss()
    check("linear out", out, inp @ w.T + b)
    dinp, dw, db = np.ones_like(inp), np.ones_like(w), np.ones_like(b)
    K.linear_backward(dinp, dw, db, dout, inp, w)
    check("dinp", dinp, 1 + numgrad(loss, inp))
    check("dweight", dw, 1 + numgrad(loss, w))
    check("dbias", db, 1 + numgrad(loss, b))
    dw2, db2 = np.zeros_like(w), np.zeros_like(b)
    K.linear_backward(None, dw2, db2, dout, inp, w)  # no dinp: the first layer's input
    check("dweight without dinp", dw2, dw - 1)


def test_relu():
    # keep every input away from the kink at 0, where the difference quotient is not the slope
    inp = rand(n, C, seed=1)
    inp += np.where(inp >= 0, 0.1, -0.1)
    dout = rand(n, C, seed=2)
    out = np.empty_like(inp)

    def loss():
        K.relu_forward(out, inp)
        return (out * dout).sum()

    loss()
    check("relu out", out, np.maximum(inp, 0))
    dinp = np.ones_like(inp)
    K.relu_backward(dinp, dout, out)
    check("relu dinp", dinp, 1 + numgrad(loss, inp))


def test_embedding_bag():
    table = rand(R, D, seed=1)
    # repeated rows within a bag and across bags must add up; row 6 is never used
    idx = np.array([[0, 0, 3], [5, 1, 0], [2, 2, 2], [4, 3, 1], [0, 5, 5], [1, 2, 3]])
    dout = rand(n, D, seed=2)
    out = np.empty((n, D))

    def loss():
        K.embedding_bag_forward(out, table, idx)
        return (out * dout).sum()

    loss()
    check("bag out", out, np.stack([table[row].sum(axis=0) for row in idx]))
    rows, drows = K.embedding_bag_backward(dout, idx)
    assert rows.tolist() == [0, 1, 2, 3, 4, 5]  # sorted, unique, only rows that were used
    dense = np.zeros_like(table)
    dense[rows] = drows
    check("dtable", dense, numgrad(loss, table))
    before = table.copy()
    K.embedding_sgd(table, rows, drows, 0.5)
    check("sparse sgd", table, before - 0.5 * dense)


def test_embedding_bag_backward_float32_hot_rows():
    """Many hits on few rows (the multi-step path), float32 in and out."""
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 4, (200, 5))
    dout = rng.standard_normal((200, D)).astype(np.float32)
    rows, drows = K.embedding_bag_backward(dout, idx)
    want = np.zeros((4, D))
    np.add.at(want, idx.reshape(-1), np.repeat(dout.astype(np.float64), 5, axis=0))
    assert drows.dtype == np.float32 and rows.tolist() == [0, 1, 2, 3]
    check("hot rows", drows, want, atol=1e-4, rtol=1e-5)


def test_interaction():
    F = NT + 1
    x, emb = rand(n, D, seed=1), rand(n, NT, D, seed=2)
    I = D + F * (F - 1) // 2
    dout = rand(n, I, seed=3)
    out, Z = np.empty((n, I)), np.empty((n, F, D))

    def loss():
        K.interaction_forward(out, Z, x, emb)
        return (out * dout).sum()

    loss()
    vecs = [x] + [emb[:, t] for t in range(NT)]
    pairs = [(i, j) for i in range(F) for j in range(i)]  # dlrm_s_pytorch's order
    assert list(zip(*map(np.ndarray.tolist, K.pair_indices(F)), strict=True)) == pairs
    want = np.concatenate([x] + [(vecs[i] * vecs[j]).sum(-1, keepdims=True) for i, j in pairs], 1)
    check("interaction out", out, want)
    dx, demb = np.ones_like(x), np.ones_like(emb)
    K.interaction_backward(dx, demb, dout, Z)
    check("dx", dx, 1 + numgrad(loss, x))
    check("demb", demb, 1 + numgrad(loss, emb))


def test_bce():
    logits = rand(n, seed=1, scale=3.0)
    labels = np.array([0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    losses = np.empty(n)

    def loss():
        K.bce_forward(losses, logits, labels)
        return 0.25 * losses.sum()

    loss()
    s = 1 / (1 + np.exp(-logits))
    check("bce", losses, -(labels * np.log(s) + (1 - labels) * np.log(1 - s)))
    dlogits = np.ones_like(logits)
    K.bce_backward(dlogits, logits, labels, 0.25)
    check("dlogits", dlogits, 1 + numgrad(loss, logits))
    # far-out logits: finite, and right to the last digit where the naive formula overflows
    big = np.array([-800.0, 800.0])
    out = np.empty(2)
    K.bce_forward(out, big, np.array([1.0, 0.0]))
    check("bce saturated", out, [800.0, 800.0])
    d = np.zeros(2)
    K.bce_backward(d, big, np.array([1.0, 0.0]), 1.0)
    check("dlogits saturated", d, [-1.0, 1.0])


def test_embedding_bag_jagged():
    """Bags of any length, some empty (a row-wise shard sees only the ids in its rows)."""
    table = rand(R, D, seed=1)
    ids = np.array([0, 0, 3, 5, 2, 2, 4, 1, 3])
    bag = np.array([0, 0, 0, 2, 2, 2, 3, 5, 5])  # bags 1 and 4 empty; rows 6 unused
    dout = rand(n, D, seed=2)
    out = np.full((n, D), 7.0)  # must be overwritten, empty bags with zero

    def loss():
        K.embedding_bag_jagged_forward(out, table, ids, bag)
        return (out * dout).sum()

    loss()
    want = np.zeros((n, D))
    np.add.at(want, bag, table[ids])
    check("jagged out", out, want)
    rows, drows = K.embedding_bag_jagged_backward(dout, ids, bag)
    assert rows.tolist() == [0, 1, 2, 3, 4, 5]
    dense = np.zeros_like(table)
    dense[rows] = drows
    check("jagged dtable", dense, numgrad(loss, table))
    none, dnone = K.embedding_bag_jagged_backward(dout, ids[:0], bag[:0])
    assert none.size == 0 and dnone.shape == (0, D)
    K.embedding_bag_jagged_forward(out, table, ids[:0], bag[:0])
    assert not out.any()
