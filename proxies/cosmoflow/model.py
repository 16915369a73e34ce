"""What one spatial shard of CosmoFlow holds and computes: the conv stack on its part of the
volume, its column slice of every dense layer (all columns with --dense replicate), forward,
backward and SGD with momentum.

Letters as in config.py. A whole single-process model is ShardModel(cfg, Shards(1, 1), 0, B).

Between the layers the proxy moves data, and this module only says where it lives:
- conv layer l reads `x_pad[l]` (B, D+2, h+2, w+2, Ci): its input with a 1-voxel border that
  holds the neighbours' halos (zeros at the volume's edges; for conv0 `load` fills only the
  interior, the border comes by message too); `pack_face`/`unpack_face` copy a face between
  an activation and a message buffer;
- its backward reads `dy_pad[l]` the same way: its output gradient with the neighbours' halos;
- dense layer k reads the whole input (B, I) and produces its output columns (see
  CosmoFlowConfig.dense_columns); the sharded conv output is put in the global (D, H, W, C)
  feature order by `features_from_blocks`, gathered column slices by `columns_from_blocks`.
"""

from __future__ import annotations

import math

import numpy as np

from proxies.core import pages
from proxies.cosmoflow import kernels as Kn
from proxies.cosmoflow.config import DIRS, CosmoFlowConfig, K, Shards


def glorot(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int, fan_out: int):
    limit = math.sqrt(6.0 / (fan_in + fan_out))  # Keras' default initializer
    return rng.uniform(-limit, limit, size=shape)


# ----------------------------------------------------------------------------------------
# halos


def face_index(k: int, shape: tuple[int, ...], pad: bool) -> tuple:
    """Index of the face toward direction k of an activation (B, D, h, w, C) (pad=False), or
    of the border cells that receive the neighbour's face in its padded array (pad=True)."""
    _, d, h, w, _ = shape
    if pad:
        d, h, w = d - 2, h - 2, w - 2
    di, dj = DIRS[k]

    def axis(delta: int, n: int) -> slice:
        if delta < 0:  # first cell (the border's in a padded array)
            return slice(0, 1)
        if delta > 0:  # last cell
            return slice(n + 1, n + 2) if pad else slice(n - 1, n)
        return slice(1, n + 1) if pad else slice(0, n)  # the whole interior

    depth = slice(1, d + 1) if pad else slice(0, d)
    return (slice(None), depth, axis(di, h), axis(dj, w), slice(None))


def pack_face(buf: np.ndarray, x: np.ndarray, k: int) -> None:
    """The face of x toward direction k -> the front of the message buffer."""
    face = x[face_index(k, x.shape, pad=False)]
    buf.reshape(-1)[: face.size] = face.reshape(-1)


def unpack_face(x_pad: np.ndarray, buf: np.ndarray, k: int) -> None:
    """The neighbour's face (front of buf) -> the border of x_pad toward direction k."""
    cells = x_pad[face_index(k, x_pad.shape, pad=True)]
    cells[...] = buf.reshape(-1)[: cells.size].reshape(cells.shape)


# ----------------------------------------------------------------------------------------
# dense inputs: shard blocks <-> global feature order


def features_from_blocks(blocks: np.ndarray, shards: Shards, local: tuple[int, ...]):
    """(S*B*Fl) gathered conv outputs, shard-major, -> (B, F) in the unsharded (D, H, W, C)
    order, so the dense weights mean the same for every shard layout. local = (B,d,h,w,C)."""
    B, d, h, w, C = local
    x = blocks.reshape(shards.py, shards.px, B, d, h, w, C).transpose(2, 3, 0, 4, 1, 5, 6)
    return x.reshape(B, -1)


def blocks_from_features(out: np.ndarray, feats: np.ndarray, shards: Shards, local) -> None:
    """The inverse: (B, F) -> out (S*B*Fl), shard s's block at position s."""
    B, d, h, w, C = local
    x = feats.reshape(B, d, shards.py, h, shards.px, w, C).transpose(2, 4, 0, 1, 3, 5, 6)
    out.reshape(x.shape)[...] = x


def _column_blocks(flat: np.ndarray, widths: list[int], B: int) -> list[np.ndarray]:
    """The (B, o_s) views of a shard-major whole buffer of blocks B x o_s."""
    at, out = 0, []
    for o in widths:
        out.append(flat[at : at + B * o].reshape(B, o))
        at += B * o
    return out


def columns_from_blocks(blocks: np.ndarray, widths: list[int], B: int) -> np.ndarray:
    """Gathered output slices, shard s's (B, widths[s]) block at its place (shard-major)
    -> (B, sum(widths)) whole layer output."""
    return np.concatenate(_column_blocks(blocks.reshape(-1), widths, B), axis=1)


def blocks_from_columns(out: np.ndarray, cols: np.ndarray, widths: list[int]) -> None:
    """The inverse: (B, O) -> out, shard s's columns as its (B, widths[s]) block."""
    at = 0
    for view in _column_blocks(out.reshape(-1), widths, cols.shape[0]):
        view[...] = cols[:, at : at + view.shape[1]]
        at += view.shape[1]


# ----------------------------------------------------------------------------------------
# synthetic data


def sample(cfg: CosmoFlowConfig, seed: int, g: int, dtype=np.float32):
    """Global sample g: a volume (D, H, W, Cin) and its targets (O,) in [-1, 1], the same for
    every layout. Learnable: channel c is noise shifted by 0.5 * target[c % O]."""
    rng = np.random.default_rng([seed, 7, g])
    O = cfg.dense[-1]
    target = rng.uniform(-1.0, 1.0, O)
    vol = rng.standard_normal((*cfg.volume, cfg.in_channels), dtype=np.float32).astype(dtype)
    vol += (0.5 * target[np.arange(cfg.in_channels) % O]).astype(dtype)
    return vol, target.astype(dtype)


# ----------------------------------------------------------------------------------------
# the shard's model


class ShardModel:
    def __init__(
        self,
        cfg: CosmoFlowConfig,
        shards: Shards,
        s: int,
        B: int,
        seed: int = 0,
        dtype=np.float32,
    ):
        self.cfg, self.shards, self.s, self.B, self.dtype = cfg, shards, s, B, dtype
        S, L = shards.size, cfg.layers
        self.si, self.sj = shards.coords(s)

        # conv parameters, replicated on every rank: one flat array per layer (w then b), the
        # unit of the gradient allreduce
        self.conv_p, self.conv_g, self.conv_v = [], [], []
        self.w, self.b, self.dw, self.db = [], [], [], []
        for l in range(L):
            ci, co = cfg.channels(l)
            n = cfg.conv_params(l)
            p, g = np.zeros(n, dtype), pages.zeros(n, dtype)  # g: allreduced
            rng = np.random.default_rng([seed, 1, l])
            p[: n - co] = glorot(rng, (n - co,), K**3 * ci, K**3 * co)
            self.conv_p.append(p)
            self.conv_g.append(g)
            self.conv_v.append(np.zeros(n, dtype))
            self.w.append(p[: n - co].reshape(K, K, K, ci, co))
            self.b.append(p[n - co :])
            self.dw.append(g[: n - co].reshape(K, K, K, ci, co))
            self.db.append(g[n - co :])

        # dense parameters: this shard's columns of every layer, in one flat array
        self.cols_d = [cfg.dense_columns(k, S, s) for k in range(len(cfg.dense))]
        n = sum(cfg.dense_params(k, S, s) for k in range(len(cfg.dense)))
        self.dense_p, self.dense_v = np.zeros(n, dtype), np.zeros(n, dtype)
        self.dense_g = pages.zeros(n, dtype)  # allreduced
        self.dw_d, self.db_d, self.w_d, self.b_d = [], [], [], []
        at = 0
        for k in range(len(cfg.dense)):
            i, o = cfg.dense_io(k)
            lo, hi = self.cols_d[k]
            oc = hi - lo
            rng = np.random.default_rng([seed, 2, k])
            full = glorot(rng, (i, o), i, o)  # drawn whole: every layout gets the same weights
            w = self.dense_p[at : at + i * oc].reshape(i, oc)
            w[...] = full[:, lo:hi]
            self.w_d.append(w)
            self.b_d.append(self.dense_p[at + i * oc : at + (i + 1) * oc])
            self.dw_d.append(self.dense_g[at : at + i * oc].reshape(i, oc))
            self.db_d.append(self.dense_g[at + i * oc : at + (i + 1) * oc])
            at += (i + 1) * oc

        # activations and their gradients, allocated once
        self.local = [shards.local(cfg.extent(l)) for l in range(L + 1)]
        z = lambda *shape: np.zeros(shape, dtype)  # noqa: E731
        self.x_pad, self.cols, self.pre, self.act, self.idx, self.pooled = [], [], [], [], [], []
        self.dy_pad, self.dcols, self.dx, self.dact, self.dpre = [], [], [], [], []
        for l in range(L):
            ci, co = cfg.channels(l)
            d, h, w = self.local[l]
            N = B * d * h * w
            self.x_pad.append(z(B, d + 2, h + 2, w + 2, ci))
            self.cols.append(z(N, K**3 * ci))
            self.pre.append(z(B, d, h, w, co))
            self.act.append(z(B, d, h, w, co))
            self.idx.append(np.zeros((B, d // 2, h // 2, w // 2, co), np.int8))
            self.pooled.append(z(B, d // 2, h // 2, w // 2, co))
            self.dact.append(z(B, d, h, w, co))
            self.dpre.append(z(B, d, h, w, co))
            self.dy_pad.append(z(B, d + 2, h + 2, w + 2, co) if l else None)
            self.dcols.append(z(N, K**3 * co) if l else None)
            self.dx.append(z(B, d, h, w, ci) if l else None)
        # dense layer k: its whole input (set by dense_forward), this shard's columns before
        # and after the activation, their gradients, and the (partial) input gradient
        inputs = [cfg.dense_io(k)[0] for k in range(len(cfg.dense))]
        self.d_inp: list = [None] * len(inputs)
        self.d_pre, self.d_out, self.d_dpre, self.d_dout = (
            [z(B, hi - lo) for lo, hi in self.cols_d] for _ in range(4)
        )
        self.d_dinp = [z(B, i) for i in inputs]
        self.target = z(B, self.d_out[-1].shape[1])

    @property
    def conv_out_local(self) -> tuple[int, ...]:
        """(B, d, h, w, C) of the last conv layer's pooled output on this shard."""
        return (self.B, *self.local[self.cfg.layers], self.cfg.filters[-1])

    # -- data ----------------------------------------------------------------------------
    def load(self, samples: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """The shard's tile of B volumes -> the interior of x_pad[0] (its border: zeros at
        the volume's edges, the neighbours' faces by message); the targets of its output
        columns -> target. Returns the interior, whose faces the neighbours need."""
        d, h, w = self.local[0]
        lo, hi = self.cols_d[-1]
        inner = self.x_pad[0][:, 1 : d + 1, 1 : h + 1, 1 : w + 1]
        r0, c0 = self.si * h, self.sj * w
        for b, (vol, target) in enumerate(samples):
            inner[b] = vol[:, r0 : r0 + h, c0 : c0 + w, :]
            self.target[b] = target[lo:hi]
        return inner

    # -- conv layers ---------------------------------------------------------------------
    def conv_forward(self, l: int) -> np.ndarray:
        """x_pad[l] (halos filled) -> conv -> LeakyReLU -> max-pool -> pooled[l]."""
        Kn.conv3d_forward(self.pre[l], self.cols[l], self.x_pad[l], self.w[l], self.b[l])
        Kn.leaky_relu_forward(self.act[l], self.pre[l], self.cfg.leak)
        Kn.maxpool_forward(self.pooled[l], self.idx[l], self.act[l])
        return self.pooled[l]

    def conv_backward_weights(self, l: int, dpooled: np.ndarray) -> np.ndarray:
        """d pooled[l] -> dy (= dpre[l], the conv output gradient); accumulates dw, db."""
        self.dact[l].fill(0)
        Kn.maxpool_backward(self.dact[l], dpooled.reshape(self.pooled[l].shape), self.idx[l])
        self.dpre[l].fill(0)
        Kn.leaky_relu_backward(self.dpre[l], self.dact[l], self.pre[l], self.cfg.leak)
        Kn.conv3d_backward_weights(self.dw[l], self.db[l], self.dpre[l], self.cols[l])
        return self.dpre[l]

    def conv_backward_data(self, l: int) -> np.ndarray:
        """dy_pad[l] (halos filled) -> dx[l], the gradient of pooled[l - 1]."""
        self.dx[l].fill(0)
        Kn.conv3d_backward_data(self.dx[l], self.dcols[l], self.dy_pad[l], self.w[l])
        return self.dx[l]

    # -- dense layers --------------------------------------------------------------------
    @property
    def last(self) -> int:
        return len(self.cfg.dense) - 1

    def dense_forward(self, k: int, inp: np.ndarray) -> np.ndarray:
        """inp (B, I) whole -> this shard's output columns (after the activation)."""
        self.d_inp[k] = inp
        Kn.dense_forward(self.d_pre[k], inp, self.w_d[k], self.b_d[k])
        if k == self.last:
            Kn.head_forward(self.d_out[k], self.d_pre[k])
        else:
            Kn.leaky_relu_forward(self.d_out[k], self.d_pre[k], self.cfg.leak)
        return self.d_out[k]

    def loss(self, scale: float) -> float:
        """scale * squared error of this shard's outputs; seeds the output gradient."""
        pred = self.d_out[self.last]
        self.d_dout[self.last].fill(0)
        Kn.mse_backward(self.d_dout[self.last], pred, self.target, scale)
        return Kn.mse_forward(pred, self.target, scale)

    def dense_backward(self, k: int, dout: np.ndarray | None = None) -> np.ndarray:
        """d (this shard's output columns) -> partial d inp (B, I): this shard's share of the
        input gradient, summed over the shards by the reduce-scatter. The last layer takes
        its output gradient from loss()."""
        if dout is None:
            dout = self.d_dout[k]
        self.d_dpre[k].fill(0)
        if k == self.last:
            Kn.head_backward(self.d_dpre[k], dout.reshape(self.d_out[k].shape), self.d_out[k])
        else:
            Kn.leaky_relu_backward(
                self.d_dpre[k], dout.reshape(self.d_pre[k].shape), self.d_pre[k], self.cfg.leak
            )
        self.d_dinp[k].fill(0)
        Kn.dense_backward(
            self.d_dinp[k], self.dw_d[k], self.db_d[k], self.d_dpre[k], self.d_inp[k], self.w_d[k]
        )
        return self.d_dinp[k]

    # -- optimizer -----------------------------------------------------------------------
    def step(self, lr: float, momentum: float, dense_lr_scale: float = 1.0) -> None:
        """dense_lr_scale: 1/S for replicated dense layers, whose summed gradient counts each
        replica's S times (the reference's lr_mult; linear in the gradient, so the same)."""
        for p, g, v in zip(self.conv_p, self.conv_g, self.conv_v, strict=True):
            Kn.sgd_momentum_update(p, g, v, lr, momentum)
        Kn.sgd_momentum_update(
            self.dense_p, self.dense_g, self.dense_v, lr * dense_lr_scale, momentum
        )

    def zero_grad(self) -> None:
        for g in self.conv_g:
            g.fill(0)
        self.dense_g.fill(0)


def whole_model_loss(model: ShardModel, scale: float, backward: bool = True) -> float:
    """Forward (and backward) of an unsharded model (Shards(1, 1)) on the loaded batch: the
    straight-line sequence the proxy interleaves with messages. Returns the loss."""
    cfg, L = model.cfg, model.cfg.layers
    assert model.shards.size == 1, "whole_model_loss runs an unsharded model"
    for l in range(L):
        out = model.conv_forward(l)
        if l + 1 < L:
            d, h, w = model.local[l + 1]
            model.x_pad[l + 1][:, 1 : d + 1, 1 : h + 1, 1 : w + 1] = out
    x = model.pooled[L - 1].reshape(model.B, -1)
    for k in range(len(cfg.dense)):
        x = model.dense_forward(k, x)
    loss = model.loss(scale)
    if not backward:
        return loss
    dx = None
    for k in reversed(range(len(cfg.dense))):
        dx = model.dense_backward(k, dx)
    for l in reversed(range(L)):
        dy = model.conv_backward_weights(l, dx)
        if l:
            d, h, w = model.local[l]
            model.dy_pad[l][:, 1 : d + 1, 1 : h + 1, 1 : w + 1] = dy
            dx = model.conv_backward_data(l)
    return loss
