"""One rank's part of DLRM: MLP replicas, the tables it owns, forward and backward in pieces.

Letters as in config.py: B global batch, b = B / W local batch, W ranks, NT tables, D
embedding width, F = NT + 1, I interaction width; S = ceil(NT / W) table slots per rank.

Parallelism (as dlrm_s_pytorch's distributed mode): the MLPs are data-parallel (every rank a
replica, its own b samples); the tables are model-parallel, table t on rank t % W in slot
t // W. The embedding all-to-all moves arrays of (W,S,b,D): on the sender, block j (= [j])
holds its tables' pooled embeddings of rank j's samples; after the exchange, block j holds
rank j's tables for this rank's samples. Ranks with fewer than S tables send zero padding,
since MPI_Alltoall needs equal blocks. The backward all-to-all is the same exchange reversed.

Sample s of the global batch is local sample s % b of rank s // b, so a table's B lookups in
order are exactly the W blocks of b in rank order.
"""

from __future__ import annotations

import math

import numpy as np

from proxies.dlrm import kernels as K
from proxies.dlrm.config import DLRMConfig


def owned_tables(rank: int, world: int, tables: int) -> list[int]:
    """Tables of `rank`, in slot order: t = rank + k W for slot k."""
    return list(range(rank, tables, world))


def slots(world: int, tables: int) -> int:
    """S: table slots per rank in the all-to-all (the most tables any rank holds)."""
    return -(-tables // world)


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
        self.grads = np.zeros(offsets[-1], dtype=dtype)
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


def init_table(seed: int, t: int, rows: int, D: int, dtype=np.float32) -> np.ndarray:
    """dlrm_s_pytorch's init: uniform in +-sqrt(1/R), drawn per table whichever rank owns it,
    in float32 (tables are large) and then cast, so float64 tables hold the same values."""
    rng = np.random.default_rng([seed, 3, t])
    table = rng.random((rows, D), dtype=np.float32)
    table *= np.float32(2 * math.sqrt(1.0 / rows))
    table -= np.float32(math.sqrt(1.0 / rows))
    return table.astype(dtype, copy=False)


class DLRMShard:
    """The MLP replicas and the owned tables of one rank, with the saved activations between
    the pieces of one iteration. `tables=False` skips allocating the tables (compute model or
    none only needs the gradient buffers)."""

    def __init__(
        self,
        cfg: DLRMConfig,
        rank: int,
        world: int,
        seed: int = 0,
        dtype=np.float32,
        tables: bool = True,
    ):
        if cfg.batch % world:
            raise ValueError(f"global batch {cfg.batch} is not a multiple of {world} ranks")
        self.cfg, self.W, self.dtype = cfg, world, np.dtype(dtype)
        self.B, self.b, self.S = cfg.batch, cfg.batch // world, slots(world, cfg.tables)
        self.owned = owned_tables(rank, world, cfg.tables)
        self.bottom = MLP(cfg.bottom_layers, True, (seed, 1), dtype)
        self.top = MLP(cfg.top_layers, False, (seed, 2), dtype)
        self.tables = (
            {t: init_table(seed, t, cfg.rows[t], cfg.dim, dtype) for t in self.owned}
            if tables
            else {}
        )
        self.idx: dict[int, np.ndarray] = {}
        self.x = self.Z = self.R = self.logits = self.labels = self.d = None
        self.scale = 1.0

    # -- forward -----------------------------------------------------------------------------
    def emb_forward(self, out: np.ndarray, idx: dict[int, np.ndarray]) -> None:
        """out (W,S,b,D) = the owned tables' bags for the whole global batch; idx[t] (B,P)."""
        pooled = np.empty((self.B, self.cfg.dim), dtype=self.dtype)
        for k, t in enumerate(self.owned):
            K.embedding_bag_forward(pooled, self.tables[t], idx[t])
            out[:, k] = pooled.reshape(self.W, self.b, -1)
        self.idx = idx

    def bottom_forward(self, dense: np.ndarray) -> None:
        """dense (b,dense) -> x (b,D)."""
        self.x = self.bottom.forward(dense.astype(self.dtype, copy=False))

    def interaction_forward(self, received: np.ndarray) -> None:
        """received (W,S,b,D) from the all-to-all -> R (b,I)."""
        cfg, b = self.cfg, self.b
        # table t = k W + j sits in block j, slot k: (b, S, W, D) puts it at column t
        emb = received.transpose(2, 1, 0, 3).reshape(b, self.S * self.W, cfg.dim)[:, : cfg.tables]
        if self.Z is None:
            self.Z = np.empty((b, cfg.features, cfg.dim), dtype=self.dtype)
            self.R = np.empty((b, cfg.interaction), dtype=self.dtype)
        K.interaction_forward(self.R, self.Z, self.x, emb)

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

    def interaction_backward(self, out: np.ndarray) -> None:
        """dR -> dx (kept for the bottom MLP) and the embedding gradients, written to out
        (W,S,b,D) for the reverse all-to-all: block j = tables of rank j, padding zero."""
        cfg, b = self.cfg, self.b
        dx = np.zeros((b, cfg.dim), dtype=self.dtype)
        demb = np.zeros((b, self.S * self.W, cfg.dim), dtype=self.dtype)
        K.interaction_backward(dx, demb[:, : cfg.tables], self.d, self.Z)
        out[...] = demb.reshape(b, self.S, self.W, cfg.dim).transpose(2, 1, 0, 3)
        self.d = dx

    def bottom_backward(self, l: int) -> None:
        self.d = self.bottom.backward(l, self.d, need_dinp=l > 0)

    def emb_backward(self, received: np.ndarray, lr: float) -> None:
        """received (W,S,b,D): block j holds the gradients of this rank's bags for rank j's
        samples, i.e. slot k over the blocks is table k's (B,D) in global order. Sparse SGD."""
        for k, t in enumerate(self.owned):
            dpooled = received[:, k].reshape(self.B, self.cfg.dim)
            rows, drows = K.embedding_bag_backward(dpooled, self.idx[t])
            K.embedding_sgd(self.tables[t], rows, drows, lr)

    def step(self, lr: float) -> None:
        """SGD on the MLPs (after their gradients were summed over ranks); zero gradients."""
        self.bottom.sgd(lr)
        self.top.sgd(lr)
