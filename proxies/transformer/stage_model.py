"""The GPT-2 layers one pipeline stage holds: flat parameters, forward, backward, AdamW.

Letters as in config.py: B batch (micro-batch), T time, C channels, NH heads, V vocabulary,
L layers. A whole single-process model is StageModel(cfg, range(cfg.n_layer), True, True, B, T).

Parameters live in one flat array (and gradients in another of the same layout) so that a
data-parallel allreduce is one call on `grads`. The first stage holds wte and wpe, the last
ln_f and the LM head, which is the tied wte: with more than one stage, wte exists on both and
the caller sums grads[wte_slice] between them before the optimizer step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from proxies.transformer import fast, kernels
from proxies.transformer.config import (
    LAYER_TENSORS,
    GPT2Config,
    layout_size,
    normal,
    stage_layout,
)

# The kernels a StageModel runs: the fast ones, or the reference ones (tests compare them).
KERNELS = {"fast": fast, "plain": kernels}


@dataclass
class LayerActs:
    """What one layer's forward saves for its backward; inp is the previous layer's res3."""

    inp: np.ndarray  # (B,T,C) layer input (a view of another buffer, never written here)
    ln1: np.ndarray  # (B,T,C)
    ln1_mean: np.ndarray  # (B,T)
    ln1_rstd: np.ndarray  # (B,T)
    qkv: np.ndarray  # (B,T,3C)
    att: np.ndarray  # (B,NH,T,T) softmax
    atty: np.ndarray  # (B,T,C) attention output before c_proj
    res2: np.ndarray  # (B,T,C) inp + attention branch
    ln2: np.ndarray  # (B,T,C)
    ln2_mean: np.ndarray  # (B,T)
    ln2_rstd: np.ndarray  # (B,T)
    fch: np.ndarray  # (B,T,4C)
    fch_gelu: np.ndarray  # (B,T,4C)
    res3: np.ndarray  # (B,T,C) res2 + MLP branch: the layer output


@dataclass
class StageActs:
    """One micro-batch's saved state on this stage; buffers are pooled and reused."""

    inp: np.ndarray  # (B,T,C) stage input: the encoder output, or a copy of the received x
    layers: list[LayerActs]
    tokens: np.ndarray | None = None  # (B,T) first stage
    targets: np.ndarray | None = None  # (B,T) last stage
    lnf: np.ndarray | None = None  # (B,T,C) last stage, and its mean, rstd (B,T)
    lnf_mean: np.ndarray | None = None
    lnf_rstd: np.ndarray | None = None
    lse: np.ndarray | None = None  # (B,T) log-sum-exp of the logits
    dlogits: np.ndarray | None = None  # (B*T,V) last stage, fast kernels within budget
    loss_scale: float = 1.0
    dres: np.ndarray | None = None  # (B,T,C) residual-stream gradient between backward pieces
    next_piece: int = 0  # the backward piece to run next
    fresh: bool = False  # its backward writes the gradients instead of adding to them
    out: np.ndarray = field(init=False)  # (B,T,C) stage output, a view of the last buffer

    def __post_init__(self) -> None:
        self.out = self.layers[-1].res3 if self.layers else self.inp


class StageModel:
    """GPT-2 layers `layers` (global indices), plus embeddings if `first`, ln_f + head if `last`."""

    def __init__(
        self,
        cfg: GPT2Config,
        layers: range,
        first: bool,
        last: bool,
        B: int,
        T: int,
        seed: int = 0,
        dtype=np.float32,
        kernels: str = "fast",
    ) -> None:
        if B <= 0 or not 0 < T <= cfg.max_seq_len:
            raise ValueError(
                f"need B > 0 and 0 < T <= max_seq_len = {cfg.max_seq_len}, got B={B} T={T}"
            )
        if len(layers) and not (0 <= layers[0] and layers[-1] < cfg.n_layer):
            raise ValueError(f"layers {layers} outside 0..{cfg.n_layer - 1}")
        self.cfg, self.layers, self.first, self.last = cfg, layers, first, last
        self.B, self.T, self.seed, self.dtype = B, T, seed, np.dtype(dtype)
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {sorted(KERNELS)}, got {kernels!r}")
        self.k = KERNELS[kernels]
        # The classifier leaves dlogits (B*T, V) for the backward when they fit.
        self.save_dlogits = (
            last and B * T * cfg.vocab_size * self.dtype.itemsize <= fast.DLOGITS_BUDGET
        )
        # The next backward writes every gradient instead of adding to it, so zero_grad()
        # need not pass over them.
        self._overwrite = True
        C, V = cfg.n_embd, cfg.vocab_size

        self.layout = stage_layout(cfg, layers, first, last)
        assert len(layers) * cfg.layer_params == sum(
            math.prod(s) for n, s, _ in self.layout if n.startswith("h.")
        )
        offset = layout_size(self.layout)
        self.num_params = offset
        self.params = np.zeros(offset, dtype=self.dtype)
        self.grads = np.zeros(offset, dtype=self.dtype)
        self.views = self._views(self.params)
        self.grad_views = self._views(self.grads)
        self.wte_slice = slice(0, V * C) if first or last else None
        # per layer: {"ln_1.weight": view, ...} without the "h.{l}." prefix
        self._layer_views = {
            l: {n: self.views[f"h.{l}.{n}"] for n in LAYER_TENSORS} for l in layers
        }
        self._layer_grads = {
            l: {n: self.grad_views[f"h.{l}.{n}"] for n in LAYER_TENSORS} for l in layers
        }
        self._init_params()

        self.m: np.ndarray | None = None  # AdamW moments, allocated on the first step
        self.v: np.ndarray | None = None
        self.t = 0
        self._saved: dict[int, StageActs] = {}  # micro-batches in flight
        self._pool: list[StageActs] = []  # freed saved states, reused by later forwards
        self._scratch: dict[str, np.ndarray] | None = None  # backward's per-layer gradients
        # backward pieces in order: (name, index into self.layers for "h.{l}", else -1)
        self._pieces = (
            ([("head", -1)] if last else [])
            + [(f"h.{layers[k]}", k) for k in reversed(range(len(layers)))]
            + ([("embed", -1)] if first else [])
        )

    def _views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        return {n: flat[o : o + math.prod(s)].reshape(s) for n, s, o in self.layout}

    def _init_params(self) -> None:
        """GPT-2 init from (seed, global tensor) only, so every pipeline split starts equal.

        Weights N(0, 0.02), the residual projections N(0, 0.02 / sqrt(2 L)), biases 0,
        layernorm weights 1. Drawn in float64, then cast: float32 and float64 agree.
        """
        cfg, w = self.cfg, self.views
        if "wte" in w:
            normal(w["wte"], np.random.default_rng([self.seed, 0, 0]), 0.02)
        if "wpe" in w:
            normal(w["wpe"], np.random.default_rng([self.seed, 0, 1]), 0.02)
        proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        for l in self.layers:
            rng = np.random.default_rng([self.seed, 1, l])
            for n in LAYER_TENSORS:
                p = w[f"h.{l}.{n}"]
                if n.startswith("ln_") and n.endswith("weight"):
                    p.fill(1.0)
                elif n.endswith("weight"):
                    normal(p, rng, proj_std if n.endswith("c_proj.weight") else 0.02)
        if self.last:
            w["ln_f.weight"].fill(1.0)

    # ------------------------------------------------------------------------------------
    # activations

    def _alloc_acts(self) -> StageActs:
        B, T, C, NH = self.B, self.T, self.cfg.n_embd, self.cfg.n_head

        def e(*shape: int) -> np.ndarray:
            return np.empty(shape, dtype=self.dtype)

        inp = e(B, T, C)
        layers: list[LayerActs] = []
        for _ in self.layers:
            layers.append(
                LayerActs(
                    inp=layers[-1].res3 if layers else inp,
                    ln1=e(B, T, C),
                    ln1_mean=e(B, T),
                    ln1_rstd=e(B, T),
                    qkv=e(B, T, 3 * C),
                    att=e(B, NH, T, T),
                    atty=e(B, T, C),
                    res2=e(B, T, C),
                    ln2=e(B, T, C),
                    ln2_mean=e(B, T),
                    ln2_rstd=e(B, T),
                    fch=e(B, T, 4 * C),
                    fch_gelu=e(B, T, 4 * C),
                    res3=e(B, T, C),
                )
            )
        a = StageActs(inp, layers)
        if self.first:
            a.tokens = np.empty((B, T), dtype=np.int64)
        if self.last:
            a.targets = np.empty((B, T), dtype=np.int64)
            a.lnf, a.lnf_mean, a.lnf_rstd, a.lse = e(B, T, C), e(B, T), e(B, T), e(B, T)
            if self.save_dlogits:
                a.dlogits = e(B * T, self.cfg.vocab_size)
        return a

    def _get_scratch(self) -> dict[str, np.ndarray]:
        if self._scratch is None:
            B, T, C = self.B, self.T, self.cfg.n_embd
            shapes = {"dln": C, "datty": C, "dqkv": 3 * C, "dfch": 4 * C, "dfch_gelu": 4 * C}
            self._scratch = {k: np.empty((B, T, n), dtype=self.dtype) for k, n in shapes.items()}
        return self._scratch

    # ------------------------------------------------------------------------------------
    # forward

    def forward(
        self, mb: int, x: np.ndarray, targets: np.ndarray | None = None, loss_scale: float = 1.0
    ) -> np.ndarray | float:
        """Forward of micro-batch `mb`; saves what backward(mb) needs.

        x: tokens (B,T) int on the first stage, else the activation (B,T,C) from the previous
        stage (copied, so the caller may reuse its buffer). Returns the output activation
        (B,T,C), a buffer valid until backward(mb) or free(mb); on the last stage instead the
        mean cross-entropy over B*T against targets (B,T), and backward will compute the
        gradient of loss_scale * loss.
        """
        if mb in self._saved:
            raise ValueError(f"micro-batch {mb} is already in flight on this stage")
        B, T, C = self.B, self.T, self.cfg.n_embd
        _expect("tokens" if self.first else "activation", x, (B, T) if self.first else (B, T, C))
        if self.last:
            _expect("targets", targets, (B, T))
        w = self.views
        a = self._pool.pop() if self._pool else self._alloc_acts()
        if self.first:
            a.tokens[...] = x
            self.k.encoder_forward(a.inp, a.tokens, w["wte"], w["wpe"])
        else:
            a.inp[...] = x
        for l, la in zip(self.layers, a.layers, strict=True):
            self._layer_forward(l, la)
        if not self.last:
            self._saved[mb] = a
            return a.out
        a.targets[...] = targets
        a.loss_scale = float(loss_scale)
        self.k.layernorm_forward(
            a.lnf, a.lnf_mean, a.lnf_rstd, a.out, w["ln_f.weight"], w["ln_f.bias"]
        )
        loss = self.k.classifier_forward(a.lse, a.lnf, w["wte"], a.targets, a.dlogits, a.loss_scale)
        self._saved[mb] = a  # only now: a forward that raised leaves nothing in flight
        return loss

    def _layer_forward(self, l: int, a: LayerActs) -> None:
        w, NH = self._layer_views[l], self.cfg.n_head
        proj = a.res3  # holds each branch's projection until the residual add overwrites it
        self.k.layernorm_forward(
            a.ln1, a.ln1_mean, a.ln1_rstd, a.inp, w["ln_1.weight"], w["ln_1.bias"]
        )
        self.k.matmul_forward(a.qkv, a.ln1, w["attn.c_attn.weight"], w["attn.c_attn.bias"])
        self.k.attention_forward(a.atty, a.att, a.qkv, NH)
        self.k.matmul_forward(proj, a.atty, w["attn.c_proj.weight"], w["attn.c_proj.bias"])
        self.k.residual_forward(a.res2, a.inp, proj)
        self.k.layernorm_forward(
            a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, w["ln_2.weight"], w["ln_2.bias"]
        )
        self.k.matmul_forward(a.fch, a.ln2, w["mlp.c_fc.weight"], w["mlp.c_fc.bias"])
        self.k.gelu_forward(a.fch_gelu, a.fch)
        self.k.matmul_forward(proj, a.fch_gelu, w["mlp.c_proj.weight"], w["mlp.c_proj.bias"])
        self.k.residual_forward(a.res3, a.res2, proj)

    # ------------------------------------------------------------------------------------
    # backward

    def pieces(self) -> tuple[str, ...]:
        """The backward's pieces in order: "head" (last stage: LM head + ln_f), "h.{l}" for
        each layer from the last, "embed" (first stage: the encoder). After a piece, the
        gradients of config.backward_pieces' ranges for it are complete."""
        return tuple(name for name, _ in self._pieces)

    def backward(self, mb: int, dout: np.ndarray | None = None) -> np.ndarray | None:
        """Backward of micro-batch `mb`: accumulates into grads and frees mb's saved state.

        dout (B,T,C) is the gradient w.r.t. this stage's output (None on the last stage).
        Returns the gradient w.r.t. the stage input (B,T,C), a new array the caller owns, or
        None on the first stage.
        """
        if not self._pieces:  # a stage of no layers, neither first nor last: the identity
            self._check_piece(mb, 0, dout)
            self._pool.append(self._saved.pop(mb))
            return np.array(dout, dtype=self.dtype)
        for i in range(len(self._pieces)):
            din = self.backward_piece(mb, i, dout if i == 0 else None)
        return din

    def backward_piece(self, mb: int, i: int, dout: np.ndarray | None = None) -> np.ndarray | None:
        """Piece i of pieces() of micro-batch mb's backward; pieces run in order, and together
        they are backward(mb, dout). Piece 0 takes dout (None on the last stage). The last
        piece frees mb's saved state and returns backward's result; the others None."""
        a = self._check_piece(mb, i, dout)
        w, g = self.views, self.grad_views
        if i == 0:  # the gradient of the residual stream, carried from piece to piece
            a.fresh, self._overwrite = self._overwrite, False
            a.dres = np.zeros((self.B, self.T, self.cfg.n_embd), dtype=self.dtype)
            if not self.last:
                a.dres[...] = dout
        dres = a.dres
        name, k = self._pieces[i]
        if name == "head":
            dlnf = self._get_scratch()["dln"]
            if self.save_dlogits:
                self.k.classifier_backward_saved(
                    dlnf, g["wte"], a.lnf, w["wte"], a.dlogits, dinp_fresh=True, fresh=a.fresh
                )
            else:
                self.k.classifier_backward(
                    dlnf,
                    g["wte"],
                    a.lnf,
                    w["wte"],
                    a.targets,
                    a.lse,
                    a.loss_scale,
                    dinp_fresh=True,
                    fresh=a.fresh,
                )
            wn, bn = "ln_f.weight", "ln_f.bias"
            self.k.layernorm_backward(
                dres, g[wn], g[bn], dlnf, a.out, w[wn], a.lnf_mean, a.lnf_rstd, a.fresh
            )
        elif name == "embed":
            # fresh: wpe's gradient is written; wte's too unless the head wrote it already
            self.k.encoder_backward(
                g["wte"],
                g["wpe"],
                dres,
                a.tokens,
                fresh=a.fresh,
                dwte_fresh=a.fresh and not self.last,
            )
        else:
            self._layer_backward(self.layers[k], a.layers[k], dres, a.fresh)
        a.next_piece = i + 1
        if a.next_piece < len(self._pieces):
            return None
        del self._saved[mb]
        a.dres, a.next_piece = None, 0
        self._pool.append(a)
        return None if self.first else dres

    def _check_piece(self, mb: int, i: int, dout: np.ndarray | None) -> StageActs:
        a = self._saved.get(mb)
        if a is None:
            raise ValueError(f"micro-batch {mb} has no forward in flight on this stage")
        if i != a.next_piece:
            raise ValueError(f"micro-batch {mb}: backward piece {i}, expected {a.next_piece}")
        if i == 0 and not self.last:
            _expect("gradient", dout, (self.B, self.T, self.cfg.n_embd))
        return a

    def _layer_backward(self, l: int, a: LayerActs, dres: np.ndarray, fresh: bool) -> None:
        """dres holds dL/d(res3) on entry and dL/d(inp) on exit; fresh: the layer's
        gradients hold zeros (written instead of added to).

        A residual add passes its gradient unchanged to both branches, so dres itself is
        each branch's dout and the branch's layernorm_backward adds into it: residual_backward
        without the copies.
        """
        w, g, NH, k = self._layer_views[l], self._layer_grads[l], self.cfg.n_head, self.k
        s = self._get_scratch()
        # MLP branch: dres = dL/d(res3) -> dL/d(res2); scratch input gradients are written
        wn = "mlp.c_proj.weight"
        k.matmul_backward(
            s["dfch_gelu"], g[wn], g["mlp.c_proj.bias"], dres, a.fch_gelu, w[wn], True, fresh
        )
        k.gelu_backward(s["dfch"], a.fch, s["dfch_gelu"], fresh=True)
        wn = "mlp.c_fc.weight"
        k.matmul_backward(s["dln"], g[wn], g["mlp.c_fc.bias"], s["dfch"], a.ln2, w[wn], True, fresh)
        wn, bn = "ln_2.weight", "ln_2.bias"
        k.layernorm_backward(
            dres, g[wn], g[bn], s["dln"], a.res2, w[wn], a.ln2_mean, a.ln2_rstd, fresh
        )
        # attention branch: dres = dL/d(res2) -> dL/d(inp)
        wn = "attn.c_proj.weight"
        k.matmul_backward(
            s["datty"], g[wn], g["attn.c_proj.bias"], dres, a.atty, w[wn], True, fresh
        )
        k.attention_backward(s["dqkv"], s["datty"], a.qkv, a.att, NH, fresh=True)
        wn = "attn.c_attn.weight"
        k.matmul_backward(
            s["dln"], g[wn], g["attn.c_attn.bias"], s["dqkv"], a.ln1, w[wn], True, fresh
        )
        wn, bn = "ln_1.weight", "ln_1.bias"
        k.layernorm_backward(
            dres, g[wn], g[bn], s["dln"], a.inp, w[wn], a.ln1_mean, a.ln1_rstd, fresh
        )

    def free(self, mb: int) -> None:
        """Drop mb's saved state without a backward (evaluation-only forwards)."""
        self._pool.append(self._saved.pop(mb))

    # ------------------------------------------------------------------------------------
    # optimizer and FLOPs

    def zero_grad(self) -> None:
        """Gradients to zero, without a pass over them: the next backward writes them
        instead of adding to them (they read as stale values until it runs; only backward
        writes into grads before the caller's allreduces)."""
        self._overwrite = True

    def step(self, lr: float, weight_decay: float = 0.0) -> None:
        """One AdamW step (beta1 0.9, beta2 0.999, eps 1e-8) over the whole flat buffer."""
        if self.m is None:
            self.m = np.zeros_like(self.params)
            self.v = np.zeros_like(self.params)
        self.t += 1
        args = (self.params, self.grads, self.m, self.v, self.t, lr)
        self.k.adamw_update(*args, weight_decay=weight_decay)

    def flops_forward(self) -> float:
        """Forward FLOPs of one micro-batch: 2 * multiply-adds of every matmul.

        Per layer 2*B*T*12C^2 (qkv 3C^2, proj C^2, fc 4C^2, fcproj 4C^2) plus attention's
        QK^T and AV over the full T x T square as computed, 2 * 2*B*T*T*C; on the last stage
        the LM head 2*B*T*C*V. Layernorm, GELU, softmax and the embeddings are not counted.
        """
        B, T, C, V = self.B, self.T, self.cfg.n_embd, self.cfg.vocab_size
        flops = len(self.layers) * (2.0 * B * T * 12 * C * C + 4.0 * B * T * T * C)
        if self.last:
            flops += 2.0 * B * T * C * V
        return flops

    def flops_backward(self) -> float:
        """Backward FLOPs of one micro-batch: twice the forward (gradients of input and weight)."""
        return 2.0 * self.flops_forward()


def _expect(what: str, x: np.ndarray | None, shape: tuple[int, ...]) -> None:
    if x is None or np.shape(x) != shape:
        raise ValueError(
            f"{what} must have shape {shape}, got {None if x is None else np.shape(x)}"
        )
