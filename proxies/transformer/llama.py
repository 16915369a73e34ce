"""LLaMA-3 and Mixtral as an architecture of the one transformer: RMSNorm (weight only),
rotary position embeddings (no wpe), grouped-query attention (kv_heads key/value heads,
each shared by n_head / kv_heads query heads), a SwiGLU MLP, no biases, an untied LM head.

Tensor names are GPT's (so the tensor-parallel layout shards them the same way):
ln_1.weight / ln_2.weight are the RMSNorms, attn.c_attn.weight the fused [q; k; v]
projection ((C + 2 KVH hs) x C), attn.c_proj.weight the output projection, mlp.c_fc.weight
the fused [gate (w1); up (w3)] (2F x C, Megatron's gated linear_fc1), mlp.c_proj.weight w2
(C x F). Sizes: Meta's Llama 3 and Mistral's Mixtral published configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from proxies.transformer.setup import GPT3Config


@dataclass(frozen=True)
class LlamaConfig(GPT3Config):
    """A LLaMA (dense) or Mixtral (experts > 0) network."""

    n_kv_head: int = 0  # KVH (0: n_head, no grouping)
    ffn_dim: int = 0  # F: the SwiGLU hidden width (of one expert for Mixtral)
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    experts: int = 0  # E experts per layer (Mixtral), 0: a dense MLP
    top_k: int = 2

    tied: ClassVar[bool] = False
    learned_pos: ClassVar[bool] = False
    biases: ClassVar[bool] = False
    gated: ClassVar[bool] = True
    rmsnorm: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head = {self.n_head} is not a multiple of n_kv_head")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError("rotary embeddings need an even head size")
        if self.ffn_dim <= 0:
            raise ValueError(f"ffn_dim must be positive, got {self.ffn_dim}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def mlp_hidden(self) -> int:
        return self.ffn_dim

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        C, F = self.n_embd, self.ffn_dim
        return {
            "ln_1.weight": (C,),
            "attn.c_attn.weight": (self.qkv_rows, C),
            "attn.c_proj.weight": (C, C),
            "ln_2.weight": (C,),
            "mlp.c_fc.weight": (2 * F, C),
            "mlp.c_proj.weight": (C, F),
        }

    @property
    def layer_params(self) -> int:
        """2 RMSNorms, qkv (C + 2 KVH hs) x C, proj C x C, and 3CF per MLP (E of them and
        a C x E router for Mixtral)."""
        C = self.n_embd
        mlp = 3 * C * self.ffn_dim
        if self.experts:
            mlp = self.experts * mlp + self.experts * C
        return 2 * C + self.qkv_rows * C + C * C + mlp

    @property
    def num_params(self) -> int:
        """Embedding and untied head (2 V C), the layers, the final RMSNorm."""
        C = self.n_embd
        return 2 * self.vocab_size * C + self.n_layer * self.layer_params + C


PRESETS: dict[str, LlamaConfig] = {
    c.name: c
    for c in (
        # Meta Llama 3: (L, C, NH, V, context 8192), KVH, F; rope theta 500,000. Keywords past the
        # context: GPT2Config fields (causal) come first in the positional order.
        LlamaConfig("llama3-8b", 32, 4096, 32, 128256, 8192, n_kv_head=8, ffn_dim=14336),
        LlamaConfig("llama3-70b", 80, 8192, 64, 128256, 8192, n_kv_head=8, ffn_dim=28672),
        # Mixtral 8x7B: 8 experts of F 14336, top-2, context 32768, rope theta 1e6.
        LlamaConfig(
            "mixtral-8x7b",
            32,
            4096,
            32,
            32000,
            32768,
            n_kv_head=8,
            ffn_dim=14336,
            rope_theta=1e6,
            experts=8,
        ),
        # Tests: the real structure at small widths, 4 heads sharing 2 kv heads.
        LlamaConfig("llama-tiny", 4, 64, 4, 256, 128, n_kv_head=2, ffn_dim=160),
        LlamaConfig(
            "mixtral-tiny", 4, 64, 4, 256, 128, n_kv_head=2, ffn_dim=96, rope_theta=1e6, experts=4
        ),
    )
}
DEFAULT_MODEL = "llama3-8b"
TINY = ("llama-tiny", "mixtral-tiny")
