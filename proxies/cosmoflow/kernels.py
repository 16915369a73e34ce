"""CosmoFlow layers as NumPy forward/backward kernel pairs.

Letters: B batch, D H W spatial extents (of the arrays passed: a shard's local ones), Ci/Co
input/output channels, N = B*D*H*W voxels, K = 3 kernel extent (27 taps), I/O dense widths.
Activations are channels-last (B, D, H, W, C), C-contiguous; conv weights are (K, K, K, Ci, Co)
(the Keras layout of the MLPerf reference), dense weights (I, O): out = inp @ w + b.

Conventions, as llm.c:
- outputs first; forward kernels write into preallocated arrays and save what backward needs
  (the conv's im2col matrix, the pool's argmax);
- backward kernels ACCUMULATE (+=) into their gradient buffers, so the caller zeroes them;
- dtype-generic: float32 in runs, float64 in finite-difference tests.

A convolution is im2col + one matmul: cols (N, 27*Ci) holds, for every output voxel, the
3x3x3 neighbourhood of the zero- or halo-padded input (27 strided copies), then
out = cols @ w.reshape(27*Ci, Co). Its input gradient is the same on the padded output
gradient with the kernel flipped and transposed, which is why backward exchanges halos of dy.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

K = 3
TAPS = K**3


# ----------------------------------------------------------------------------------------
# conv3d, kernel 3, stride 1, 'same': the caller passes the input padded by one voxel


def im2col(cols: np.ndarray, x_pad: np.ndarray) -> None:
    """cols (N, 27*C) <- the 3x3x3 neighbourhoods of x_pad (B, D+2, H+2, W+2, C), taps in
    (kd, kh, kw) order, channels fastest.

    For one (kd, kh) the 3 kw taps x C channels of a voxel are 3C consecutive numbers of
    x_pad's row, so each of the 9 copies moves runs of 3C (a view with overlapping windows),
    not of C: 2-3x faster at the small channel counts of the first layers."""
    B, Dp, Hp, Wp, C = x_pad.shape
    D, H, W = Dp - 2, Hp - 2, Wp - 2
    s = x_pad.strides
    assert s[3:] == (C * x_pad.itemsize, x_pad.itemsize), "x_pad rows must be contiguous"
    view = cols.reshape(B, D, H, W, K * K, K * C)
    for t in range(K * K):
        kd, kh = divmod(t, K)
        rows = x_pad[:, kd:, kh:]
        view[:, :, :, :, t, :] = as_strided(rows, (B, D, H, W, K * C), s, writeable=False)


def conv3d_forward(
    out: np.ndarray, cols: np.ndarray, x_pad: np.ndarray, w: np.ndarray, b: np.ndarray
) -> None:
    """out (B,D,H,W,Co) = conv(x_pad (B,D+2,H+2,W+2,Ci), w (3,3,3,Ci,Co)) + b (Co);
    saves cols (N, 27*Ci) for the weight gradient."""
    Co = w.shape[-1]
    im2col(cols, x_pad)
    np.matmul(cols, w.reshape(-1, Co), out=out.reshape(-1, Co))
    out += b


def conv3d_backward_weights(
    dw: np.ndarray, db: np.ndarray, dout: np.ndarray, cols: np.ndarray
) -> None:
    """dw (3,3,3,Ci,Co) += cols^T @ dout; db (Co) += dout summed over voxels."""
    Co = dw.shape[-1]
    d2 = dout.reshape(-1, Co)
    dw += (cols.T @ d2).reshape(dw.shape)
    db += d2.sum(axis=0)


def conv3d_backward_data(
    dx: np.ndarray, dcols: np.ndarray, dout_pad: np.ndarray, w: np.ndarray
) -> None:
    """dx (B,D,H,W,Ci) += the input gradient, from dout_pad (B,D+2,H+2,W+2,Co): a 'same'
    convolution of the padded output gradient with w flipped in space, Ci and Co swapped.
    dcols (N, 27*Co) is scratch."""
    Ci = w.shape[-2]
    im2col(dcols, dout_pad)
    w_flip = w[::-1, ::-1, ::-1].swapaxes(-1, -2).reshape(-1, Ci)
    dx += (dcols @ w_flip).reshape(dx.shape)


# ----------------------------------------------------------------------------------------
# LeakyReLU


def leaky_relu_forward(out: np.ndarray, inp: np.ndarray, alpha: float) -> None:
    np.multiply(inp, np.where(inp > 0, 1.0, alpha).astype(inp.dtype), out=out)


def leaky_relu_backward(dinp: np.ndarray, dout: np.ndarray, inp: np.ndarray, alpha: float):
    dinp += dout * np.where(inp > 0, 1.0, alpha).astype(inp.dtype)


# ----------------------------------------------------------------------------------------
# max-pool 2x2x2, stride 2


def _windows(x: np.ndarray) -> np.ndarray:
    """(B,D,H,W,C) -> (B,D/2,H/2,W/2,C,8): the 8 voxels of every window, last."""
    B, D, H, W, C = x.shape
    x = x.reshape(B, D // 2, 2, H // 2, 2, W // 2, 2, C)
    return x.transpose(0, 1, 3, 5, 7, 2, 4, 6).reshape(B, D // 2, H // 2, W // 2, C, 8)


def maxpool_forward(out: np.ndarray, idx: np.ndarray, inp: np.ndarray) -> None:
    """out (B,D/2,H/2,W/2,C) = max over each 2^3 window of inp (B,D,H,W,C); idx (same shape
    as out, int8) saves which voxel of the window won (the first on ties)."""
    win = _windows(inp)
    np.argmax(win, axis=-1, out=idx)
    out[...] = np.take_along_axis(win, idx[..., None].astype(np.intp), axis=-1)[..., 0]


def maxpool_backward(dinp: np.ndarray, dout: np.ndarray, idx: np.ndarray) -> None:
    """dinp (B,D,H,W,C) += dout routed to the winning voxel of each window."""
    B, D, H, W, C = dinp.shape
    win = np.zeros((*dout.shape, 8), dtype=dinp.dtype)
    np.put_along_axis(win, idx[..., None].astype(np.intp), dout[..., None], axis=-1)
    win = win.reshape(B, D // 2, H // 2, W // 2, C, 2, 2, 2).transpose(0, 1, 5, 2, 6, 3, 7, 4)
    dinp += win.reshape(dinp.shape)


# ----------------------------------------------------------------------------------------
# dense, output head, loss


def dense_forward(out: np.ndarray, inp: np.ndarray, w: np.ndarray, b: np.ndarray) -> None:
    """out (B,O) = inp (B,I) @ w (I,O) + b (O)."""
    np.matmul(inp, w, out=out)
    out += b


def dense_backward(
    dinp: np.ndarray | None,
    dw: np.ndarray,
    db: np.ndarray,
    dout: np.ndarray,
    inp: np.ndarray,
    w: np.ndarray,
) -> None:
    """dw += inp^T @ dout, db += sum_B dout, dinp (B,I) += dout @ w^T (skipped if None)."""
    dw += inp.T @ dout
    db += dout.sum(axis=0)
    if dinp is not None:
        dinp += dout @ w.T


HEAD_SCALE = 1.2  # the MLPerf reference's output: 1.2 * tanh (targets lie in [-1, 1])


def head_forward(out: np.ndarray, inp: np.ndarray) -> None:
    np.tanh(inp, out=out)
    out *= HEAD_SCALE


def head_backward(dinp: np.ndarray, dout: np.ndarray, out: np.ndarray) -> None:
    """With out = 1.2 tanh(inp): d/dinp = 1.2 (1 - tanh^2) = 1.2 - out^2 / 1.2."""
    dinp += dout * (HEAD_SCALE - out * out / HEAD_SCALE)


def mse_forward(pred: np.ndarray, target: np.ndarray, scale: float) -> float:
    """scale * sum of squared errors (scale = 1 / (outputs * global batch) for the mean)."""
    diff = pred - target
    return float(scale * np.sum(diff * diff, dtype=np.float64))


def mse_backward(dpred: np.ndarray, pred: np.ndarray, target: np.ndarray, scale: float) -> None:
    dpred += (2.0 * scale) * (pred - target)


# ----------------------------------------------------------------------------------------
# optimizer


def sgd_momentum_update(
    params: np.ndarray, grads: np.ndarray, velocity: np.ndarray, lr: float, momentum: float
) -> None:
    """SGD with momentum (the MLPerf reference's optimizer): v = m v + g; p -= lr v."""
    velocity *= momentum
    velocity += grads
    params -= lr * velocity
