"""What a GPT front end prints and records about its run, written once from the resolved
`Setup`: the three header lines and the JSON config dict. Each front end passes in only
what is its own (gpt2: the gradient-sync text of its schedules; gpt3: tensor parallelism's
messages and MoE); the run options every proxy shares (compute, iterations, data, learning
rate ...) are read from the parsed command line, which core/cli.py owns."""

from __future__ import annotations

from argparse import Namespace

from proxies.core.grid import ProcessGrid
from proxies.core.tables import si_count
from proxies.transformer.setup import Setup


def layers_per_stage(S: Setup) -> list[int]:
    return [sum(len(ch.layers) for ch in S.chunks(s)) for s in range(S.pp)]


def data_text(args: Namespace, source) -> str:
    """The token source as the header names it: synthetic or the file, or none (gpt2's C++
    schedule trains nothing; a dry run does not open the file)."""
    return source.describe() if source is not None else args.data or "none"


def header(
    prog: str,
    S: Setup,
    grid: ProcessGrid,
    args: Namespace,
    source,
    *,
    model_extra: str = "",
    messages: str,
) -> list[str]:
    """Model, grid and messages lines. `model_extra` ends the model line (gpt3's MoE);
    `messages` sits between the pipeline message and the data source."""
    cfg = S.cfg
    V, n = cfg.vocab_size, cfg.num_params
    per = sorted(set(layers_per_stage(S)))
    return [
        f"[bold]{prog}[/] · {S.model} (C={cfg.n_embd}, {cfg.n_head} heads, V={V}"
        + (f" padded to {S.vocab}" if S.vocab != V else "")
        + f") · {cfg.n_layer} layers = {n:,} parameters ({si_count(n)})"
        + model_extra,
        f"grid: tp {S.tp} x pp {S.pp} x dp {S.dp} (order {grid.order}) · layers per stage "
        + "-".join(map(str, per))
        + (f" in {S.v} chunks" if S.v > 1 else "")
        + f" · schedule {S.schedule} · {S.m} micro-batches of {S.B} x {S.T} tokens (global "
        f"batch {S.B * S.m * S.dp} samples)" + (" · sequence parallel" if S.sp else ""),
        f"messages: pipeline {S.act:,} floats ({4 * S.act:,} B) · {messages} · data: "
        f"{data_text(args, source)} · iterations {args.warmup} warm-up + {args.iters} timed"
        + (" · layers only" if S.layers_only else ""),
    ]


def config(S: Setup, grid: ProcessGrid, args: Namespace, own: dict, *, data: str) -> dict:
    """The JSON config: the keys both front ends share, the front end's `own` keys (its
    parallelism and gradient options), then the run options. `data`: the source's name
    without --data."""
    cfg = S.cfg
    return {
        "model": S.model,
        "layers": cfg.n_layer,
        "stages": S.pp,
        "dp": S.dp,
        "micro_batches": S.m,
        "micro_batch": S.B,
        "seq_len": S.T,
        "n_embd": cfg.n_embd,
        "n_head": cfg.n_head,
        "vocab_size": cfg.vocab_size,
        "params": cfg.num_params,
        "schedule": S.schedule,
        "order": grid.order,
        "global_batch": S.B * S.m * S.dp,
        **own,
        "compute": args.compute,
        "device_tflops": args.device_tflops,
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "seed": args.seed,
        "iters": args.iters,
        "warmup": args.warmup,
        "data": args.data or data,
        "check": args.check,
        "allreduce": args.allreduce,
        "layers_per_stage": layers_per_stage(S),
    }
