"""ResNet kernels: every backward against centered finite differences in float64, conv
against its direct definition, batch norm's running statistics against their formula.

Each forward is reduced to a scalar with a fake loss (out * dout).sum() for a fixed random
dout; backward kernels accumulate, so gradient buffers start at 1 and we check 1 + grad.
"""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check, numgrad, rand
from numpy.lib.stride_tricks import sliding_window_view

from proxies.resnet import kernels as K


def conv_reference(x, w, stride, pad):
    """out[b,o,i,j] = sum over c and taps of x_pad[b,c,i*s+u,j*s+v] w[o,c,u,v]."""
    x_pad = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    win = sliding_window_view(x_pad, w.shape[2:], axis=(2, 3))[:, :, ::stride, ::stride]
    return np.einsum("bcijuv,ocuv->boij", win, w)


@pytest.mark.parametrize(
    "k,stride,pad,hw",
    [(3, 1, 1, 5), (3, 2, 1, 6), (3, 2, 1, 5), (1, 1, 0, 4), (1, 2, 0, 5), (7, 2, 3, 8)],
)
def test_conv2d(k, stride, pad, hw):
    x, w = rand(2, 3, hw, hw, seed=1), rand(4, 3, k, k, seed=2)
    out, cache = K.conv2d_forward(x, w, stride, pad)
    check("conv forward", out, conv_reference(x, w, stride, pad), atol=1e-12)
    dout = rand(*out.shape, seed=3)
    dw = np.ones_like(w)
    dx = K.conv2d_backward(dout, w, dw, cache)

    def loss():
        return float((K.conv2d_forward(x, w, stride, pad)[0] * dout).sum())

    check("conv dx", dx, numgrad(loss, x), atol=1e-6)
    check("conv dw", dw, 1 + numgrad(loss, w), atol=1e-6)
    assert K.conv2d_backward(dout, w, np.zeros_like(w), cache, need_dx=False) is None


def test_batchnorm():
    x, g, b = rand(3, 4, 2, 3, seed=1), rand(4, seed=2), rand(4, seed=3)
    rm, rv = np.zeros(4), np.ones(4)
    y, cache = K.batchnorm_forward(x, g, b, rm, rv)
    n = 3 * 2 * 3
    mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
    want = (x - mean[:, None, None]) / np.sqrt(var[:, None, None] + K.BN_EPS) * g[
        :, None, None
    ] + b[:, None, None]
    check("bn forward", y, want, atol=1e-12)
    check("running mean", rm, 0.1 * mean, atol=1e-12)
    check("running var (unbiased)", rv, 0.9 + 0.1 * var * n / (n - 1), atol=1e-12)
    dout = rand(*y.shape, seed=4)
    dg, db = np.ones(4), np.ones(4)
    dx = K.batchnorm_backward(dout, dg, db, cache)

    def loss():
        return float((K.batchnorm_forward(x, g, b)[0] * dout).sum())

    check("bn dx", dx, numgrad(loss, x), atol=1e-6)
    check("bn dgamma", dg, 1 + numgrad(loss, g), atol=1e-6)
    check("bn dbeta", db, 1 + numgrad(loss, b), atol=1e-6)


def test_relu():
    x = rand(2, 3, 4, 4, seed=1)
    x[np.abs(x) < 1e-3] = 0.5  # away from the kink
    dout = rand(2, 3, 4, 4, seed=2)
    dx = K.relu_backward(dout, K.relu_forward(x))
    check("relu dx", dx, numgrad(lambda: float((K.relu_forward(x) * dout).sum()), x), atol=1e-8)


@pytest.mark.parametrize("hw", [6, 7])
def test_maxpool(hw):
    # distinct values: no ties, so finite differences see one argmax per window
    x = np.random.default_rng(hw).permutation(2 * 3 * hw * hw).reshape(2, 3, hw, hw) * 0.01
    out, cache = K.maxpool_forward(x)
    want = sliding_window_view(
        np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-np.inf), (3, 3), axis=(2, 3)
    )[:, :, ::2, ::2].max(axis=(4, 5))
    check("maxpool forward", out, want, atol=0)
    dout = rand(*out.shape, seed=2)
    dx = K.maxpool_backward(dout, cache)
    loss = lambda: float((K.maxpool_forward(x)[0] * dout).sum())  # noqa: E731
    check("maxpool dx", dx, numgrad(loss, x, eps=1e-4), atol=1e-6)


def test_avgpool_fc_xent():
    x, w, b = rand(3, 4, 2, 2, seed=1), rand(5, 4, seed=2), rand(5, seed=3)
    labels = np.array([0, 4, 2])

    def loss():
        return K.softmax_xent(K.fc_forward(K.avgpool_forward(x), w, b), labels)[0]

    pooled = K.avgpool_forward(x)
    logits = K.fc_forward(pooled, w, b)
    value, dlogits = K.softmax_xent(logits, labels)
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    assert value == pytest.approx(-np.log(p[np.arange(3), labels]).mean(), rel=1e-12)
    dw, db = np.ones_like(w), np.ones_like(b)
    dx = K.avgpool_backward(K.fc_backward(dlogits, pooled, w, dw, db), x.shape)
    check("xent/fc/avgpool dx", dx, numgrad(loss, x), atol=1e-7)
    check("fc dw", dw, 1 + numgrad(loss, w), atol=1e-7)
    check("fc db", db, 1 + numgrad(loss, b), atol=1e-7)


def test_sgd_matches_pytorch_formula():
    p, g, buf = rand(6, seed=1), rand(6, seed=2), rand(6, seed=3)
    want_buf = 0.9 * buf + (0.5 * g + 1e-4 * p)
    want_p = p - 0.1 * want_buf
    K.sgd_step(p, g, buf, lr=0.1, momentum=0.9, weight_decay=1e-4, scale=0.5)
    check("momentum buffer", buf, want_buf, atol=1e-15)
    check("params", p, want_p, atol=1e-15)
