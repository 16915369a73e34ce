"""GPT-2 in PyTorch eager, the reference the NumPy model (StageShard) is timed and checked against.

Letters as in config.py: B batch, T time, C channels, NH heads, hs = C / NH, V vocabulary.
The same math as proxies/transformer/kernels.py: layernorm eps 1e-5, GELU with the tanh
approximation, causal attention with q, k, v side by side in c_attn's output, the LM head
tied to wte, loss = mean cross-entropy over B*T. Parameters are named as StageShard.w
(nanoGPT / the HF checkpoint), weights (OC, C) with out = x @ W.T, so `from_stage` copies
them one to one. Written for speed in eager mode: F.linear, F.layer_norm and
F.scaled_dot_product_attention (PyTorch's fused CPU attention), no torch.compile.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from proxies.transformer.config import GPT2Config, layer_shapes
from proxies.transformer.kernels import LN_EPS


class GPT2(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        C = cfg.n_embd
        self.wte = nn.Parameter(torch.empty(cfg.vocab_size, C))
        self.wpe = nn.Parameter(torch.empty(cfg.max_seq_len, C))
        # "h.0.ln_1.weight" -> "h_0_ln_1_weight": nn.Module names cannot hold dots
        for l in range(cfg.n_layer):
            for n, shape in layer_shapes(C).items():
                self.register_parameter(_attr(f"h.{l}.{n}"), nn.Parameter(torch.empty(shape)))
        self.ln_f_weight = nn.Parameter(torch.empty(C))
        self.ln_f_bias = nn.Parameter(torch.empty(C))
        self.h = [  # per layer {"ln_1.weight": parameter, ...}: plain dicts, not submodules
            {n: getattr(self, _attr(f"h.{l}.{n}")) for n in layer_shapes(1)}
            for l in range(cfg.n_layer)
        ]

    def named(self) -> dict[str, nn.Parameter]:
        """Parameters under StageShard's names ("h.0.attn.c_attn.weight", ...)."""
        names = ["wte", "wpe"]
        names += [f"h.{l}.{n}" for l in range(self.cfg.n_layer) for n in layer_shapes(1)]
        names += ["ln_f.weight", "ln_f.bias"]
        return {n: getattr(self, _attr(n)) for n in names}

    @classmethod
    def from_stage(cls, model) -> GPT2:
        """A copy of a whole-model StageShard's parameters (float32)."""
        ref = cls(model.S.cfg)
        with torch.no_grad():
            for name, p in ref.named().items():
                p.copy_(torch.from_numpy(np.ascontiguousarray(model.w[name])))
        return ref

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """tokens, targets (B,T) int64 -> mean cross-entropy."""
        cfg, T = self.cfg, tokens.shape[1]
        C, NH = cfg.n_embd, cfg.n_head
        x = F.embedding(tokens, self.wte) + self.wpe[:T]  # (B,T,C)
        for w in self.h:
            h = F.layer_norm(x, (C,), w["ln_1.weight"], w["ln_1.bias"], LN_EPS)
            qkv = F.linear(h, w["attn.c_attn.weight"], w["attn.c_attn.bias"])  # (B,T,3C)
            q, k, v = qkv.view(*qkv.shape[:2], 3, NH, C // NH).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B,NH,T,hs)
            y = y.transpose(1, 2).reshape(x.shape)
            x = x + F.linear(y, w["attn.c_proj.weight"], w["attn.c_proj.bias"])
            h = F.layer_norm(x, (C,), w["ln_2.weight"], w["ln_2.bias"], LN_EPS)
            h = F.gelu(F.linear(h, w["mlp.c_fc.weight"], w["mlp.c_fc.bias"]), approximate="tanh")
            x = x + F.linear(h, w["mlp.c_proj.weight"], w["mlp.c_proj.bias"])
        x = F.layer_norm(x, (C,), self.ln_f_weight, self.ln_f_bias, LN_EPS)
        logits = F.linear(x, self.wte)  # (B,T,V), the tied LM head
        return F.cross_entropy(logits.view(-1, cfg.vocab_size), targets.reshape(-1))


def _attr(name: str) -> str:
    return name.replace(".", "_")


def adamw(model: GPT2, lr: float, fused: bool = True) -> torch.optim.Optimizer:
    """AdamW as StageShard.step: beta1 0.9, beta2 0.999, eps 1e-8, no weight decay.

    fused=True: one C++ loop over every tensor, PyTorch's fastest CPU AdamW; False: what
    torch.optim.AdamW gives without flags (on the CPU a per-tensor loop of tensor ops)."""
    kwargs = {"fused": True} if fused else {}
    return torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, **kwargs
    )
