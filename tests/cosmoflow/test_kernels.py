"""CosmoFlow kernels and the whole model: every backward against centered finite differences
in float64.

Each forward is reduced to a scalar with a fake loss (out * dout).sum() for a fixed random
dout; backward kernels accumulate, so gradient buffers start at 1 and we check 1 + grad.
"""

from __future__ import annotations

import numpy as np
from gradcheck import check, numgrad, rand
from numpy.lib.stride_tricks import sliding_window_view

from proxies.cosmoflow import kernels as K
from proxies.cosmoflow.config import CosmoFlowConfig, Shards
from proxies.cosmoflow.model import ShardModel, sample, whole_model_loss

B, D, H, W, CI, CO = 2, 3, 4, 2, 2, 3


def conv_reference(x_pad: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Direct definition: out[b,d,h,w,o] = sum over taps and Ci of x_pad * w, plus bias."""
    win = sliding_window_view(x_pad, (3, 3, 3), axis=(1, 2, 3))  # (B,D,H,W,Ci,3,3,3)
    return np.einsum("bdhwcxyz,xyzco->bdhwo", win, w) + b


def test_conv3d():
    x_pad = np.pad(rand(B, D, H, W, CI, seed=1), ((0, 0), (1, 1), (1, 1), (1, 1), (0, 0)))
    x_pad[:, 0] = rand(B, H + 2, W + 2, CI, seed=5)  # a halo: the border is data too
    w, b = rand(3, 3, 3, CI, CO, seed=2), rand(CO, seed=3)
    dout = rand(B, D, H, W, CO, seed=4)
    out, cols = np.empty((B, D, H, W, CO)), np.empty((B * D * H * W, 27 * CI))

    def loss():
        K.conv3d_forward(out, cols, x_pad, w, b)
        return (out * dout).sum()

    loss()
    check("conv out", out, conv_reference(x_pad, w, b), atol=1e-12)
    dw, db = np.ones_like(w), np.ones_like(b)
    K.conv3d_backward_weights(dw, db, dout, cols)
    check("conv dw", dw, 1 + numgrad(loss, w))
    check("conv db", db, 1 + numgrad(loss, b))
    # The input gradient of the interior from the zero-padded output gradient.
    dout_pad = np.pad(dout, ((0, 0), (1, 1), (1, 1), (1, 1), (0, 0)))
    dx = np.ones((B, D, H, W, CI))
    K.conv3d_backward_data(dx, np.empty((B * D * H * W, 27 * CO)), dout_pad, w)
    check("conv dx", dx, 1 + numgrad(loss, x_pad)[:, 1:-1, 1:-1, 1:-1])


def test_leaky_relu():
    inp, dout = rand(B, D, H, CI, seed=1), rand(B, D, H, CI, seed=2)
    out = np.empty_like(inp)

    def loss():
        K.leaky_relu_forward(out, inp, 0.3)
        return (out * dout).sum()

    loss()
    check("leaky out", out, np.where(inp > 0, inp, 0.3 * inp))
    dinp = np.ones_like(inp)
    K.leaky_relu_backward(dinp, dout, inp, 0.3)
    check("leaky dinp", dinp, 1 + numgrad(loss, inp))


def test_maxpool():
    inp = rand(B, 4, 2, 4, CI, seed=1)
    dout = rand(B, 2, 1, 2, CI, seed=2)
    out, idx = np.empty((B, 2, 1, 2, CI)), np.empty((B, 2, 1, 2, CI), np.int8)

    def loss():
        K.maxpool_forward(out, idx, inp)
        return (out * dout).sum()

    loss()
    want = inp.reshape(B, 2, 2, 1, 2, 2, 2, CI).max(axis=(2, 4, 6))
    check("pool out", out, want, atol=0)
    dinp = np.ones_like(inp)
    K.maxpool_backward(dinp, dout, idx)
    check("pool dinp", dinp, 1 + numgrad(loss, inp))


def test_dense_head_and_mse():
    inp, w, b = rand(B, 5, seed=1), rand(5, 3, seed=2), rand(3, seed=3)
    target = rand(B, 3, seed=4, scale=0.5)
    pre, out = np.empty((B, 3)), np.empty((B, 3))

    def loss():
        K.dense_forward(pre, inp, w, b)
        K.head_forward(out, pre)
        return K.mse_forward(out, target, 0.25)

    value = loss()
    check("head out", out, 1.2 * np.tanh(inp @ w + b))
    check("mse", value, 0.25 * ((out - target) ** 2).sum())
    dout, dpre = np.zeros_like(out), np.zeros_like(pre)
    K.mse_backward(dout, out, target, 0.25)
    K.head_backward(dpre, dout, out)
    dinp, dw, db = np.ones_like(inp), np.ones_like(w), np.ones_like(b)
    K.dense_backward(dinp, dw, db, dpre, inp, w)
    check("dense dinp", dinp, 1 + numgrad(loss, inp))
    check("dense dw", dw, 1 + numgrad(loss, w))
    check("dense db", db, 1 + numgrad(loss, b))


def test_sgd_momentum():
    p, g, v = np.ones(3), np.array([1.0, 2.0, 3.0]), np.array([0.5, 0.0, -1.0])
    K.sgd_momentum_update(p, g, v, 0.1, 0.9)
    check("velocity", v, [1.45, 2.0, 2.1])
    check("params", p, [1 - 0.145, 1 - 0.2, 1 - 0.21])


# A whole model small enough to finite-difference every parameter: two conv layers on 4^3,
# dense 4-4 (outputs split 1 way).
SMALL = CosmoFlowConfig(
    "fd", volume=(4, 4, 4), in_channels=2, filters=(3, 2), dense=(4, 4), batch=2
)


def test_whole_model_gradients():
    model = ShardModel(SMALL, Shards(1, 1), 0, B=2, seed=3, dtype=np.float64)
    model.load([sample(SMALL, 0, g, np.float64) for g in range(2)])
    scale = 1.0 / (4 * 2)

    def loss():
        return whole_model_loss(model, scale, backward=False)

    model.zero_grad()
    whole_model_loss(model, scale)
    for l in range(SMALL.layers):
        check(f"conv{l} grads", model.conv_g[l], numgrad(loss, model.conv_p[l]), atol=1e-8)
    check("dense grads", model.dense_g, numgrad(loss, model.dense_p), atol=1e-8)
    assert np.abs(model.dense_g).max() > 1e-4  # not vacuous
