"""GPT-2 model configurations.

Letters used across proxies/gpt2: B batch (micro-batch), T time (sequence), C channels,
NH heads, hs = C / NH head size, V vocabulary, L layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class GPT2Config:
    name: str
    n_layer: int  # L
    n_embd: int  # C
    n_head: int  # NH
    vocab_size: int = 50257  # V: GPT-2's tokenizer (llm.c pads to 50304 for speed; we do not)
    max_seq_len: int = 1024  # rows of the position embedding wpe
    causal: bool = True  # attention masks future keys; False: BERT's bidirectional encoder

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_embd", "n_head", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd = {self.n_embd} is not a multiple of n_head = {self.n_head}")

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer layer: 12C^2 + 13C in 12 tensors."""
        C = self.n_embd
        return 12 * C * C + 13 * C

    @property
    def num_params(self) -> int:
        """All parameters, the tied token embedding counted once."""
        C = self.n_embd
        return (self.vocab_size + self.max_seq_len) * C + self.n_layer * self.layer_params + 2 * C

    def with_layers(self, n_layer: int) -> GPT2Config:
        return replace(self, n_layer=n_layer)

    def extra_sections(
        self, vocab_local: int, embed: bool, head: bool
    ) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
        """Layout sections a model family adds to wte / wpe / ln_f (layout.Layout), by the
        names Setup.param_order lists: (tensor, shard shape) each. GPT: none (BERT's
        embedding and MLM head tensors, encoder.py)."""
        return {}


# One transformer layer's 12 tensors, named as in nanoGPT / the HF checkpoint; weights (OC, C).
def layer_shapes(C: int) -> dict[str, tuple[int, ...]]:
    return {
        "ln_1.weight": (C,),
        "ln_1.bias": (C,),
        "attn.c_attn.weight": (3 * C, C),
        "attn.c_attn.bias": (3 * C,),
        "attn.c_proj.weight": (C, C),
        "attn.c_proj.bias": (C,),
        "ln_2.weight": (C,),
        "ln_2.bias": (C,),
        "mlp.c_fc.weight": (4 * C, C),
        "mlp.c_fc.bias": (4 * C,),
        "mlp.c_proj.weight": (C, 4 * C),
        "mlp.c_proj.bias": (C,),
    }


# One layer's tensors in layout order (and the order init draws them).
LAYER_TENSORS = tuple(layer_shapes(1))


def normal(out: np.ndarray, rng: np.random.Generator, std: float) -> None:
    """out = N(0, std) drawn in float64 a block of rows at a time (bounded temporary), then
    cast: float32 and float64 models start from the same values."""
    rows = out.reshape(out.shape[0], -1)
    step = max(1, (1 << 20) // rows.shape[1])
    for i in range(0, rows.shape[0], step):
        block = rng.standard_normal(rows[i : i + step].shape)
        block *= std
        rows[i : i + step] = block


def stage_layout(
    cfg: GPT2Config, layers: range, first: bool, last: bool
) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, shape, offset) of every tensor a pipeline stage holds, in its flat buffer:
    wte first (held by the first and the last stage: the LM head is tied), then wpe, the
    layers, ln_f."""
    C, V = cfg.n_embd, cfg.vocab_size
    shapes: list[tuple[str, tuple[int, ...]]] = []
    if first or last:
        shapes.append(("wte", (V, C)))
    if first:
        shapes.append(("wpe", (cfg.max_seq_len, C)))
    for l in layers:
        shapes += [(f"h.{l}.{n}", s) for n, s in layer_shapes(C).items()]
    if last:
        shapes += [("ln_f.weight", (C,)), ("ln_f.bias", (C,))]
    layout, offset = [], 0
    for name, shape in shapes:
        layout.append((name, shape, offset))
        offset += math.prod(shape)
    return layout


def layout_size(layout: list[tuple[str, tuple[int, ...], int]]) -> int:
    name, shape, offset = layout[-1]
    return offset + math.prod(shape)


def backward_pieces(
    cfg: GPT2Config, layers: range, first: bool, last: bool
) -> list[tuple[str, tuple[tuple[int, int], ...]]]:
    """A stage's backward in pieces, in backward order (as StageShard.pieces, whole.py): (name, the
    flat [lo, hi) ranges of the gradients complete after that piece and not before).

    "head" (last stage): ln_f, and wte unless the stage is also first (then the encoder adds
    to wte: it completes at "embed"); "h.{l}": layer l's 12 tensors; "embed" (first stage):
    wte and wpe. Together the ranges cover the stage's flat buffer once. The head's two
    ranges are not adjacent (wte opens the layout, ln_f closes it): a bucket holding it is
    one range only once it reaches down to wte.
    """
    at = {
        name: (offset, offset + math.prod(shape))
        for name, shape, offset in stage_layout(cfg, layers, first, last)
    }
    pieces = []
    if last:
        lnf = (at["ln_f.weight"][0], at["ln_f.bias"][1])
        pieces.append(("head", (lnf,) if first else (lnf, at["wte"])))
    for l in reversed(layers):
        lo, hi = at[f"h.{l}.ln_1.weight"][0], at[f"h.{l}.mlp.c_proj.bias"][1]
        pieces.append((f"h.{l}", ((lo, hi),)))
    if first:
        pieces.append(("embed", ((at["wte"][0], at["wpe"][1]),)))
    return pieces


def stage_flops(cfg: GPT2Config, layers: range, last: bool, B: int, T: int) -> float:
    """Forward FLOPs of one micro-batch: 2 per multiply-add of every matmul. Per layer
    24 B T C^2 (qkv, proj, fc, fcproj) + 4 B T^2 C (QK^T and AV over the full T x T square,
    as computed); the LM head 2 B T V C. Backward is twice this."""
    C = cfg.n_embd
    f = len(layers) * (24 * B * T * C * C + 4 * B * T * T * C)
    if last:
        f += 2 * B * T * cfg.vocab_size * C
    return float(f)


PRESETS: dict[str, GPT2Config] = {
    c.name: c
    for c in (
        GPT2Config("gpt2", 12, 768, 12),
        GPT2Config("gpt2-medium", 24, 1024, 16),
        GPT2Config("gpt2-large", 36, 1280, 20),
        GPT2Config("gpt2-xl", 48, 1600, 25),
        # Small enough for tests, CI and 32 oversubscribed ranks on 2 cores; real vocabulary so
        # llm.c token files work with it.
        GPT2Config("gpt2-tiny", 4, 64, 4),
    )
}
