"""The LLaMA-3 / Mixtral proxy: GPT-3's front end (proxies/gpt3/proxy.py: its options,
rules and plans) on the LLaMA architecture (transformer/llama.py).

    python -m proxies.llama --model llama3-70b --dry-run --world-size 8192 --tp 8 --cp 2 80 8
    mpirun -n 64 python -m proxies.llama --model mixtral-8x7b --tp 2 --ep 8 32 4

What changes against GPT-3 (the plans, transformer/plan.py, read it from the config):
the qkv projection is (NH + 2 KVH) hs wide, so context parallelism exchanges 2 KVH hs / tp
key/value values per token; the MLP is SwiGLU (three C x F matmuls, experts' too); there
is no position embedding; the LM head is its own tensor (no embedding allreduce between
the first and last stage); its gradients (with ln_f's) are bucketed first in the backward.
The tensor-parallel collectives (B T C) and pipeline messages are GPT-3's.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from proxies.core import cli, runner
from proxies.gpt3 import proxy as gpt3
from proxies.llama import SPEC
from proxies.transformer import describe, options
from proxies.transformer.fsdp import fsdp_text
from proxies.transformer.llama import DEFAULT_MODEL, PRESETS, TINY
from proxies.transformer.plan import gpt3_plans
from proxies.transformer.setup import GPT2_ORDER, Setup

PROG = "proxies.llama"


def parser() -> cli.Parser:
    """GPT-3's options (tp, sp, pp, virtual stages, cp, MoE, buckets ...) with LLaMA's
    presets; --moe-experts defaults to the preset's (8 for Mixtral, else dense)."""
    p = gpt3.parser()
    p.prog = f"python -m {PROG}"
    p.description = (
        "LLaMA-3 / Mixtral training proxy: Megatron-LM's tensor (with sequence), pipeline, "
        "data, context and expert parallelism on the LLaMA architecture (RMSNorm, RoPE, "
        "grouped-query attention, SwiGLU, untied head), with its real message sizes. "
        "Arguments: LAYERS STAGES; DP = world size / (tp * cp * STAGES)."
    )
    # argparse has no public way to change an option's choices: the one action, found by
    # its destination.
    for action in p._actions:
        if action.dest == "model":
            action.choices, action.default = sorted(PRESETS), DEFAULT_MODEL
            action.help = (
                "preset (Meta Llama 3, Mistral Mixtral published configs); llama-tiny and "
                "mixtral-tiny (C=64, 4 heads, 2 kv heads) for tests"
            )
        elif action.dest == "compute":
            action.help = (
                "real: the NumPy LLaMA layer on this rank's shard; replay: each compute op "
                "timed once with it, then slept; model: sleep FLOPs / --device-tflops; none: "
                "communication only (default: real for llama-tiny and mixtral-tiny without "
                "--cp, model otherwise)"
            )
        elif action.dest == "moe_experts":
            action.default = None
            action.help = "experts per layer (default: the preset's, 8 for Mixtral, else dense)"
    return p


def resolve(args, world: int) -> tuple[Setup, object]:
    """GPT-3's rules, plus GQA's: tp (and with Ulysses tp x cp) divides the kv heads."""
    cfg = PRESETS[args.model]
    err = cli.UsageError
    kvh = cfg.kv_heads
    if kvh % args.tp:
        raise err(
            f"--tp {args.tp} does not divide {args.model}'s {kvh} key/value heads "
            "(Megatron shards the kv heads over tp)"
        )
    if args.cp > 1 and args.cp_comm == "alltoall" and (kvh // args.tp) % args.cp:
        raise err(
            f"--cp-comm alltoall splits the {kvh // args.tp} key/value heads per "
            f"tensor-parallel rank over --cp {args.cp}: it must divide them"
        )
    if args.moe_experts is None:
        args.moe_experts = cfg.experts
    if args.moe_experts:  # the parameter count follows the experts run
        cfg = replace(cfg, experts=args.moe_experts, ffn_dim=args.moe_ffn_hidden or cfg.ffn_dim)
    S, grid = gpt3.resolve(args, world, presets={args.model: cfg}, real=TINY)
    # wte first, the layers, then ln_f and the untied lm_head: backward order is descending
    # addresses, so a gradient bucket stays one range (layout.Layout)
    return replace(S, param_order=GPT2_ORDER), grid


def arch_text(S: Setup) -> str:
    cfg = S.cfg
    return (
        f" · GQA {cfg.kv_heads} kv heads, SwiGLU F={cfg.ffn_dim}, RoPE theta {cfg.rope_theta:g}"
        + gpt3.moe_text(S)
    )


def make_job(args, world: int) -> runner.Job:
    S, grid = resolve(args, world)
    plan = gpt3_plans(S, grid, S.schedule)
    source = options.token_source(args, S.cfg.vocab_size, S.T)

    own = gpt3.own_config(S) | {
        "kv_heads": S.cfg.kv_heads,
        "ffn_dim": S.cfg.ffn_dim,
        "rope_theta": S.cfg.rope_theta,
    }
    config = describe.config(S, grid, args, own, data="synthetic")
    header = describe.header(
        PROG,
        S,
        grid,
        args,
        source,
        model_extra=arch_text(S),
        messages=f"TP collectives {S.N * S.cfg.n_embd:,} floats per layer part"
        + (f" · {fsdp_text(S)}" if S.fsdp else ""),
    )
    groups = ("pp", "tp", "dp", "ep", "edp", *describe.cp_groups(S), "fsdp", "hsdp")
    return gpt3.transformer_job(
        PROG,
        SPEC,
        S,
        grid,
        args,
        plan=plan,
        runtime=gpt3.stage_runtime(S, grid, plan, source),
        config=config,
        header=header,
        groups=groups,
        grads=("dp_allreduce", "edp_allreduce"),
        hooks=gpt3.dry_run_hooks(S),
    )


def main(argv: list[str] | None = None) -> int:
    return runner.main(make_job, parser(), argv)


def entry() -> None:
    cli.run_main(PROG, main, sys.argv[1:])
