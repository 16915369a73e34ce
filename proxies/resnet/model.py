"""One replica's ResNet in NumPy: flat parameters and gradients, forward and backward in the
plan's pieces (stem, each bottleneck block, head), SGD, and the synthetic data.

The flat arrays hold the tensors in backward order (the reverse of torchvision's
parameters(): fc first, the stem last), as PyTorch DDP buckets them: the gradients a
backward piece completes are one contiguous range, so a bucket is a slice of `grads`.
"""

from __future__ import annotations

import numpy as np

from proxies.core import pages
from proxies.core.fsdp import anonymous
from proxies.resnet import kernels as K
from proxies.resnet.config import ResNetConfig


def sample(cfg: ResNetConfig, seed: int, index: int, dtype=np.float32) -> tuple[np.ndarray, int]:
    """Global sample `index`: a (3, S, S) image and its label, from its own seed, so every
    rank layout sees the same samples."""
    rng = np.random.default_rng([seed, 7, index])
    img = rng.standard_normal((3, cfg.image_size, cfg.image_size), dtype=np.float32)
    return img.astype(dtype, copy=False), int(rng.integers(cfg.classes))


def batch(cfg: ResNetConfig, seed: int, first: int, B: int, dtype=np.float32):
    """Samples first .. first+B-1 as (images (B, 3, S, S), labels (B,))."""
    xs = [sample(cfg, seed, first + b, dtype) for b in range(B)]
    return np.stack([x for x, _ in xs]), np.array([y for _, y in xs])


def layout(cfg: ResNetConfig, pad: int = 1) -> tuple[dict[str, tuple[int, int]], int]:
    """({tensor: [lo, hi)}, length) of the flat arrays: backward order, each plan piece's
    tensors contiguous, a piece's range padded to a multiple of `pad`."""
    from proxies.resnet.plans import piece_of

    offsets: dict[str, tuple[int, int]] = {}
    lo = start = 0
    piece = None
    for name, c in reversed(cfg.tensors):
        if piece_of(name) != piece:
            lo = start = start + -(-(lo - start) // pad) * pad
            piece = piece_of(name)
        offsets[name] = (lo, lo + c)
        lo += c
    return offsets, start + -(-(lo - start) // pad) * pad


class ResNetModel:
    """Parameters, gradients, momentum and batch-norm running statistics of one replica.

    forward_piece / backward_piece run one plan piece on the activations kept in between;
    backward accumulates into `grads` (zero_grad after the step)."""

    def __init__(self, cfg: ResNetConfig, seed: int = 0, dtype=np.float32, pad: int = 1):
        """pad > 1 (FSDP, resnet/fsdp.py): each plan piece's range starts at a multiple of
        pad and is followed by zeros up to one (its unit padded for an equal shard per
        rank); params and grads are private anonymous memory (core/fsdp.py anonymous, so a
        freed unit's pages can be given back) and the momentum lives with the shards."""
        self.cfg, self.dtype = cfg, dtype
        self.offsets, n = layout(cfg, pad)
        if pad > 1:
            self.params, self.grads = anonymous(n, dtype), anonymous(n, dtype)
            self.momentum_buf = np.zeros(0, dtype)
        else:
            self.params = np.zeros(n, dtype)
            self.grads = pages.zeros(n, dtype)  # allreduced
            self.momentum_buf = np.zeros(n, dtype)
        self.convs = {c.name: c for c in cfg.layers}
        # Batch-norm buffers as torchvision's buffers() lists them, flattened per dtype as
        # DDP's coalesced broadcast sends them: running mean and var of every layer (float),
        # and its num_batches_tracked (int64).
        self.bn_stats = np.zeros(2 * sum(c.cout for c in cfg.layers), dtype)
        self.bn_counts = np.zeros(len(cfg.layers), np.int64)
        self.running: dict[str, tuple[np.ndarray, np.ndarray, int]] = {}
        lo = 0
        for i, c in enumerate(cfg.layers):
            rm, rv = self.bn_stats[lo : lo + c.cout], self.bn_stats[lo + c.cout : lo + 2 * c.cout]
            rv[...] = 1.0
            self.running[c.name] = (rm, rv, i)
            lo += 2 * c.cout
        self._init(seed)
        self.cache: dict[str, object] = {}
        self.loss = 0.0

    # -- parameters --------------------------------------------------------------------

    def p(self, name: str) -> np.ndarray:
        lo, hi = self.offsets[name]
        return self.params[lo:hi]

    def g(self, name: str) -> np.ndarray:
        lo, hi = self.offsets[name]
        return self.grads[lo:hi]

    def piece_range(self, piece: str) -> tuple[int, int]:
        """The flat range of the gradients backward piece `piece` completes."""
        prefix = {"stem": ("conv1.", "bn1."), "head": ("fc.",)}.get(piece, (piece + ".",))
        spans = [v for k, v in self.offsets.items() if k.startswith(prefix)]
        return min(lo for lo, _ in spans), max(hi for _, hi in spans)

    def _init(self, seed: int) -> None:
        """torchvision's: conv kaiming normal (fan out, ReLU gain), batch norm 1 and 0, fc
        uniform in +-1/sqrt(in) (weight and bias)."""
        rng = np.random.default_rng([seed, 11])
        for c in self.cfg.layers:
            w = self._conv_w(c.name)
            w[...] = rng.standard_normal(w.shape) * np.sqrt(2.0 / (c.cout * c.k * c.k))
            gamma, _ = self._bn(c.name)
            gamma[...] = 1.0
        bound = 1.0 / np.sqrt(self.cfg.features)
        self.p("fc.weight")[...] = rng.uniform(-bound, bound, self.cfg.classes * self.cfg.features)
        self.p("fc.bias")[...] = rng.uniform(-bound, bound, self.cfg.classes)

    def _conv_w(self, conv: str, grad: bool = False) -> np.ndarray:
        c = self.convs[conv]
        key = conv + (".0.weight" if conv.endswith("downsample") else ".weight")
        return (self.g if grad else self.p)(key).reshape(c.cout, c.cin, c.k, c.k)

    def _bn(self, conv: str, grad: bool = False) -> tuple[np.ndarray, np.ndarray]:
        bn = conv + ".1" if conv.endswith("downsample") else conv.replace("conv", "bn")
        get = self.g if grad else self.p
        return get(bn + ".weight"), get(bn + ".bias")

    # -- conv + batch norm (+ ReLU) units ----------------------------------------------

    def _cbr(self, conv: str, x: np.ndarray, relu: bool) -> np.ndarray:
        c = self.convs[conv]
        y, ccache = K.conv2d_forward(x, self._conv_w(conv), c.stride, c.pad)
        gamma, beta = self._bn(conv)
        rm, rv, i = self.running[conv]
        self.bn_counts[i] += 1
        y, bcache = K.batchnorm_forward(y, gamma, beta, rm, rv)
        if relu:
            y = K.relu_forward(y, inplace=True)
        self.cache[conv] = (ccache, bcache, y if relu else None)
        return y

    def _cbr_back(self, conv: str, dy: np.ndarray, need_dx: bool = True) -> np.ndarray | None:
        ccache, bcache, y = self.cache.pop(conv)
        if y is not None:
            dy = K.relu_backward(dy, y)
        dgamma, dbeta = self._bn(conv, grad=True)
        dy = K.batchnorm_backward(dy, dgamma, dbeta, bcache)
        return K.conv2d_backward(dy, self._conv_w(conv), self._conv_w(conv, True), ccache, need_dx)

    # -- plan pieces -------------------------------------------------------------------

    def forward_piece(self, piece: str, x: np.ndarray | None = None, labels=None):
        """Run `piece` forward on x (the previous piece's output); the head takes the
        labels and returns the loss."""
        if piece == "stem":
            y = self._cbr("conv1", x, relu=True)
            y, self.cache["maxpool"] = K.maxpool_forward(y)
            return y
        if piece == "head":
            self.cache["head"] = (x.shape, pooled := K.avgpool_forward(x), labels)
            logits = K.fc_forward(pooled, self._fc_w(), self.p("fc.bias"))
            self.loss, self.cache["dlogits"] = K.softmax_xent(logits, labels)
            return self.loss
        # a bottleneck block: relu(bn3(conv3(relu(bn2(conv2(relu(bn1(conv1 x)))))) + short)
        h = self._cbr(piece + ".conv1", x, relu=True)
        h = self._cbr(piece + ".conv2", h, relu=True)
        h = self._cbr(piece + ".conv3", h, relu=False)
        ds = piece + ".downsample"
        h += self._cbr(ds, x, relu=False) if ds in self.convs else x
        out = K.relu_forward(h, inplace=True)
        self.cache[piece] = out
        return out

    def _fc_w(self, grad: bool = False) -> np.ndarray:
        get = self.g if grad else self.p
        return get("fc.weight").reshape(self.cfg.classes, self.cfg.features)

    def backward_piece(self, piece: str, dout: np.ndarray | None = None) -> np.ndarray | None:
        """The gradient w.r.t. `piece`'s input from that w.r.t. its output (the head: from
        the loss); the piece's parameter gradients accumulate into `grads`."""
        if piece == "head":
            shape, pooled, _ = self.cache.pop("head")
            dpooled = K.fc_backward(
                self.cache.pop("dlogits"), pooled, self._fc_w(), self._fc_w(True), self.g("fc.bias")
            )
            return K.avgpool_backward(dpooled, shape)
        if piece == "stem":
            dy = K.maxpool_backward(dout, self.cache.pop("maxpool"))
            return self._cbr_back("conv1", dy, need_dx=False)
        dh = K.relu_backward(dout, self.cache.pop(piece))
        ds = piece + ".downsample"
        dx = self._cbr_back(ds, dh) if ds in self.convs else dh.copy()
        d = self._cbr_back(piece + ".conv3", dh)
        d = self._cbr_back(piece + ".conv2", d)
        dx += self._cbr_back(piece + ".conv1", d)
        return dx

    def pieces(self) -> list[str]:
        return ["stem", *self.cfg.block_names(), "head"]

    def forward_backward(self, images: np.ndarray, labels: np.ndarray) -> float:
        """One whole forward and backward (the one-process reference); returns the loss."""
        x = images
        for piece in self.pieces()[:-1]:
            x = self.forward_piece(piece, x)
        loss = self.forward_piece("head", x, labels)
        d = None
        for piece in reversed(self.pieces()):
            d = self.backward_piece(piece, d)
        return loss

    def step(self, lr: float, momentum: float, weight_decay: float, scale: float = 1.0) -> None:
        K.sgd_step(self.params, self.grads, self.momentum_buf, lr, momentum, weight_decay, scale)

    def zero_grad(self) -> None:
        self.grads[...] = 0


def reference_losses(
    cfg: ResNetConfig,
    replicas: int,
    B: int,
    iters: int,
    seed: int = 0,
    lr: float = 0.1,
    momentum: float = 0.9,
    weight_decay: float = 1e-4,
    dtype=np.float64,
) -> list[float]:
    """The one-process reference of `replicas` data-parallel replicas of B images each:
    each replica's samples through the model on their own (batch norm per replica, as DDP
    without SyncBatchNorm), the gradients summed and averaged, one step. Mean loss over the
    replicas per iteration."""
    m = ResNetModel(cfg, seed, dtype)
    G, out = replicas * B, []
    total = np.zeros_like(m.grads)
    for it in range(iters):
        losses = []
        total[...] = 0
        for d in range(replicas):
            # each replica's gradient on its own, then summed in rank order: an allreduce's
            # sum (exactly so for 2 ranks), not one accumulation over every replica's images
            m.zero_grad()
            images, labels = batch(cfg, seed, it * G + d * B, B, dtype)
            losses.append(m.forward_backward(images, labels))
            total += m.grads
        m.grads[...] = total
        m.step(lr, momentum, weight_decay, 1.0 / replicas)
        m.zero_grad()
        out.append(sum(losses) / replicas)
    return out
