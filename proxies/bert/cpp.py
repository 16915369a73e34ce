"""The C++ BERT-large proxy's iteration, message for message: `--model dnn-cpp-proxies`.

Source: spcl/DNN-cpp-proxies, bert_large.cpp (read for its sizes and order). One iteration
(its run_pipeline) of pipeline stage s, each step a blocking wait before the next:

- forward, micro-batch i = 0 .. M-1 (M = 8 by default): stage 0 sends to stage 1, the last
  stage receives from its predecessor, a middle stage does both at once (send to s+1 and
  receive from s-1 for the same i, then wait for both); backward the mirror image;
- if the data-parallel group has more than one rank: one blocking allreduce per gradient
  tensor of the stage, in the order its arrays list them (below).

The activation P2PSIZE is 1,049,600 floats, commented "micro-batch size=8 and
seq_length=128": that is 8 x 128 x 1,025 = B T (C + 1), the hidden states (B T C =
1,048,576) plus one float per token (as an attention mask would be; it is also C^2 + C).

Gradient tensors (C = 1024 hidden, V = 30,522, P = 512 positions; sizes only in the source,
the names here are BERT's tensors of those sizes):
- a layer, 16 tensors = 12C^2 + 13C = 12,596,224: q, k, v, attention-out weights (C^2 each),
  intermediate and output weights (4C^2 each), six of C (q, k, v, attention-out biases,
  LayerNorm 1), the intermediate bias (4C), three of C (output bias, LayerNorm 2);
- the first stage's first layer, 21: word (VC), position (PC) and token-type (2C)
  embeddings, then the layer's with the embedding LayerNorm's two C among the C's
  (44,379,136 in all);
- the last stage's last layer, 26: the layer's six weights, then the pooler and MLM
  transform dense weights (C^2 each), the decoder (VC, an untied copy: there is no
  embedding allreduce), the next-sentence classifier (2C), six C, 4C, four C, the MLM
  output bias (V), three C and the classifier bias (2): 45,984,572 in all.

It computes and sleeps nothing, so neither does this mode (--compute none only).

Not copied: the C++ proxy gives every stage LAYERS // STAGES layers and drops the rest;
here every layer is kept (the first LAYERS % STAGES stages take one more), as the gpt2
proxy's C++ schedule does. With one stage it would send to a rank that does not exist:
refused here (STAGES >= 2).
"""

from __future__ import annotations

from collections.abc import Sequence

from proxies.core.pipeline import BACKWARD, FORWARD, p2p_batch, p2p_tag
from proxies.core.plan import Collective, Msg, Op, Span
from proxies.transformer.encoder import BertConfig

PRESET = "dnn-cpp-proxies"
WIDTHS = "bert-large"  # C = 1024, 16 heads, V = 30,522, 512 positions
LAYERS, STAGES, MICRO_BATCHES, B, T = 24, 4, 8, 8, 128


def activation(C: int, B: int = B, T: int = T) -> int:
    """The C++ proxy's P2PSIZE: B T (C + 1) = 1,049,600 at its sizes."""
    return B * T * (C + 1)


def layer_sizes(C: int) -> list[int]:
    """One layer's 16 gradient tensors in the C++ order (intermediate_layer_grad_sizes)."""
    return [C * C] * 4 + [4 * C * C] * 2 + [C] * 6 + [4 * C] + [C] * 3


def first_layer_sizes(cfg: BertConfig) -> list[int]:
    """The first stage's first layer with the embeddings (first_layer_grad_sizes)."""
    C, V, P = cfg.n_embd, cfg.vocab_size, cfg.max_seq_len
    return [V * C, P * C, 2 * C] + [C * C] * 4 + [4 * C * C] * 2 + [C] * 8 + [4 * C] + [C] * 3


def last_layer_sizes(cfg: BertConfig) -> list[int]:
    """The last stage's last layer with the pooler, MLM and next-sentence heads
    (end_layer_grad_sizes)."""
    C, V = cfg.n_embd, cfg.vocab_size
    return (
        [C * C] * 4
        + [4 * C * C] * 2
        + [C * C] * 2
        + [V * C, 2 * C]
        + [C] * 6
        + [4 * C]
        + [C] * 4
        + [V]
        + [C] * 3
        + [2]
    )


def stage_sizes(cfg: BertConfig, n_layers: int, first: bool, last: bool) -> list[int]:
    """A stage's allreduce counts in order: its first layer's (the embeddings' on stage 0),
    the middle ones, its last layer's (the heads' on the last stage)."""
    C = cfg.n_embd
    if first and last:
        raise ValueError("the C++ BERT proxy needs at least two stages")
    if first:
        return first_layer_sizes(cfg) + layer_sizes(C) * (n_layers - 1)
    if last:
        return layer_sizes(C) * (n_layers - 1) + last_layer_sizes(cfg)
    return layer_sizes(C) * n_layers


def cpp_ops(
    cfg: BertConfig,
    layers: range,
    m: int,
    dp: int,
    stage: int,
    pp_ranks: Sequence[int],
    B: int = B,
    T: int = T,
) -> list[Op]:
    """One iteration of one rank, as run_pipeline in bert_large.cpp (module docstring).
    Buffers "cpp_act" (sent) and "cpp_recv" per micro-batch; Span("grads", lo, hi) for the
    allreduces: consecutive ranges of the stage's gradients."""
    pp = len(pp_ranks)
    act = activation(cfg.n_embd, B, T)  # --micro-batch, --seq-len (default 8, 128)
    ops: list[Op] = []
    nxt, prev = (pp_ranks[stage + d] if 0 <= stage + d < pp else None for d in (1, -1))
    for direction, way, to, frm in (
        (FORWARD, "forward", nxt, prev),
        (BACKWARD, "backward", prev, nxt),
    ):
        for i in range(m):
            tag = p2p_tag(direction, 0, i, 1)
            sends = [(f"send_{way}", Msg(to, tag, "cpp_act", i, act))] if to is not None else []
            recvs = [(f"recv_{way}", Msg(frm, tag, "cpp_recv", i, act))] if frm is not None else []
            ops.append(p2p_batch(sends, recvs))
    if dp > 1:
        lo = 0
        for count in stage_sizes(cfg, len(layers), stage == 0, stage == pp - 1):
            ops.append(Collective("allreduce", "dp", Span("grads", lo, lo + count), count))
            lo += count
    return ops
