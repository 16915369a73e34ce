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


def cp_groups(S: Setup) -> tuple[str, ...]:
    """The context-parallel group names a plan may use (communicators): "cp", and the
    per-root groups of --cp-grad-reduce reduce."""
    if S.cp == 1:
        return ()
    return ("cp", *(f"cp_r{i}" for i in range(S.cp)))


def cp_text(S: Setup) -> str:
    """The messages line's context-parallel part: what each layer exchanges over cp."""
    C, n = S.cfg.n_embd // S.tp, S.cp
    kv = S.B * S.Tc * 2 * C  # one rank's keys and values
    if S.cfg.kv_width != S.cfg.n_embd:  # grouped-query attention: KVH heads of k and v
        kv = S.B * S.Tc * 2 * S.cfg.kv_width // S.tp
    if S.cp_comm == "allgather":
        red = {
            "allreduce": "allreduce",
            "reduce": f"{n} reduces",
            "reduce-scatter": "reduce-scatter",
        }
        return (
            f" · cp allgather of k,v {n * kv:,} floats per layer, their gradients "
            f"{red[S.cp_reduce]} {(n * kv if S.cp_reduce != 'reduce' else kv):,}"
        )
    if S.cp_comm == "ring":
        return f" · cp ring {n - 1} x {kv:,} floats forward, {n} steps of k,v and dk,dv backward"
    qkv = S.Nc * S.cfg.qkv_rows // S.tp  # 3C/tp without grouped-query attention
    return f" · cp all-to-all {qkv:,} (qkv) and {S.Nc * C:,} (out) floats per layer"


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
        f"grid: tp {S.tp} x "
        + (f"cp {S.cp} ({S.cp_split}, {S.cp_comm}) x " if S.cp > 1 else "")
        + f"pp {S.pp} x dp {S.dp} (order {grid.order}) · layers per stage "
        + "-".join(map(str, per))
        + (f" in {S.v} chunks" if S.v > 1 else "")
        + f" · schedule {S.schedule} · {S.m} micro-batches of {S.B} x {S.T} tokens (global "
        f"batch {S.B * S.m * S.dp} samples)" + (" · sequence parallel" if S.sp else ""),
        f"messages: pipeline {S.act:,} floats ({4 * S.act:,} B) · {messages}"
        + (cp_text(S) if S.cp > 1 else "")
        + " · data: "
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
        "cp": S.cp,
        "cp_split": S.cp_split if S.cp > 1 else None,
        "cp_comm": S.cp_comm if S.cp > 1 else None,
        "cp_grad_reduce": S.cp_reduce if S.cp > 1 and S.cp_comm == "allgather" else None,
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
