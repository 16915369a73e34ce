"""The model side of benchmarks/gpt2_step.py: one whole GPT (any preset) as the proxies' one
stage model, `proxies.transformer.model.StageShard`, at tp = pp = 1, driven through its
public API (`compute(piece, mb, chunk)`, `batch`, `loss_scale`, `step`) exactly as the
proxies' runtimes drive it; and the PyTorch reference built from the same weights.

Letters as in proxies/transformer/config.py: B batch, T time, C channels, V vocabulary (Vp
padded), L layers, N = B*T.

The pieces of one micro-batch's forward and backward, and their FLOPs, come from the plan
(`transformer.plan.Pieces`): at tp = 1 there are no collectives between them, so running the
pieces back to back is the whole step, and what the benchmark times is what `--compute real`
runs on a rank holding the whole model.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from proxies.transformer.config import PRESETS as GPT2_PRESETS
from proxies.transformer.config import GPT2Config
from proxies.transformer.data import Synthetic, batch
from proxies.transformer.model import StageShard
from proxies.transformer.plan import Piece, Pieces
from proxies.transformer.setup import PRESETS as GPT3_PRESETS
from proxies.transformer.setup import GPT3Config, Setup, padded_vocab

PRESETS: dict[str, GPT2Config] = {**GPT2_PRESETS, **GPT3_PRESETS}
# GPT-3's front end pads the vocabulary to a multiple of 128 * tp (Megatron's
# --make-vocab-size-divisible-by default); GPT-2's keeps V (as llm.c's V, unpadded).
GPT3_VOCAB_MULTIPLE = 128
DATA = ("tokens", "targets")  # ChunkActs fields that hold the batch, not saved activations


def setup(cfg: GPT2Config, B: int, T: int) -> Setup:
    """The Setup a one-rank run of the preset's front end resolves into: tp = pp = dp = 1,
    one micro-batch, one chunk of all layers; the vocabulary padded as that front end pads
    it (GPT-3 presets: to Vp = 50304; GPT-2 presets: V)."""
    vocab = cfg.vocab_size
    if isinstance(cfg, GPT3Config):
        vocab = padded_vocab(cfg.vocab_size, 1, GPT3_VOCAB_MULTIPLE)
    return Setup(cfg, B, T, 1, 1, 1, 1, 1, False, vocab, (range(cfg.n_layer),), model=cfg.name)


class Step:
    """One rank's whole model, a StageShard, and the names of its pieces in plan order."""

    def __init__(self, cfg: GPT2Config, B: int, T: int, seed: int) -> None:
        self.S = S = setup(cfg, B, T)
        self.shard = StageShard(S, 0, seed=seed)
        self.shard.loss_scale = 1.0  # one micro-batch, one rank: the loss is its mean
        (self.chunk,) = S.chunks(0)
        plan = Pieces(S)
        items = plan.forward(self.chunk) + plan.backward(self.chunk)
        # tp = 1: only compute pieces (a collective here would be a plan this cannot run)
        assert all(isinstance(it, Piece) for it in items), items
        self.pieces: list[Piece] = items
        self.n_forward = len(plan.forward(self.chunk))
        self._xy: tuple[np.ndarray, np.ndarray] | None = None
        self.shard.batch = lambda mb: self._xy

    def forward(self, x: np.ndarray, y: np.ndarray) -> float:
        """One micro-batch's forward, piece by piece: its mean loss."""
        self._xy = (x, y)
        loss = None
        for p in self.pieces[: self.n_forward]:
            out = self.shard.compute(p.name, 0, self.chunk.index)
            if out is not None:  # "fwd_loss"
                loss = out
        return loss

    def backward(self) -> None:
        """Its backward: the gradients are written afresh by the first backward after a
        step (no zeroing pass)."""
        for p in self.pieces[self.n_forward :]:
            self.shard.compute(p.name, 0, self.chunk.index)

    def forward_backward(self, x: np.ndarray, y: np.ndarray) -> float:
        loss = self.forward(x, y)
        self.backward()
        return loss

    def step(self, lr: float) -> None:
        self.shard.step(lr)

    def model_flops(self) -> float:
        """FLOPs of one step as the plan counts them (the pieces' FLOPs, backward = 2 x
        forward): per layer 24 B T C^2 + 4 B T^2 C forward, the LM head 2 B T C Vp; for GPT-3
        presets over the padded vocabulary, as Megatron counts it (0.09% over V)."""
        return sum(p.flops for p in self.pieces)

    @property
    def state_bytes(self) -> int:
        """Parameters, gradients, AdamW m and v."""
        s = self.shard
        return 4 * (s.params.nbytes + s.eparams.nbytes)

    def saved_bytes(self) -> int:
        """Bytes of the arrays the forward keeps for the backward: the micro-batch's
        ChunkActs and its LayerActs, read between forward() and backward(). Views (a
        layer's input: x0 or the layer below's output) are counted where they were
        allocated."""
        acts = self.shard.saved[(0, self.chunk.index)]
        seen: dict[int, int] = {}  # a layer's `inp` is the very array below it: count once
        for obj in [acts, *acts.layers.values()]:
            for f in dataclasses.fields(obj):
                a = getattr(obj, f.name)
                # tokens, targets: the batch's own arrays, referenced (not the model's)
                if isinstance(a, np.ndarray) and a.base is None and f.name not in DATA:
                    seen[id(a)] = a.nbytes
        return sum(seen.values())

    def weights(self) -> dict[str, np.ndarray]:
        """Every parameter by name (nanoGPT / HF names, the Layout's), as the model holds it."""
        return self.shard.w

    def grads(self) -> dict[str, np.ndarray]:
        return self.shard.g


def tokens(cfg: GPT2Config, B: int, T: int, n: int, seed: int) -> list[tuple]:
    """n (inputs, targets) batches: step i takes samples i*B .. i*B + B - 1 (the proxies'
    synthetic tokens over the real vocabulary V, never a padding row)."""
    source = Synthetic(seed, cfg.vocab_size, T)
    return [batch(source, i * B, B) for i in range(n)]


# ----------------------------------------------------------------------------------------
# the PyTorch reference


def torch_reference(step: Step):
    """proxies.transformer.reference.GPT2 holding the shard's weights.

    Like with like under a padded vocabulary: the shard's wte has Vp rows, the last Vp - V
    of them zero and left out of its softmax (model.py: the loss does not depend on the
    padding). The reference is built at the real V with wte = the shard's first V rows, so
    both compute the same softmax over the same V logits; compare_grads then compares the
    first V rows of the shard's wte gradient and checks its padding rows got none."""
    import torch

    from proxies.transformer.reference import GPT2

    ref = GPT2(step.S.cfg)
    w, V = step.weights(), step.S.cfg.vocab_size
    with torch.no_grad():
        for name, p in ref.named().items():
            ours = w[name][:V] if name == "wte" else w[name]
            p.copy_(torch.from_numpy(np.ascontiguousarray(ours)))
    return ref


def compare_grads(step: Step, ref) -> dict:
    """Per tensor max|g_ours - g_torch| / max|g_torch|; the worst tensor. wte over the real
    vocabulary (see torch_reference); its padding rows must have a zero gradient."""
    g, V = step.grads(), step.S.cfg.vocab_size
    pad = g["wte"][V:]
    worst, name = (np.inf, "wte padding") if pad.size and np.abs(pad).max() else (-1.0, "")
    for n, p in ref.named().items():
        theirs = p.grad.numpy()
        ours = g[n][:V] if n == "wte" else g[n]
        scale = float(np.abs(theirs).max()) or 1.0
        d = float(np.abs(ours - theirs).max()) / scale
        if d > worst:
            worst, name = d, n
    return {"grad_rel_diff": worst, "grad_worst_tensor": name}
