"""Per-rank memory of the GPT-2 proxy, from the shapes its runtime allocates (core/memory.py
adds MPI's scratch, wire staging and the interpreter).

Real/replay compute (model.StageModel): the stage's flat parameters and gradients, AdamW's
m and v (of the ZeRO-1 shard only with --zero 1), one saved-activation set per micro-batch
in flight (the schedule's most forwards without their backward: 1f1b pp - stage, gpipe all
of them), the last stage's dlogits when the fast classifier keeps them, the backward's
scratch, and the pipeline's receive buffers (one per micro-batch, as GPT2Runtime.buffer
keeps them). Model/none compute: the gradient buffer (and parameters with --zero 1), one
buffer per pipeline message of the plan.
"""

from __future__ import annotations

from proxies.core import memory
from proxies.core.plan import Plan, block_range
from proxies.core.schedules import SCHEDULES
from proxies.transformer import fast
from proxies.transformer.config import GPT2Config, layout_size, stage_layout
from proxies.transformer.kernels import CLASSIFIER_CHUNK, _chunk_rows

F32 = 4


def saved_per_microbatch(cfg: GPT2Config, layers: range, first: bool, last: bool, B: int, T: int):
    """(activations, logits) bytes StageModel._alloc_acts allocates for one micro-batch."""
    C, NH, V = cfg.n_embd, cfg.n_head, cfg.vocab_size
    # per layer: ln1, atty, res2, ln2, res3 (C each), qkv 3C, fch and fch_gelu 4C each;
    # 4 (B,T) statistics; the (B,NH,T,T) softmax
    layer = B * T * 16 * C + 4 * B * T + B * NH * T * T
    acts = F32 * (B * T * C + len(layers) * layer)
    if first:
        acts += 8 * B * T  # tokens (int64)
    if last:
        acts += 8 * B * T + F32 * (B * T * C + 3 * B * T)  # targets; ln_f out, mean, rstd, lse
    logits = F32 * B * T * V if last and saves_dlogits(cfg, B, T) else 0
    return acts, logits


def saves_dlogits(cfg: GPT2Config, B: int, T: int) -> bool:
    return B * T * cfg.vocab_size * F32 <= fast.DLOGITS_BUDGET


def weight_temps(cfg: GPT2Config, layers: range, last: bool) -> int:
    """Elements of fast._add_at_b's kept temporaries: one per weight-gradient shape, at most
    fast._DW_ELEMS elements in whole rows."""
    C, V = cfg.n_embd, cfg.vocab_size
    shapes = {(3 * C, C), (C, C), (4 * C, C), (C, 4 * C)} if len(layers) else set()
    if last:
        shapes.add((V, C))
    return sum(min(M, max(1, fast._DW_ELEMS // N)) * N for M, N in shapes)


def estimate(
    cfg: GPT2Config,
    layers: range,
    stage: int,
    pp: int,
    dp: int,
    dp_rank: int,
    args,
    plan: Plan,
) -> dict[str, int]:
    """Bytes per part for one rank of stage `stage` under args.compute."""
    first, last = stage == 0, stage == pp - 1
    B, T, C, m = args.micro_batch, args.seq_len, cfg.n_embd, args.micro_batches
    n = layout_size(stage_layout(cfg, layers, first, last))
    zero = args.zero and dp > 1
    shard = block_range(n, dp, dp_rank) if zero else (0, n)
    moments = 2 * F32 * (shard[1] - shard[0])
    if args.compute not in ("real", "replay"):
        return memory.complete(
            {
                "parameters": F32 * n if args.zero else 0,
                "gradients": F32 * n,
                "optimizer": moments if zero else 0,
                "buffers": memory.p2p_buffers(plan),
            },
            plan,
        )
    schedule = SCHEDULES["gpipe" if args.schedule == "cpp" else args.schedule]
    live = memory.inflight(schedule(pp, m, stage))
    acts, logits = saved_per_microbatch(cfg, layers, first, last, B, T)
    # backward: the 13C per token of per-layer gradient scratch, the residual gradient, one
    # (B,NH,T,T) score gradient, the weight-gradient temporary (fast._add_at_b), and the
    # classifier's logits chunk when dlogits are not kept
    work = F32 * (14 * B * T * C + B * cfg.n_head * T * T + weight_temps(cfg, layers, last))
    if last and not logits:
        work += F32 * _chunk_rows(B * T, cfg.vocab_size, CLASSIFIER_CHUNK) * cfg.vocab_size
    return memory.complete(
        {
            "parameters": F32 * n,
            "gradients": F32 * n,
            "optimizer": moments,
            "activations": live * acts,
            "logits": live * logits,
            "workspace": work,
            "blas": memory.blas_workspace(),
            # received activations and gradients, and the input gradients sent back, one
            # per micro-batch (GPT2Runtime.bufs); the sent activations are the saved outputs
            "buffers": memory.p2p_buffers(plan, ("act_in", "grad_out", "grad_in")),
        },
        plan,
    )
