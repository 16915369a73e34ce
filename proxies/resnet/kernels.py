"""ResNet layers as NumPy forward/backward kernel pairs, NCHW (batch, channels, height, width).

Conventions (as proxies/cosmoflow/kernels.py): forward kernels return their output and a
cache of what backward needs; backward kernels return the input gradient and ACCUMULATE
(+=) into the parameter gradients passed, so the caller zeroes them once per iteration;
dtype-generic: float32 in runs, float64 in finite-difference tests.

A convolution is im2col + one batched matmul: cols (B, C*kh*kw, Ho*Wo) holds every output
pixel's receptive field (one strided view of the padded input, copied once), then
out (B, Co, Ho*Wo) = w (Co, C*kh*kw) @ cols, already NCHW: no transpose. A 1x1 convolution
needs no im2col (a stride-2 one reads every other pixel first). The input gradient scatters
w^T @ dout back tap by tap (kh*kw strided adds, not a loop over pixels).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

BN_EPS = 1e-5  # torchvision's BatchNorm2d
BN_MOMENTUM = 0.1


def out_size(n: int, k: int, stride: int, pad: int) -> int:
    return (n + 2 * pad - k) // stride + 1


# ----------------------------------------------------------------------------------------
# conv2d, no bias (every ResNet conv is followed by batch norm)


def _windows(x_pad: np.ndarray, kh: int, kw: int, stride: int, Ho: int, Wo: int) -> np.ndarray:
    """A read-only view (B, C, kh, kw, Ho, Wo) of x_pad's receptive fields."""
    B, C, _, _ = x_pad.shape
    sB, sC, sH, sW = x_pad.strides
    return as_strided(
        x_pad,
        (B, C, kh, kw, Ho, Wo),
        (sB, sC, sH, sW, sH * stride, sW * stride),
        writeable=False,
    )


def conv2d_forward(x: np.ndarray, w: np.ndarray, stride: int = 1, pad: int = 0):
    """out (B, Co, Ho, Wo) = conv(x (B, C, H, W), w (Co, C, kh, kw)); cache for backward."""
    B, C, H, W = x.shape
    Co, _, kh, kw = w.shape
    Ho, Wo = out_size(H, kh, stride, pad), out_size(W, kw, stride, pad)
    if kh == kw == 1 and pad == 0:
        xs = x if stride == 1 else x[:, :, ::stride, ::stride]
        cols = np.ascontiguousarray(xs).reshape(B, C, Ho * Wo)
    else:
        x_pad = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad))) if pad else x
        cols = _windows(x_pad, kh, kw, stride, Ho, Wo).reshape(B, C * kh * kw, Ho * Wo)
    out = np.matmul(w.reshape(Co, -1), cols).reshape(B, Co, Ho, Wo)
    return out, (cols, x.shape, stride, pad)


def conv2d_backward(dout: np.ndarray, w: np.ndarray, dw: np.ndarray, cache, need_dx: bool = True):
    """dw += the weight gradient; returns dx (None when not needed: the stem's input)."""
    cols, (B, C, H, W), stride, pad = cache
    Co, _, kh, kw = w.shape
    d2 = dout.reshape(B, Co, -1)
    # the sum over the batch of dout_b @ cols_b^T: one matmul per image (a loop over the
    # batch, never over pixels) reads cols in place; one big matmul would copy it transposed
    dw2 = dw.view()
    dw2.shape = (Co, -1)  # raises rather than accumulate into a copy
    for b in range(B):
        dw2 += d2[b] @ cols[b].T
    if not need_dx:
        return None
    dcols = np.matmul(w.reshape(Co, -1).T, d2)  # (B, C*kh*kw, Ho*Wo)
    Ho, Wo = dout.shape[2:]
    if kh == kw == 1 and pad == 0:
        dcols = dcols.reshape(B, C, Ho, Wo)
        if stride == 1:
            return dcols
        dx = np.zeros((B, C, H, W), dout.dtype)
        dx[:, :, ::stride, ::stride] = dcols
        return dx
    dcols = dcols.reshape(B, C, kh, kw, Ho, Wo)
    dx_pad = np.zeros((B, C, H + 2 * pad, W + 2 * pad), dout.dtype)
    for i in range(kh):
        for j in range(kw):
            dx_pad[:, :, i : i + stride * Ho : stride, j : j + stride * Wo : stride] += dcols[
                :, :, i, j
            ]
    return dx_pad[:, :, pad : pad + H, pad : pad + W] if pad else dx_pad


def conv_flops(B: int, C: int, Co: int, k: int, Ho: int, Wo: int) -> float:
    """One pass of a conv (forward, or the weight or the input gradient): 2 per multiply-add."""
    return 2.0 * B * Co * Ho * Wo * C * k * k


# ----------------------------------------------------------------------------------------
# batch norm, training mode: batch statistics over (B, H, W), running statistics kept


def batchnorm_forward(
    x: np.ndarray,
    gamma: np.ndarray,
    beta: np.ndarray,
    running_mean: np.ndarray | None = None,
    running_var: np.ndarray | None = None,
    momentum: float = BN_MOMENTUM,
    eps: float = BN_EPS,
):
    """y = gamma * (x - mean) / sqrt(var + eps) + beta per channel, mean and the biased var
    over the batch and pixels. The running statistics (if given) move towards the batch's as
    PyTorch's: the unbiased variance, weight `momentum`."""
    B, C, H, W = x.shape
    n = B * H * W
    x3 = x.reshape(B, C, H * W)
    mean = x3.sum(axis=2).sum(axis=0) / n  # pairwise along the rows: float32 stays accurate
    # in place from here: these arrays are large and each new one costs page faults
    xhat = x - mean[None, :, None, None]
    var = np.einsum("bchw,bchw->c", xhat, xhat) / n
    invstd = (1.0 / np.sqrt(var + eps)).astype(x.dtype, copy=False)
    xhat *= invstd[None, :, None, None]
    y = xhat * gamma[None, :, None, None]
    y += beta[None, :, None, None]
    if running_mean is not None:
        running_mean *= 1 - momentum
        running_mean += momentum * mean
        running_var *= 1 - momentum
        running_var += momentum * var * (n / max(n - 1, 1))
    return y, (xhat, invstd, gamma)


def batchnorm_backward(dy: np.ndarray, dgamma: np.ndarray, dbeta: np.ndarray, cache) -> np.ndarray:
    xhat, invstd, gamma = cache
    B, C, H, W = dy.shape
    n = B * H * W
    sdy = dy.reshape(B, C, H * W).sum(axis=2).sum(axis=0)
    sdyx = np.einsum("bchw,bchw->c", dy, xhat)
    dgamma += sdyx
    dbeta += sdy
    # dx = gamma * invstd / n * (n dy - sum(dy) - xhat sum(dy xhat))
    k = (gamma * invstd / n)[None, :, None, None]
    dx = xhat * (-sdyx)[None, :, None, None]
    dx += n * dy
    dx -= sdy[None, :, None, None]
    dx *= k
    return dx


# ----------------------------------------------------------------------------------------
# ReLU, max pool, global average pool, fc, softmax cross-entropy


def relu_forward(x: np.ndarray, inplace: bool = False) -> np.ndarray:
    """max(x, 0); `inplace` overwrites x (a fresh temporary: saves an allocation)."""
    return np.maximum(x, 0, out=x if inplace else None)


def relu_backward(dy: np.ndarray, y: np.ndarray) -> np.ndarray:
    """From the output y (> 0 exactly where the input was)."""
    return dy * (y > 0)


def maxpool_forward(x: np.ndarray, k: int = 3, stride: int = 2, pad: int = 1):
    """Max over k x k windows (padding never wins: -inf). Cache: the argmax tap."""
    B, C, H, W = x.shape
    Ho, Wo = out_size(H, k, stride, pad), out_size(W, k, stride, pad)
    x_pad = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)), constant_values=-np.inf)
    win = _windows(x_pad, k, k, stride, Ho, Wo).reshape(B, C, k * k, Ho, Wo)
    arg = win.argmax(axis=2)
    out = np.take_along_axis(win, arg[:, :, None], axis=2)[:, :, 0]
    return out, (arg, x.shape, k, stride, pad)


def maxpool_backward(dout: np.ndarray, cache) -> np.ndarray:
    """The gradient goes to each window's argmax (ties: the first, as the forward chose)."""
    arg, (B, C, H, W), k, stride, pad = cache
    Ho, Wo = dout.shape[2:]
    dx_pad = np.zeros((B, C, H + 2 * pad, W + 2 * pad), dout.dtype)
    for t in range(k * k):
        i, j = divmod(t, k)
        dx_pad[:, :, i : i + stride * Ho : stride, j : j + stride * Wo : stride] += np.where(
            arg == t, dout, 0
        )
    return dx_pad[:, :, pad : pad + H, pad : pad + W]


def avgpool_forward(x: np.ndarray) -> np.ndarray:
    """Global average pool: (B, C, H, W) -> (B, C)."""
    return x.mean(axis=(2, 3))


def avgpool_backward(dout: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    B, C, H, W = shape
    return np.broadcast_to((dout / (H * W))[:, :, None, None], shape).copy()


def fc_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """out (B, O) = x (B, I) @ w (O, I)^T + b: torchvision's Linear layout."""
    return x @ w.T + b


def fc_backward(
    dout: np.ndarray, x: np.ndarray, w: np.ndarray, dw: np.ndarray, db: np.ndarray
) -> np.ndarray:
    dw += dout.T @ x
    db += dout.sum(axis=0)
    return dout @ w


def softmax_xent(logits: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean cross-entropy over the batch and its gradient w.r.t. the logits."""
    B = logits.shape[0]
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    loss = -float(np.log(p[np.arange(B), labels]).sum()) / B
    p[np.arange(B), labels] -= 1
    return loss, p / B


# ----------------------------------------------------------------------------------------
# SGD with momentum and weight decay (PyTorch's: decay added to the gradient, no dampening)


def sgd_step(
    p: np.ndarray,
    g: np.ndarray,
    buf: np.ndarray,
    lr: float,
    momentum: float,
    weight_decay: float,
    scale: float = 1.0,
) -> None:
    """In place over flat arrays: g' = scale*g + wd*p; buf = momentum*buf + g'; p -= lr*buf.
    `scale` turns a sum of replicas' gradients into their mean (DDP averages)."""
    d = g * scale
    if weight_decay:
        d += weight_decay * p
    buf *= momentum
    buf += d
    p -= lr * buf
