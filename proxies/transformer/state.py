"""What StageShard's forward keeps for its backward (model.py): typed, with every field's
shape. Letters as in config.py; Ts = T/tp under sequence parallelism, else T; Ns = B*Ts
tokens a rank routes (MoE); Vl = vocabulary rows a TP rank holds, `valid` of them real."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class LayerActs:
    """What one layer's forward keeps for its backward on this rank. Ts = T/tp under
    sequence parallelism, else T; Ns = B*Ts tokens routed (MoE)."""

    ln1: np.ndarray  # (B,Ts,C)
    ln1_mean: np.ndarray  # (B,Ts)
    ln1_rstd: np.ndarray  # (B,Ts)
    qkv: np.ndarray  # (B,T,3C/tp) q, k, v of the local heads
    att: np.ndarray  # (B,NH/tp,T,T) softmax
    atty: np.ndarray  # (B,T,C/tp) attention output before proj
    res2: np.ndarray  # (B,Ts,C) inp + attention branch
    ln2: np.ndarray  # (B,Ts,C)
    ln2_mean: np.ndarray  # (B,Ts)
    ln2_rstd: np.ndarray  # (B,Ts)
    res3: np.ndarray  # (B,Ts,C) res2 + MLP branch: the layer output
    fch: np.ndarray | None = None  # (B,T,4C/tp) dense MLP only
    fch_gelu: np.ndarray | None = None  # (B,T,4C/tp)
    inp: np.ndarray | None = None  # (B,Ts,C) a view of x0 or the layer below's res3
    # context parallelism (cpshard.py): the gathered k|v (B,T,2C/tp), the ring's kept block
    # (B,T/cp,2C/tp), or Ulysses' head-sharded qkv (B,T,3C/tp/cp); the ring's log-sum-exp
    kv: np.ndarray | None = None
    lse: np.ndarray | None = None  # (B,NH/tp,T/cp)
    # MoE (moe.py): this micro-batch's routing and what the experts keep
    scores: np.ndarray | None = None  # (Ns,k) softmax over the k chosen
    topk: np.ndarray | None = None  # (Ns,k) chosen experts
    kept: np.ndarray | None = None  # (kept,) choices within capacity, as j*Ns + t
    t_kept: np.ndarray | None = None  # (kept,) their token
    e_kept: np.ndarray | None = None  # (kept,) their expert
    slot_kept: np.ndarray | None = None  # (kept,) their slot
    ex: list = field(default_factory=list)  # per local expert (x, fch, gel): (rows,C|F/tp)
    eo: np.ndarray | None = None  # (kept,C) expert outputs of the kept choices


@dataclass
class ChunkActs:
    """One (micro-batch, chunk)'s saved state; pooled per chunk and reused."""

    x0: np.ndarray  # (B,Ts,C) chunk input: embedding or received activation
    dres: np.ndarray  # (B,Ts,C) residual-stream gradient, carried from piece to piece
    layers: dict[int, LayerActs]  # by global layer index
    tokens: np.ndarray | None = None  # (B,T) embedding chunk
    targets: np.ndarray | None = None  # (B,T) head chunk
    lnf: np.ndarray | None = None  # (B,Ts,C) head chunk
    lnf_mean: np.ndarray | None = None  # (B,Ts)
    lnf_rstd: np.ndarray | None = None  # (B,Ts)
    lse: np.ndarray | None = None  # (B,T) log-sum-exp over the whole vocabulary
    probs: np.ndarray | None = None  # (N,valid) exp(logits - mx) of this slice, if kept
    mx: np.ndarray | None = None  # (N,) this slice's max logit per token, if kept
    loss_scale: float = 1.0
    # Backward: st.dres is dL/d(input of layer `at`) (the chunk's top layer + 1: dL/d its
    # output), None before the backward starts (model.py's _bwd_settle).
    at: int | None = None
