"""One rank's part of DLRM: MLP replicas, its embedding shards, forward and backward in pieces.

Letters as in config.py: B global batch, b = B / W local batch, W ranks, NT tables, D
embedding width, F = NT + 1, I interaction width.

Parallelism: the MLPs are data-parallel (every rank a replica, its own b samples); the
tables are model-parallel, whole, by columns or by rows (sharding.py says what moves for
each). Sample s of the global batch is local sample s % b of rank s // b, so a table's B
lookups in order are exactly the W blocks of b in rank order.
"""

from __future__ import annotations

import math

import numpy as np

from proxies.core import pages
from proxies.dlrm import kernels as K
from proxies.dlrm.config import DLRMConfig
from proxies.dlrm.data import Synthetic
from proxies.dlrm.sharding import RowWise, TableWise, init_table, owned_shards, slots

__all__ = ["MLP", "DLRMShard", "init_table", "owned_shards", "slots"]


class MLP:
    """Linear layers, each followed by a ReLU except possibly the last; parameters and
    gradients in flat arrays (layer l's weight then bias in `slices[l]`), so a layer's
    gradient allreduce is one contiguous buffer."""

    def __init__(
        self,
        layers: list[tuple[int, int]],
        relu_last: bool,
        seed: tuple[int, ...],
        dtype=np.float32,
    ):
        sizes = DLRMConfig.layer_params(layers)
        offsets = np.cumsum([0, *sizes]).tolist()
        self.layers = layers
        self.slices = [slice(a, b) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
        self.params = np.empty(offsets[-1], dtype=dtype)
        self.grads = pages.zeros(offsets[-1], dtype)  # allreduced
        self.W, self.b, self.dW, self.db = [], [], [], []
        for (C, OC), s in zip(layers, self.slices, strict=True):
            for arr, w, b in ((self.params, self.W, self.b), (self.grads, self.dW, self.db)):
                w.append(arr[s][: OC * C].reshape(OC, C))
                b.append(arr[s][OC * C :])
        # dlrm_s_pytorch's init: weights N(0, 2/(C+OC)), biases N(0, 1/OC); drawn in float64
        # so float32 and float64 models start from the same values.
        for l, (C, OC) in enumerate(layers):
            rng = np.random.default_rng([*seed, l])
            self.W[l][...] = rng.normal(0.0, math.sqrt(2.0 / (C + OC)), (OC, C))
            self.b[l][...] = rng.normal(0.0, math.sqrt(1.0 / OC), OC)
        self.relu = [l < len(layers) - 1 or relu_last for l in range(len(layers))]
        self.inp: list[np.ndarray | None] = [None] * len(layers)  # saved layer inputs
        self.out: list[np.ndarray | None] = [None] * len(layers)  # saved outputs (after ReLU)

    def grad(self, l: int) -> np.ndarray:
        return self.grads[self.slices[l]]

    def forward(self, x: np.ndarray) -> np.ndarray:
        """x (n,C0) -> (n,OC_last); saves every layer's input and output."""
        for l, (_, OC) in enumerate(self.layers):
            out = self.out[l]
            if out is None or out.shape[0] != x.shape[0]:
                out = self.out[l] = np.empty((x.shape[0], OC), dtype=self.params.dtype)
            K.linear_forward(out, x, self.W[l], self.b[l])
            if self.relu[l]:
                K.relu_forward(out, out)
            self.inp[l], x = x, out
        return x

    def backward(self, l: int, dout: np.ndarray, need_dinp: bool = True) -> np.ndarray | None:
        """Layer l's backward from dout (n,OC_l): accumulates its gradients, returns dinp."""
        if self.relu[l]:
            dpre = np.zeros_like(dout)
            K.relu_backward(dpre, dout, self.out[l])
        else:
            dpre = dout
        dinp = np.zeros_like(self.inp[l]) if need_dinp else None
        K.linear_backward(dinp, self.dW[l], self.db[l], dpre, self.inp[l], self.W[l])
        return dinp

    def sgd(self, lr: float) -> None:
        self.params -= lr * self.grads
        self.grads[...] = 0


class DLRMShard:
    """The MLP replicas and the embedding layout of one rank (`sharding`: "table", "column"
    or "row"; `columns`: K for "column"), with the saved activations between the pieces of
    one iteration. `tables=False` skips allocating the tables (compute model or none only
    needs the communication buffers)."""

    def __init__(
        self,
        cfg: DLRMConfig,
        rank: int,
        world: int,
        seed: int = 0,
        dtype=np.float32,
        tables: bool = True,
        sharding: str = "table",
        columns: int = 1,
    ):
        if cfg.batch % world:
            raise ValueError(f"global batch {cfg.batch} is not a multiple of {world} ranks")
        self.cfg, self.W, self.dtype = cfg, world, np.dtype(dtype)
        self.B, self.b = cfg.batch, cfg.batch // world
        self.bottom = MLP(cfg.bottom_layers, True, (seed, 1), dtype)
        self.top = MLP(cfg.top_layers, False, (seed, 2), dtype)
        self.data = Synthetic(seed, cfg.dense, cfg.rows, cfg.pooling)
        if sharding == "row":
            self.emb = RowWise(cfg, rank, world, self.data, seed, dtype, tables)
        else:
            K = columns if sharding == "column" else 1
            self.emb = TableWise(cfg, rank, world, self.data, seed, dtype, K, tables)
        self.x = self.Z = self.R = self.logits = self.labels = self.d = None
        self.scale = 1.0

    @property
    def tables(self) -> dict[int, np.ndarray]:
        """This rank's shards by key (table-wise: the table id)."""
        return self.emb.tables

    # -- forward -----------------------------------------------------------------------------
    def bottom_forward(self, dense: np.ndarray) -> None:
        """dense (b,dense) -> x (b,D)."""
        self.x = self.bottom.forward(dense.astype(self.dtype, copy=False))

    def interaction_forward(self) -> None:
        """The layout's bags (b,NT,D) after its exchange -> R (b,I)."""
        cfg, b = self.cfg, self.b
        if self.Z is None:
            self.Z = np.empty((b, cfg.features, cfg.dim), dtype=self.dtype)
            self.R = np.empty((b, cfg.interaction), dtype=self.dtype)
        K.interaction_forward(self.R, self.Z, self.x, self.emb.emb())

    def top_forward(self, labels: np.ndarray, scale: float) -> float:
        """The top MLP and the loss; returns the sum of the b losses. The backward is of
        scale * that sum (scale = 1/B: the data-parallel SUM of gradients is then the
        gradient of the global mean loss)."""
        self.logits = self.top.forward(self.R)[:, 0]
        self.labels, self.scale = labels.astype(self.dtype, copy=False), scale
        losses = np.empty(self.b, dtype=self.dtype)
        K.bce_forward(losses, self.logits, self.labels)
        return float(losses.sum(dtype=np.float64))

    # -- backward ----------------------------------------------------------------------------
    def top_backward(self, l: int) -> None:
        """Layer l of the top MLP (the last one first starts from the loss)."""
        if l == len(self.top.layers) - 1:
            self.d = np.zeros((self.b, 1), dtype=self.dtype)
            K.bce_backward(self.d[:, 0], self.logits, self.labels, self.scale)
        self.d = self.top.backward(l, self.d)

    def interaction_backward(self) -> None:
        """dR -> dx (kept for the bottom MLP) and the bags' gradients, handed to the layout
        for its backward exchange."""
        cfg, b = self.cfg, self.b
        dx = np.zeros((b, cfg.dim), dtype=self.dtype)
        demb = np.zeros((b, cfg.tables, cfg.dim), dtype=self.dtype)
        K.interaction_backward(dx, demb, self.d, self.Z)
        self.emb.set_grad(demb)
        self.d = dx

    def bottom_backward(self, l: int) -> None:
        self.d = self.bottom.backward(l, self.d, need_dinp=l > 0)

    def step(self, lr: float) -> None:
        """SGD on the MLPs (after their gradients were summed over ranks); zero gradients."""
        self.bottom.sgd(lr)
        self.top.sgd(lr)
