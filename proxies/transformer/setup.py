"""GPT-3 model configurations and the parallel setup one run uses.

Letters used across proxies/gpt3 (as proxies/gpt2, plus the parallel degrees):
B micro-batch (samples), T sequence, C channels (d_model), NH heads, hs = C / NH,
V vocabulary (Vp padded), L layers, N = B*T tokens of a micro-batch;
tp tensor-, pp pipeline-, dp data-, ep expert-parallel degrees; v model chunks per rank
(virtual stages); m micro-batches per iteration; E experts, k experts per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from proxies.transformer.config import GPT2Config


@dataclass(frozen=True)
class GPT3Config(GPT2Config):
    """GPT-2's architecture (and validation, parameter counts) at GPT-3's sizes. Python ints
    count parameters, so 175B prints 174.6 billion (the C++ proxy's 32-bit product prints
    162)."""

    max_seq_len: int = 2048  # rows of the position embedding wpe (GPT-3's context)

    def to_gpt2(self) -> GPT2Config:
        """The same network as a GPT-2 config: the unsharded reference in tests."""
        return GPT2Config(
            self.name, self.n_layer, self.n_embd, self.n_head, self.vocab_size, self.max_seq_len
        )


PRESETS: dict[str, GPT3Config] = {
    c.name: c
    for c in (
        # Brown et al. 2020, Table 2.1: (L, d_model, heads), d_head = d_model / heads.
        GPT3Config("gpt3-small", 12, 768, 12),
        GPT3Config("gpt3-medium", 24, 1024, 16),
        GPT3Config("gpt3-large", 24, 1536, 16),
        # The table lists 24 heads of 128 for XL, which is 3072 wide, not d_model = 2048 (and
        # would not make 1.3B); 16 heads of 128 as Megatron and GPT-NeoX configs use.
        GPT3Config("gpt3-xl", 24, 2048, 16),
        GPT3Config("gpt3-2.7b", 32, 2560, 32),
        GPT3Config("gpt3-6.7b", 32, 4096, 32),
        # The table's d_model 5140 is not 40 heads x 128 (and not divisible by 40): 5120 is.
        GPT3Config("gpt3-13b", 40, 5120, 40),
        GPT3Config("gpt3-175b", 96, 12288, 96),
        # Tests and laptops: real vocabulary, 4 heads so tp = 1, 2, 4 all divide them.
        GPT3Config("gpt3-tiny", 4, 64, 4, max_seq_len=128),
    )
}
DEFAULT_MODEL = "gpt3-175b"

# The C++ proxy (spcl/DNN-cpp-proxies, gpt3.cpp): GPT-3 175B, micro-batch 1, sequence 2048,
# tensor parallel 4, one layer per stage; times measured on A100 per layer shard.
CPP_FWD_US = 15915
CPP_BWD_US = 31830


def layer_flops(cfg: GPT3Config, B: int, T: int) -> tuple[float, float]:
    """Forward FLOPs of one whole layer for one micro-batch, as (attention, MLP): 2 per
    multiply-add. Attention: qkv 6BTC^2 + proj 2BTC^2 + QK^T and AV 4BT^2C (the causal
    mask not discounted); MLP: fc and fcproj 16BTC^2. Backward is twice each."""
    C = cfg.n_embd
    return 8.0 * B * T * C * C + 4.0 * B * T * T * C, 16.0 * B * T * C * C


def cpp_device_tflops() -> float:
    """The rate that makes --compute model reproduce the C++ proxy's A100 times: one 175B
    layer shard at tp 4, B 1, T 2048 then takes 15,915 us forward and 31,830 us backward."""
    attn, mlp = layer_flops(PRESETS["gpt3-175b"], 1, 2048)
    return (attn + mlp) / 4 / (CPP_FWD_US * 1e-6) / 1e12


@dataclass(frozen=True)
class MoESpec:
    """Mixture of experts replacing every layer's MLP (Megatron's --moe-layer-freq 1)."""

    experts: int  # E
    top_k: int  # k
    capacity_factor: float
    ffn_hidden: int  # F: hidden width of one expert (4C for full-size experts)
    ep: int  # expert-parallel degree: each rank of an ep group holds E / ep experts

    def capacity(self, N: int) -> int:
        """Slots per expert per source rank and micro-batch: ceil(cf * k * N / E)."""
        return max(1, math.ceil(self.capacity_factor * self.top_k * N / self.experts))

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep


@dataclass(frozen=True)
class Chunk:
    """One model chunk (virtual stage) of a rank: consecutive layers, maybe the embedding
    (virtual stage 0) and the LM head (the last virtual stage)."""

    index: int  # model chunk on this rank, 0..v-1
    vstage: int  # virtual stage c*pp + s
    layers: range
    embed: bool
    head: bool


# Setup.param_order's two values (layout.Layout reads them).
EXTRAS_FIRST = ("wte", "wpe", "ln_f", "layers")  # GPT-3, Megatron's chunks
GPT2_ORDER = ("wte", "wpe", "layers", "ln_f")  # GPT-2, config.stage_layout


@dataclass(frozen=True)
class Setup:
    """Everything the plans, the runtime and the printed description share: model, shapes,
    degrees, the resolved schedule and gradient sync. GPT-2 resolves into it too (tp = v =
    1, no sequence parallelism or MoE)."""

    cfg: GPT3Config
    B: int
    T: int
    m: int  # micro-batches per iteration
    tp: int
    pp: int
    dp: int
    v: int  # model chunks per rank (virtual stages)
    sp: bool  # sequence parallel (tp > 1 only)
    vocab: int  # Vp: vocabulary padded to a multiple of tp (Megatron: of 128 * tp)
    split: tuple[range, ...]  # layers of each virtual stage, in virtual-stage order
    moe: MoESpec | None = None
    bucket: int = 0  # DP bucket size in elements; 0 = one bucket per layer
    inflight: int = 2  # DP buckets in flight at once (0 = no limit)
    layers_only: bool = False  # no embedding, LM head or loss (the C++ proxy's pattern)
    # What the front ends resolved besides the shapes (the defaults describe GPT-3's run):
    model: str = ""  # the preset's name as given (gpt2's dnn-cpp-proxies keeps its own)
    schedule: str = "1f1b"  # the pipeline schedule resolved (gpt2 also: cpp)
    # Data-parallel gradient sync, a core/grads.py policy: buckets (overlapping the last
    # backward), fused, per-tensor, zero1, or per-layer (gpt2's C++ parity schedule).
    sync: str = "buckets"
    bucket_mb: float | None = None  # the bucket size as given in MiB (None: not given)
    # Context parallelism (transformer/cp.py): the sequence split over cp ranks by its
    # tokens, how they split it and what attention exchanges; cp = 1: none.
    cp: int = 1
    cp_split: str = "zigzag"  # contiguous | interleaved | zigzag
    cp_comm: str = "ring"  # allgather | ring | alltoall
    cp_reduce: str = (
        "allreduce"  # allgather's key/value gradients: allreduce | reduce | reduce-scatter
    )
    # Where a stage's tensors sit in its flat parameter array (layout.Layout): the sections
    # in order. GPT-3 (Megatron): a chunk's extra tensors (wte, wpe, ln_f) first, then its
    # layers; GPT-2 (config.stage_layout, whose offsets its plans' buckets name): wte, wpe,
    # the layers, ln_f last.
    param_order: tuple[str, ...] = ("wte", "wpe", "ln_f", "layers")  # EXTRAS_FIRST
    # FSDP / ZeRO-3 (transformer/fsdp.py): the shard group's size, dp for --fsdp, N for
    # --fsdp-shard-size N (HSDP: replicated over dp / N groups); 0: off.
    fsdp: int = 0
    # Training (the runtime reads these, not the command line):
    lr: float = 1e-4
    weight_decay: float = 0.0
    seed: int = 0

    @property
    def zero(self) -> int:
        """The ZeRO stage: 1 with the zero1 sync (gpt2's --zero 1), else 0."""
        return 1 if self.sync == "zero1" else 0

    @property
    def N(self) -> int:
        return self.B * self.T

    @property
    def Tc(self) -> int:
        """Tokens of the sequence each context-parallel rank holds: T / cp."""
        return self.T // self.cp

    @property
    def Nc(self) -> int:
        """Tokens of a micro-batch each context-parallel rank holds: B * T / cp."""
        return self.B * self.Tc

    @property
    def Ts(self) -> int:
        """Tokens of the sequence each rank holds between TP regions: T / cp / tp with
        sequence parallelism, else T / cp."""
        return self.Tc // self.tp if self.sp else self.Tc

    @property
    def Ns(self) -> int:
        """Tokens of a micro-batch each rank holds between TP regions, B * Ts: with MoE, the
        tokens it routes (its capacity counts them, as Megatron's drop-and-pad does)."""
        return self.B * self.Ts

    @property
    def act(self) -> int:
        """Elements of one pipeline message (activation or its gradient): B * Ts * C."""
        return self.B * self.Ts * self.cfg.n_embd

    def chunks(self, stage: int) -> list[Chunk]:
        last = self.v * self.pp - 1
        out = []
        for c in range(self.v):
            vs = c * self.pp + stage
            embed = vs == 0 and not self.layers_only
            head = vs == last and not self.layers_only
            out.append(Chunk(c, vs, self.split[vs], embed, head))
        return out


def padded_vocab(V: int, tp: int, multiple: int) -> int:
    """Megatron's padding: up to a multiple of `multiple` * tp (--make-vocab-size-divisible-by)."""
    step = multiple * tp
    return -(-V // step) * step
