"""The GPT-3 proxy: data x tensor x pipeline (x expert) parallelism, as Megatron-LM issues it.

    mpirun -n 64 python -m proxies.gpt3 96 8 --tp 4          # DP = 64 / (8 * 4) = 2
    mpirun -n 64 python -m proxies.gpt3 96 8 --tp 4 --moe-experts 8
    python -m proxies.gpt3 --dry-run --world-size 1536 --tp 8 96 16

One iteration of one rank: the pipeline schedule (proxies.core.schedules) over m
micro-batches; inside every forward and backward, per layer, the pieces of compute between
the tensor-parallel collectives (model.py): forward attention -> allreduce -> MLP ->
allreduce, backward the mirror image (allgather / reduce-scatter with sequence parallelism;
MoE: gate -> all-to-all dispatch -> experts -> all-to-all combine). During the last
micro-batch's backward, each gradient bucket is allreduced over the data-parallel group as
soon as its layers are done (Megatron's overlap_grad_reduce; expert gradients over the
expert-data-parallel group), then the tied embedding gradient between the first and last
stage, the sequence-parallel layernorm gradients over TP, and AdamW.

Memory (compute model/none): no parameters exist; every message lives in a pool of reusable
buffers: one per pipeline direction, one for all blocking collectives, and --inflight-buckets
(default 2) for the gradient buckets, which the plan never lets more of be in flight. A
rank needs about twice its largest message, not all its gradients: at most 2.64 GiB per rank
for the C++ proxy's 175B layout with DP (a layer shard's bucket is 1.8 GB), as --dry-run
prints.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from functools import lru_cache

import numpy as np

from proxies.core import cli, exits, faults, memory, provenance, report, runner
from proxies.core.grid import ProcessGrid
from proxies.core.pipeline import pipeline_ops
from proxies.core.plan import P2P, Collective, Compute, Plan, Wait
from proxies.core.schedules import SCHEDULES
from proxies.core.tables import si_count
from proxies.gpt2.proxy import split_layers
from proxies.gpt3 import SPEC
from proxies.gpt3.memory import estimate as estimate_memory
from proxies.transformer.data import DataError, Synthetic, TokenFile, batch
from proxies.transformer.layout import Layout, Unit
from proxies.transformer.setup import (
    DEFAULT_MODEL,
    PRESETS,
    MoESpec,
    Setup,
    cpp_device_tflops,
    padded_vocab,
)
from proxies.transformer.templates import Templates

PROG = "proxies.gpt3"
MAX_TAG_MICROBATCHES = 16383  # m * v: pipeline tags stay below 32768 (core/pipeline.py)
ORDERS = {"cpp": "pp-tp-ep-dp", "megatron": "tp-ep-dp-pp"}


def parser() -> argparse.ArgumentParser:
    p = cli.Parser(
        prog=f"python -m {PROG}",
        description="GPT-3 training proxy: Megatron-LM's tensor, pipeline and data "
        "parallelism (and expert parallelism for MoE) with its real message sizes, and "
        "compute that is real (NumPy, small presets), modelled (FLOPs / rate) or absent. "
        "Arguments as the C++ proxy: LAYERS STAGES; DP = world size / (tp * STAGES).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "layers",
        type=cli.positive_int,
        nargs="?",
        metavar="LAYERS",
        help="transformer layers (default: the preset's depth)",
    )
    p.add_argument(
        "stages",
        type=cli.positive_int,
        nargs="?",
        default=1,
        metavar="STAGES",
        help="pipeline stages",
    )
    p.add_argument(
        "--model",
        choices=sorted(PRESETS),
        default=DEFAULT_MODEL,
        help="preset widths (Brown et al. 2020); gpt3-tiny (C=64) for tests",
    )
    p.add_argument("--tp", type=cli.positive_int, default=1, help="tensor-parallel degree")
    p.add_argument(
        "--micro-batch",
        type=cli.positive_int,
        default=1,
        metavar="B",
        help="samples per micro-batch",
    )
    p.add_argument(
        "--micro-batches",
        type=cli.positive_int,
        metavar="M",
        help="micro-batches per iteration per replica (default 2 x STAGES, as the C++ proxy)",
    )
    p.add_argument(
        "--seq-len",
        type=cli.positive_int,
        metavar="T",
        help="tokens per sample (default: the preset's context, 2048)",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Megatron's sequence parallelism: per layer 2 allgathers and 2 reduce-scatters "
        "forward, 4 and 2 backward (qkv's and fc's inputs gathered again); pipeline "
        "messages shrink by tp; with MoE, Megatron's token dispatch (A2A ep, AG/RS tp)",
    )
    p.add_argument(
        "--schedule",
        choices=sorted(SCHEDULES),
        default="1f1b",
        help="gpipe: all forwards then all backwards (the C++ proxy's order); interleaved: "
        "1F1B with --virtual-stages model chunks per rank",
    )
    p.add_argument(
        "--virtual-stages",
        type=cli.positive_int,
        default=1,
        metavar="V",
        help="model chunks per rank (interleaved schedule; > 1 selects it)",
    )
    p.add_argument(
        "--order",
        default="cpp",
        metavar="ORDER",
        help="rank order, fastest dimension first: cpp = pp-tp-ep-dp (stage = rank %% "
        "STAGES, as the C++ proxy), megatron = tp-ep-dp-pp, or explicit like tp-pp-dp",
    )
    g = p.add_argument_group("mixture of experts")
    g.add_argument(
        "--moe-experts",
        type=cli.nonneg_int,
        default=0,
        metavar="E",
        help="experts per MoE layer (0: dense MLPs); every layer's MLP becomes an MoE",
    )
    g.add_argument(
        "--moe-top-k",
        type=cli.positive_int,
        default=2,
        metavar="K",
        help="experts each token is routed to",
    )
    g.add_argument(
        "--capacity-factor",
        type=cli.number(min=0, open_min=True, max=1000, what="a capacity factor in (0, 1000]"),
        default=1.0,
        metavar="CF",
        help="expert capacity = ceil(CF * K * tokens / E) per source rank; tokens past it "
        "drop; in (0, 1000]",
    )
    g.add_argument(
        "--moe-ffn-hidden",
        type=cli.positive_int,
        metavar="F",
        help="hidden width of one expert (default 4C; 4C/E gives the C++ MoE proxy's sizes)",
    )
    g.add_argument(
        "--ep",
        type=cli.positive_int,
        metavar="EP",
        help="expert-parallel degree, a divisor of DP (default gcd(E, DP)); experts are "
        "spread over EP ranks and their gradients allreduced over DP / EP",
    )
    g = p.add_argument_group("gradients and layout")
    g.add_argument(
        "--dp-bucket",
        type=cli.nonneg_int,
        default=0,
        metavar="ELEMENTS",
        help="data-parallel gradient bucket size; buckets are whole layers, allreduced as soon "
        "as the last micro-batch's backward finishes them (0: one bucket per layer)",
    )
    g.add_argument(
        "--inflight-buckets",
        type=cli.nonneg_int,
        default=2,
        metavar="N",
        help="gradient buckets in flight at once; compute model/none keep N bucket buffers "
        "(0: no limit, every gradient in memory)",
    )
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=cli.positive_int,
        default=128,
        metavar="N",
        help="pad the vocabulary to a multiple of N * tp (Megatron's option)",
    )
    g.add_argument(
        "--layers-only",
        action="store_true",
        help="only the transformer layers, no embedding, LM head or loss: the C++ proxy's "
        "pattern (compute model/none only)",
    )
    p.add_argument(
        "--lr",
        type=cli.learning_rate,
        default=1e-4,
        help=f"AdamW learning rate, in (0, {cli.LR_MAX:g}]",
    )
    p.add_argument(
        "--weight-decay", type=cli.weight_decay, default=0.0, help="AdamW weight decay, in [0, 1]"
    )
    p.add_argument(
        "--data", metavar="FILE", help="llm.c token file (.bin); default: synthetic tokens"
    )
    cli.add_common(
        p,
        compute=None,  # resolved per preset in resolve()
        compute_help=(
            "real: the NumPy kernels on this rank's tensor-parallel shard; replay: each "
            "compute op timed once with the real kernels, ranks on a node taking turns, then "
            "slept; model: sleep FLOPs / --device-tflops; none: communication only (default: "
            "real for gpt3-tiny, model for the other presets)"
        ),
    )
    tflops = cpp_device_tflops()
    _default(
        p,
        "device_tflops",
        tflops,
        f"achieved device rate for --compute model, in TFLOP/s (default {tflops:.2f}: one "
        "175B layer shard at tp 4 then takes the C++ proxy's A100 times, 15,915 us forward "
        "and 31,830 us backward)",
    )
    return p


def _default(p: argparse.ArgumentParser, dest: str, value, help: str) -> None:
    """Change a shared option's default (and its help) for this proxy."""
    p.set_defaults(**{dest: value})
    for action in p._actions:
        if action.dest == dest:
            action.help = help


# ----------------------------------------------------------------------------------------
# the setup, validated


def resolve(args, world: int) -> tuple[Setup, ProcessGrid, dict]:
    """Check the options against each other and the world size; UsageError names the rule."""
    cfg = PRESETS[args.model]
    L = args.layers or cfg.n_layer
    memory.check_layers(L)
    cfg = cfg.with_layers(L)
    pp, tp, v, B = args.stages, args.tp, args.virtual_stages, args.micro_batch
    T = args.seq_len or cfg.max_seq_len
    m = args.micro_batches or 2 * pp
    err = cli.UsageError
    if args.compute is None:
        args.compute = "real" if args.model == "gpt3-tiny" else "model"
    if cfg.n_head % tp:
        raise err(f"--tp {tp} does not divide {args.model}'s {cfg.n_head} attention heads")
    if pp > L:
        raise err(f"STAGES = {pp} is more than LAYERS = {L}: every stage needs at least one layer")
    if world % (tp * pp):
        raise err(
            f"world size {world} is not dp * tp * pp: not a multiple of --tp {tp} x "
            f"STAGES {pp} = {tp * pp}"
        )
    if T > cfg.max_seq_len:
        raise err(f"--seq-len {T} is longer than {args.model}'s context of {cfg.max_seq_len}")
    schedule = args.schedule
    if v > 1:
        if schedule == "gpipe":
            raise err(f"--virtual-stages {v} needs the interleaved schedule, not gpipe")
        schedule = "interleaved"
        if L % pp:
            raise err(f"--virtual-stages {v}: LAYERS = {L} must be a multiple of STAGES = {pp}")
        if (L // pp) % v:
            raise err(
                f"--virtual-stages {v} does not divide the {L // pp} layers per stage "
                f"(LAYERS {L} / STAGES {pp})"
            )
    if schedule == "interleaved" and v > 1 and m % pp:
        raise err(
            f"the interleaved schedule needs --micro-batches ({m}) to be a multiple of "
            f"STAGES = {pp}"
        )
    if m * v > MAX_TAG_MICROBATCHES:
        raise err(
            f"--micro-batches {m} x --virtual-stages {v}: at most {MAX_TAG_MICROBATCHES} "
            "(message tags)"
        )
    sp = args.sequence_parallel and tp > 1
    if sp and T % tp:
        raise err(f"--sequence-parallel: --seq-len {T} is not a multiple of --tp {tp}")
    dp = world // (tp * pp)
    moe = None
    E = args.moe_experts
    if E:
        ep = args.ep or math.gcd(E, dp)
        if dp % ep:
            raise err(f"--ep {ep} does not divide the data-parallel degree {dp}")
        if E % ep:
            raise err(
                f"--moe-experts {E} cannot be spread evenly over the {ep} expert-parallel ranks"
            )
        if args.moe_top_k > E:
            raise err(f"--moe-top-k {args.moe_top_k} is more than --moe-experts {E}")
        F = args.moe_ffn_hidden or 4 * cfg.n_embd
        if F % tp:
            raise err(f"--moe-ffn-hidden {F} is not a multiple of --tp {tp}")
        moe = MoESpec(E, args.moe_top_k, args.capacity_factor, F, ep)
    elif args.ep:
        raise err("--ep needs --moe-experts")
    if args.layers_only and args.compute in ("real", "replay"):
        raise err(
            f"--layers-only has no loss to train: use --compute model or none, not {args.compute}"
        )
    if v > 1:
        per = L // (pp * v)
        split = tuple(range(i * per, (i + 1) * per) for i in range(pp * v))
    else:
        split = tuple(split_layers(L, pp))
    vocab = padded_vocab(cfg.vocab_size, tp, args.make_vocab_size_divisible_by)
    S = Setup(
        cfg,
        B,
        T,
        m,
        tp,
        pp,
        dp,
        v,
        sp,
        vocab,
        split,
        moe,
        args.dp_bucket,
        args.inflight_buckets,
        args.layers_only,
    )
    try:
        SCHEDULES[schedule](pp, m, 0, v)
        degrees = {"tp": tp, "pp": pp, "dp": dp // (moe.ep if moe else 1)}
        if moe:
            degrees["ep"] = moe.ep
        order = ORDERS.get(args.order, args.order)
        grid = ProcessGrid.create(order, **degrees)
    except ValueError as e:
        raise err(str(e)) from None
    return S, grid, {"schedule": schedule}


# ----------------------------------------------------------------------------------------
# plans


def buckets(S: Setup, layout: Layout) -> list[tuple[int, list[Unit]]]:
    """Gradient buckets in the order they are posted: (chunk, units), consecutive units of one
    chunk in backward order, closed once they reach S.bucket elements (0: every unit)."""
    out: list[tuple[int, list[Unit]]] = []
    current: list[Unit] = []
    for i, u in enumerate(layout.units):
        current.append(u)
        nxt = layout.units[i + 1] if i + 1 < len(layout.units) else None
        if sum(x.size for x in current) >= S.bucket or nxt is None or nxt.chunk != u.chunk:
            out.append((u.chunk, current))
            current = []
    return out


def build_plan(S: Setup, grid: ProcessGrid, rank: int, schedule: str, tmpl: Templates) -> Plan:
    c = grid.coords(rank)
    s = c["pp"]
    pp_ranks = grid.group("pp", rank)
    chunks = S.chunks(s)
    actions = SCHEDULES[schedule](S.pp, S.m, s, S.v)
    last_mb = {}
    for a in actions:
        if a.kind == "B":
            last_mb[a.chunk] = a.mb
    layout = Layout(S, s)
    reductions = _reductions(S, layout)
    ops: list = []
    inflight: list[str] = []

    def post(coll: Collective) -> None:
        if S.inflight and len(inflight) >= S.inflight:
            ops.append(Wait(inflight.pop(0)))
        ops.append(coll)
        inflight.append(coll.req)

    for op in pipeline_ops(actions, s, pp_ranks, S.v, S.act):
        if not isinstance(op, Compute):
            ops.append(op)
            continue
        ch = chunks[op.chunk]
        expanded = tmpl.ops(op.name, ch, op.mb)
        if op.name != "backward" or op.mb != last_mb[op.chunk]:
            ops.extend(expanded)
            continue
        # the last backward of this chunk: post each bucket once its layers are done
        items = tmpl.backward(ch)
        finished: set[int] = set()
        pending = [r for r in reductions if r[0] == op.chunk]
        for it, o in zip(items, expanded, strict=True):
            ops.append(o)
            if it[0] == "C" and it[3]:
                finished.update(it[3])
                while pending and all(u.layer in finished for u in pending[0][1]):
                    for coll in pending.pop(0)[2]:
                        post(coll)
    # after the pipeline: complete every bucket, then the tied embedding, the SP grads
    ops += [Wait(req) for req in inflight]
    groups = _groups(S, grid, rank)
    if "embed" in groups:
        ops.append(Collective("allreduce", "embed", "wte_grad", S.vocab // S.tp * S.cfg.n_embd))
    if S.sp and layout.sp_size:
        ops += [
            Compute("sp_pack"),
            Collective("allreduce", "tp", "sp_grads", layout.sp_size, category="tp_allreduce"),
            Compute("sp_unpack"),
        ]
    ops.append(Compute("optimizer"))
    return Plan(rank, tuple(ops), groups, c)


def _reductions(S: Setup, layout: Layout) -> list[tuple[int, list[Unit], list[Collective]]]:
    """Per bucket: (chunk, units, its non-blocking allreduces: dense over dp, experts over
    edp). The buffer is ("dpgrad" | "edpgrad", bucket index)."""
    edp = S.dp // S.moe.ep if S.moe else 1
    out = []
    for k, (chunk, units) in enumerate(buckets(S, layout)):
        colls = []
        dense = sum(u.dense[1] - u.dense[0] for u in units)
        expert = sum(u.expert[1] - u.expert[0] for u in units)
        if S.dp > 1 and dense:
            colls.append(
                Collective(
                    "allreduce", "dp", "dpgrad", dense, mb=k, req=f"dp{k}", category="dp_allreduce"
                )
            )
        if edp > 1 and expert:
            colls.append(
                Collective(
                    "allreduce",
                    "edp",
                    "edpgrad",
                    expert,
                    mb=k,
                    req=f"edp{k}",
                    category="edp_allreduce",
                )
            )
        out.append((chunk, units, colls))
    return out


def _groups(S: Setup, grid: ProcessGrid, rank: int) -> dict[str, tuple[int, ...]]:
    c = grid.coords(rank)
    pp_ranks = grid.group("pp", rank)
    groups = {"pp": pp_ranks, "tp": grid.group("tp", rank)}
    if S.moe:
        # data parallel = every rank with this (tp, pp): the ep x edp block
        groups["dp"] = tuple(
            grid.rank_of(**{**c, "ep": e, "dp": d})
            for d in range(grid.degree("dp"))
            for e in range(S.moe.ep)
        )
        groups["ep"] = grid.group("ep", rank)
        groups["edp"] = grid.group("dp", rank)
    else:
        groups["dp"] = grid.group("dp", rank)
    if S.pp > 1 and c["pp"] in (0, S.pp - 1) and not S.layers_only:
        groups["embed"] = (pp_ranks[0], pp_ranks[-1])
    return groups


# ----------------------------------------------------------------------------------------
# runtime


class BufferPool:
    """Reusable buffers for compute model/none: no parameters, every message a view into a
    few arrays, each sized by the largest message that uses it (found in the plan):
    one per pipeline direction, one for all blocking collectives (they never overlap), and
    one per in-flight gradient bucket (the plan waits before reusing one)."""

    P2P_SLOTS = ("act_in", "act_out", "grad_out", "grad_in")

    def __init__(self, plan: Plan, inflight: int):
        self.slot_of: dict[tuple[str, int], str] = {}
        size: dict[str, int] = defaultdict(int)
        posted = 0
        for op in plan.ops:
            if isinstance(op, P2P):
                for msg in op.sends + op.recvs:
                    size[msg.buf] = max(size[msg.buf], msg.count)
            elif isinstance(op, Collective):
                if op.req:
                    slot = f"grad{posted % inflight if inflight else posted}"
                    posted += 1
                else:
                    slot = "grad0" if op.buf == "wte_grad" else "coll"
                self.slot_of[(op.buf, op.mb)] = slot
                size[slot] = max(size[slot], op.count)
        self.size = dict(size)
        self.arrays: dict[str, np.ndarray] = {}

    @property
    def nbytes(self) -> int:
        return 4 * sum(self.size.values())

    def get(self, name: str, mb: int, count: int | None = None) -> np.ndarray:
        slot = name if name in self.P2P_SLOTS else self.slot_of[(name, mb)]
        arr = self.arrays.get(slot)
        if arr is None:  # zeros: calloc'd, pages appear as messages touch them
            arr = self.arrays[slot] = np.zeros(self.size[slot], dtype=np.float32)
        return arr if count is None else arr[:count]


class GPT3Runtime:
    """Buffers and compute of one rank: a StageShard for real/replay compute, a BufferPool
    for model/none."""

    def __init__(
        self,
        S: Setup,
        plan: Plan,
        stage: int,
        tp_rank: int,
        ep_rank: int,
        dp_rank: int,
        args,
        source,
        mode: str,
    ):
        self.S, self.plan, self.dp_rank, self.source = S, plan, dp_rank, source
        self.lr, self.wd = args.lr, args.weight_decay
        self.counts = {(op.buf, op.mb): op.count for op in plan.ops if isinstance(op, Collective)}
        self.model = self.pool = None
        self.layout = Layout(S, stage)
        self.ranges = {}
        for k, (_, units, _) in enumerate(_reductions(S, self.layout)):
            lo_d, hi_d = min(u.dense[0] for u in units), max(u.dense[1] for u in units)
            lo_e, hi_e = min(u.expert[0] for u in units), max(u.expert[1] for u in units)
            self.ranges[("dpgrad", k)] = (lo_d, hi_d)
            self.ranges[("edpgrad", k)] = (lo_e, hi_e)
        if mode in ("real", "replay"):
            from proxies.transformer.model import StageShard

            self.model = StageShard(S, stage, tp_rank, ep_rank, seed=args.seed)
            self.model.loss_scale = 1.0 / (S.m * S.dp)
        else:
            self.pool = BufferPool(plan, S.inflight)
        self.iteration = 0
        self.loss_sum, self.loss_count = 0.0, 0

    def buffer(self, name: str, mb: int, chunk: int) -> np.ndarray:
        model = self.model
        if model is None:
            count = self.S.act if name in BufferPool.P2P_SLOTS else self.counts[(name, mb)]
            return self.pool.get(name, mb, count)
        if name in BufferPool.P2P_SLOTS:
            return model.message(name, mb, chunk)
        if name in ("dpgrad", "edpgrad"):
            lo, hi = self.ranges[(name, mb)]
            return (model.grads if name == "dpgrad" else model.egrads)[lo:hi]
        if name == "wte_grad":
            lo, hi = self.layout.wte
            return model.grads[lo:hi]
        return {
            "tp": model.tp_buf,
            "ce": model.ce_buf,
            "moe": model.moe_buf,
            "moe_tp": model.moe_all,
            "moe_dscore": model.dscore_buf,
            "sp_grads": model.sp_buf,
        }[name]

    def _batch(self, mb: int):
        S = self.S
        g = (self.iteration * S.dp + self.dp_rank) * S.m * S.B + mb * S.B
        return batch(self.source, g, S.B)

    def compute(self, op: Compute, iteration: int) -> None:
        model = self.model
        self.iteration = iteration
        model.batch = self._batch
        if op.name == "optimizer":
            model.step(self.lr, self.wd)
        elif op.name == "sp_pack":
            model.sp_pack()
        elif op.name == "sp_unpack":
            model.sp_unpack()
        else:
            loss = model.compute(op.name, op.mb, op.chunk)
            if loss is not None:
                self.loss_sum += loss
                self.loss_count += 1

    def finish_iteration(self, iteration: int) -> tuple[float, int]:
        out = (self.loss_sum, self.loss_count)
        self.loss_sum, self.loss_count = 0.0, 0
        return out


# ----------------------------------------------------------------------------------------
# the job


def make_job(args, world: int) -> runner.Job:
    S, grid, extra = resolve(args, world)
    schedule = extra["schedule"]
    cfg = S.cfg
    source = None
    if args.data and not args.dry_run:
        try:
            source = TokenFile(args.data, cfg.vocab_size, S.T)
        except DataError as e:
            raise cli.UsageError(str(e)) from None
    elif not args.data:
        source = Synthetic(args.seed, cfg.vocab_size, S.T)
    tmpl = Templates(S)

    @lru_cache(maxsize=1024)
    def plan(rank: int) -> Plan:
        return build_plan(S, grid, rank, schedule, tmpl)

    def label(rank: int) -> str:
        s = grid.coords(rank)["pp"]
        chunks = S.chunks(s)
        parts = [f"{ch.layers.start}-{ch.layers.stop - 1}" for ch in chunks]
        extra = (" +emb" if any(ch.embed for ch in chunks) else "") + (
            " +head" if any(ch.head for ch in chunks) else ""
        )
        return f"stage {s}: layers {','.join(parts)}{extra}"

    def runtime(rank, MPI, comms, mode):
        c = grid.coords(rank)
        ep_rank = c.get("ep", 0)
        dp_rank = c["dp"] * (S.moe.ep if S.moe else 1) + ep_rank
        return GPT3Runtime(S, plan(rank), c["pp"], c["tp"], ep_rank, dp_rank, args, source, mode)

    config = config_dict(args, S, grid, schedule)
    header = header_lines(args, S, grid, schedule, source)
    groups = ("pp", "tp", "dp", "embed", "ep", "edp")
    return runner.Job(
        prog=PROG,
        proxy="gpt3",
        config=config,
        grid=grid,
        plan=plan,
        group_names=groups,
        label=label,
        header=header,
        runtime=runtime,
        dtypes=cli.wire_dtypes(args),
        grad_categories=frozenset({"dp_allreduce", "edp_allreduce", "embed_allreduce"}),
        # The vocabulary-parallel loss's (max, sum-exp, target logit): float32, as Megatron's.
        fp32_buffers=frozenset({"ce"}),
        # tensor-parallel shards and data-parallel replicas run the same plan op for op
        fold=("tp", "dp"),
        setup=S,  # for the dry run
        memory=lambda rank, plan: estimate_memory(
            S, grid.coords(rank)["pp"], schedule, args.compute, plan
        ),
        categories=SPEC.categories,
        short=SPEC.short,
    )


def config_dict(args, S: Setup, grid: ProcessGrid, schedule: str) -> dict:
    cfg = S.cfg
    moe = S.moe
    return {
        "model": args.model,
        "layers": cfg.n_layer,
        "stages": S.pp,
        "tp": S.tp,
        "dp": S.dp,
        "virtual_stages": S.v,
        "micro_batches": S.m,
        "micro_batch": S.B,
        "seq_len": S.T,
        "sequence_parallel": S.sp,
        "n_embd": cfg.n_embd,
        "n_head": cfg.n_head,
        "vocab_size": cfg.vocab_size,
        "vocab_padded": S.vocab,
        "params": cfg.num_params,
        "moe_experts": moe.experts if moe else 0,
        "moe_top_k": moe.top_k if moe else None,
        "capacity_factor": moe.capacity_factor if moe else None,
        "moe_ffn_hidden": moe.ffn_hidden if moe else None,
        "ep": moe.ep if moe else 1,
        "schedule": schedule,
        "order": grid.order,
        "global_batch": S.B * S.m * S.dp,
        "dp_bucket": S.bucket,
        "inflight_buckets": S.inflight,
        "layers_only": S.layers_only,
        "compute": args.compute,
        "device_tflops": args.device_tflops,
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "seed": args.seed,
        "iters": args.iters,
        "warmup": args.warmup,
        "data": args.data or "synthetic",
        "check": args.check,
        "allreduce": args.allreduce,
        "layers_per_stage": [sum(len(ch.layers) for ch in S.chunks(s)) for s in range(S.pp)],
    }


def header_lines(args, S: Setup, grid: ProcessGrid, schedule: str, source) -> list[str]:
    cfg, moe = S.cfg, S.moe
    per = sorted({sum(len(ch.layers) for ch in S.chunks(s)) for s in range(S.pp)})
    moe_txt = ""
    if moe:
        moe_txt = (
            f" · MoE: {moe.experts} experts of width {moe.ffn_hidden}, top-{moe.top_k}, "
            f"capacity factor {moe.capacity_factor:g} ({moe.capacity(S.N)} slots per expert), "
            f"ep {moe.ep}"
        )
    data = source.describe() if source is not None else args.data
    return [
        f"[bold]{PROG}[/] · {args.model} (C={cfg.n_embd}, {cfg.n_head} heads, "
        f"V={cfg.vocab_size} padded to {S.vocab}) · {cfg.n_layer} layers = "
        f"{cfg.num_params:,} parameters ({si_count(cfg.num_params)})" + moe_txt,
        f"grid: tp {S.tp} x pp {S.pp} x dp {S.dp} (order {grid.order}) · layers per stage "
        + "-".join(map(str, per))
        + (f" in {S.v} chunks" if S.v > 1 else "")
        + f" · schedule {schedule} · {S.m} micro-batches of {S.B} x {S.T} tokens (global "
        f"batch {S.B * S.m * S.dp} samples)" + (" · sequence parallel" if S.sp else ""),
        f"messages: pipeline {S.act:,} floats ({4 * S.act:,} B) · TP collectives "
        f"{S.N * cfg.n_embd:,} floats per layer part · data: {data} · iterations "
        f"{args.warmup} warm-up + {args.iters} timed" + (" · layers only" if S.layers_only else ""),
    ]


# ----------------------------------------------------------------------------------------
# dry run: plans for any world size, without MPI


def dimension_of(category: str) -> str:
    return category.split("_")[0]


def plan_traffic(plan: Plan) -> dict[tuple[str, str], list[int]]:
    """Per (dimension, what): [operations, elements, bytes] for one iteration of one rank."""
    out: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for op in plan.ops:
        if isinstance(op, P2P):
            for way, msgs in (("send", op.sends), ("recv", op.recvs)):
                for msg in msgs:
                    row = out[(dimension_of(op.category), way)]
                    row[0] += 1
                    row[1] += msg.count
                    row[2] += msg.nbytes
        elif isinstance(op, Collective):
            row = out[(op.group, op.kind)]
            row[0] += 1
            row[1] += op.count
            row[2] += op.nbytes
    return dict(out)


def dry_run(args, world: int, machine=None) -> int:
    from rich.markup import escape

    from proxies.core.simulate import PlanError, simulate
    from proxies.core.tables import Column, show

    job = make_job(args, world)
    faults.attach(job, args)  # checked against the job; in the header and config
    S, grid = _setup_of(job)
    console = report.console()
    for line in job.header:
        console.print(line)
    reps = [grid.rank_of(pp=s) for s in range(S.pp)]
    plans = {s: job.plan(r) for s, r in enumerate(reps)}
    traffic = {s: plan_traffic(p) for s, p in plans.items()}

    # parameters per rank
    lay = [Layout(S, s) for s in range(S.pp)]
    held = [lay[s].dense_size + lay[s].expert_size for s in range(S.pp)]
    console.print(
        f"parameters: {S.cfg.num_params:,} in the model; per rank (one tensor-parallel shard "
        f"of its stage) {min(held):,} to {max(held):,}"
    )
    pools = [BufferPool(p, S.inflight).nbytes for p in plans.values()]
    console.print(
        f"comm-only memory (compute model/none): {max(pools) / 2**30:,.2f} GiB per rank of "
        f"message buffers, at most (no parameters are allocated)"
    )
    estimates = memory.by_label(job, reps)
    for line in memory.dry_run_lines(estimates, args.compute):
        console.print(line)

    # traffic per rank and dimension, stages with identical traffic merged
    cols = [Column("stages", number=False, key=True), Column("ranks each")]
    cols += [Column("dimension", number=False), Column("group"), Column("op", number=False)]
    cols += [Column("count"), Column("elements"), Column("bytes"), Column("size", number=False)]
    table: list[list[str] | None] = []
    sizes = {name: len(members) for name, members in plans[0].groups.items()}
    for s in range(S.pp):
        sizes |= {n: len(m) for n, m in plans[s].groups.items()}
    runs: list[list[int]] = []
    for s in range(S.pp):
        if runs and traffic[runs[-1][-1]] == traffic[s]:
            runs[-1].append(s)
        else:
            runs.append([s])
    per_stage = world // S.pp
    for run in runs:
        name = str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"
        rows = sorted(traffic[run[0]].items())
        for i, ((dim, what), (n, elems, nbytes)) in enumerate(rows):
            table.append(
                [
                    name if i == 0 else "",
                    str(per_stage) if i == 0 else "",
                    dim,
                    str(sizes.get(dim, S.pp if dim == "pp" else 1)),
                    what,
                    f"{n:,}",
                    f"{elems:,}",
                    f"{nbytes:,}",
                    report.human_bytes(nbytes),
                ]
            )
        table.append(None)  # a rule between stage groups
    show(console, "traffic per rank per iteration, by dimension", cols, table[:-1])

    for r in runner.show_ranks(args.show_ranks, job, world) if args.show_ranks else []:
        runner.print_ops(console, job, r, job.plan(r).ops)

    # validate and predict: every rank, or (big worlds) one rank per stage and expert rank
    sim_plans, note = simulated_plans(job, S, grid, world, plans)
    rate = args.device_tflops * 1e12
    try:
        sim = simulate(
            sim_plans,
            cost=lambda rank, op: op.model_seconds(rate) if isinstance(op, Compute) else 0.0,
        )
    except PlanError as e:
        console.print(f"[bold red]plan is invalid[/]: {escape(str(e))}")
        return 1
    nmsg = sum(1 for p in sim_plans for _, _, d in p.messages() if d == "send")
    ncoll = sum(1 for p in sim_plans for op in p.ops if isinstance(op, Collective))
    console.print(
        f"plan valid: simulated {note}: {nmsg:,} messages matched, {ncoll:,} collective "
        f"calls matched, no deadlock. Predicted iteration with compute=model "
        f"(--device-tflops {args.device_tflops:g}) and free communication: {sim.time:.4g} s"
    )
    predicted = {}
    if machine is not None:
        from proxies.core import prediction

        predicted = prediction.dry_run_report(job, args, machine, console)
        if predicted is None:
            return 1
    if args.json:
        stage_of = [grid.coords(r)["pp"] for r in range(world)]
        by_stage = {s: p.bytes_by_category() for s, p in plans.items()}
        cats = sorted({c for b in by_stage.values() for c in b})
        written = report.write_json(
            args.json,
            {
                "proxy": "gpt3",
                "dry_run": True,
                "config": job.config,
                "world_size": world,
                "grid": grid.describe(),
                "params": S.cfg.num_params,
                "simulated_ranks": len(sim_plans),
                "free_comm_iter_time_s": sim.time,
                "traffic": {
                    str(s): {f"{d}/{w}": v for (d, w), v in traffic[s].items()} for s in range(S.pp)
                },
                "bytes": {c: [by_stage[stage_of[r]].get(c, 0) for r in range(world)] for c in cats},
                "comm_only_bytes_per_rank": max(pools),
                "memory_bytes": estimates,
                **predicted,
                **provenance.fields(),
            },
            prog=PROG,
        )
        if written is None:
            return exits.FAILED
    return 0


def simulated_plans(job, S: Setup, grid: ProcessGrid, world: int, reps: dict) -> tuple:
    """Plans to simulate: every rank while that stays small, else the ranks with
    tp = dp = 0 (every stage, every expert rank), without the collectives of groups that
    reach outside them (tp, dp, edp): see prediction.validation_plans."""
    from proxies.core import prediction

    dims = prediction.fold_dims(job, world, len(reps[0].ops))
    if not dims:
        return [job.plan.__wrapped__(r) for r in range(world)], f"all {world} ranks"
    ranks = sorted(set(prediction.representatives(grid, dims).tolist()))
    out, cut = prediction.validation_plans([job.plan(r) for r in ranks])
    note = (
        f"{len(ranks)} of {world} ranks (tp = dp = 0, every stage"
        + (" and expert rank" if S.moe else "")
        + f"), without the {'/'.join(sorted(cut))} collectives: their members run identical plans"
    )
    return out, note


def _setup_of(job: runner.Job) -> tuple[Setup, ProcessGrid]:
    return job.setup, job.grid


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.dry_run:
        cli.check_output(args.json)  # before planning, however long that takes
        machine = cli.use_machine(args)
        world = args.world_size or cli.env_world_size() or 1
        if cli.env_rank() != 0:  # under a launcher: rank 0 plans and prints, the rest exit
            faults.attach(make_job(args, world), args)  # bad input still exits 2 everywhere
            return 0
        return dry_run(args, world, machine)
    return runner.main(make_job, p, argv)


def entry() -> None:
    cli.run_main(PROG, main, sys.argv[1:])
