"""GPT-2 model configurations.

Letters used across proxies/gpt2: B batch (micro-batch), T time (sequence), C channels,
NH heads, hs = C / NH head size, V vocabulary, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GPT2Config:
    name: str
    n_layer: int  # L
    n_embd: int  # C
    n_head: int  # NH
    vocab_size: int = 50257  # V: GPT-2's tokenizer (llm.c pads to 50304 for speed; we do not)
    max_seq_len: int = 1024  # rows of the position embedding wpe

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
