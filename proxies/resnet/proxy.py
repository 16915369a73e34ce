"""The ResNet proxy: data-parallel training of torchvision's bottleneck ResNet, the gradients
allreduced in buckets during the backward as PyTorch DDP posts them.

    mpirun -n 4 python -m proxies.resnet                       # resnet-tiny, real NumPy
    python -m proxies.resnet --model resnet152 --dry-run --world-size 1024

Every rank is a replica (the world is the dp group) training --batch images of its own;
batch norm uses each replica's own batch statistics (DDP without SyncBatchNorm), the summed
gradients are averaged in the optimizer (SGD, momentum, weight decay). The plans are in
plans.py; the C++ proxies' presets (dnn-cpp-proxies-*) send their fixed messages.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math

import numpy as np

from proxies.core import cli, pages, runner
from proxies.core.grid import ProcessGrid
from proxies.core.plan import Collective, Compute, Plan, Span
from proxies.resnet import SPEC
from proxies.resnet.config import CPP_PRESETS, CPP_SCALED, PRESETS, CppPreset, ResNetConfig
from proxies.resnet.fsdp import ResNetShards, fsdp_plan, fsdp_text, shard_units
from proxies.resnet.memory import estimate as estimate_memory
from proxies.resnet.plans import cpp_ops, model_ops, tensor_bounded

PROG = "proxies.resnet"
DEFAULT_MODEL = "resnet-tiny"
DEFAULT_BUCKET_MB = 25.0  # PyTorch DDP's bucket_cap_mb
SYNCS = ("buckets", "fused", "per-tensor")
MAX_BATCH, MAX_IMAGE, MAX_CLASSES = 4096, 1024, 1_000_000
MAX_BUCKET_MB = 1e6


def parser() -> argparse.ArgumentParser:
    p = cli.Parser(
        prog=f"python -m {PROG}",
        description="ResNet training proxy: data parallel over every rank, real NumPy "
        "compute (conv, batch norm, pooling, fc, cross-entropy, SGD), the gradients "
        "allreduced in buckets as the backward completes them (PyTorch DDP); or the C++ "
        "proxies' (spcl/DNN-cpp-proxies) messages and A100 times.",
    )
    p.add_argument(
        "--model",
        choices=[*PRESETS, *CPP_PRESETS],
        default=DEFAULT_MODEL,
        help="resnet-tiny (1 block per stage, widths 4-32, 32x32 images, 10 classes: tests "
        "and CI; the default), resnet50, resnet152 (torchvision's, 224x224, 1000 classes); "
        "dnn-cpp-proxies-resnet50 (comm_only/resnet50.cpp: six blocking allreduces), "
        "dnn-cpp-proxies-resnet152 (resnet152.cpp: ten buckets under the backward, A100 "
        "times at batch 128), dnn-cpp-proxies-resnet152-scal (resnet152_scal.cpp: batch and "
        "times set by the world size, 256/512/1024/2048 ranks)",
    )
    p.add_argument(
        "--batch",
        type=cli.integer(min=1, max=MAX_BATCH, what="a positive integer"),
        metavar="B",
        help="images per replica (default: the preset's, 4 for resnet-tiny, 32 for resnet50 "
        "and resnet152)",
    )
    p.add_argument(
        "--image-size",
        type=cli.integer(min=1, max=MAX_IMAGE, what="a positive integer"),
        metavar="S",
        help="S x S images (default: the preset's; 224, 32 for resnet-tiny)",
    )
    p.add_argument(
        "--classes",
        type=cli.integer(min=2, max=MAX_CLASSES, what="an integer >= 2"),
        metavar="N",
        help="classes of the fc layer (default: the preset's; 1000, 10 for resnet-tiny)",
    )
    p.add_argument(
        "--grad-sync",
        choices=SYNCS,
        help="gradient allreduce: buckets (default: consecutive backward pieces, closed at "
        "--bucket-mb and posted non-blocking as soon as the backward completes them, as "
        "PyTorch DDP); fused (one allreduce of every gradient after the backward); "
        "per-tensor (one blocking allreduce per parameter tensor after the backward)",
    )
    p.add_argument(
        "--bucket-mb",
        type=cli.number(
            min=0, max=MAX_BUCKET_MB, what=f"a number >= 0 (MiB, at most {MAX_BUCKET_MB:g})"
        ),
        metavar="MB",
        help=f"with --grad-sync buckets: close a bucket once it holds MB MiB of float32 "
        f"gradients (default {DEFAULT_BUCKET_MB:g}, as PyTorch DDP; 0: one bucket per piece)",
    )
    p.add_argument(
        "--broadcast-buffers",
        choices=("on", "off"),
        help="on: before each forward, broadcast rank 0's batch-norm running statistics "
        "and counters to every replica, as PyTorch DDP's broadcast_buffers=True (the default "
        "for the torchvision presets on more than one rank); off: each replica keeps its own "
        "(the C++ presets: they send none)",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="FSDP / ZeRO-3: parameters, gradients and momentum sharded over the replicas by "
        "unit (the stem, each bottleneck block, the fc head); each unit all-gathered before "
        "its forward and again before its backward (the next one prefetched), its gradients "
        "reduce-scattered after its backward; SGD on this rank's shards (resnet/fsdp.py)",
    )
    p.add_argument(
        "--fsdp-shard-size",
        type=cli.positive_int,
        metavar="N",
        help="with --fsdp: hybrid sharding (HSDP): shard within groups of N consecutive "
        "ranks, replicate over the world / N groups (the reduced shards allreduced across "
        "them); default: every rank",
    )
    p.add_argument(
        "--lr",
        type=cli.learning_rate,
        help="SGD learning rate (default 0.1 x global batch / 256: torchvision's 0.1 for "
        "256 images, scaled linearly as Goyal et al.)",
    )
    p.add_argument("--momentum", type=cli.momentum, default=0.9, help="SGD momentum (default 0.9)")
    p.add_argument(
        "--weight-decay",
        type=cli.weight_decay,
        default=1e-4,
        help="SGD weight decay, added to the gradient (default 0.0001, torchvision's recipe)",
    )
    cli.add_common(
        p,
        compute=None,
        compute_help=(
            "real: the NumPy kernels on synthetic images; replay: each compute op timed once "
            "with them, then slept; model: FLOPs / --device-tflops (the C++ presets: their "
            "A100 times); none: communication only (default: real for resnet-tiny, model "
            "for resnet50, resnet152 and dnn-cpp-proxies-resnet152*, none for "
            "dnn-cpp-proxies-resnet50, which computes nothing)"
        ),
    )
    return p


class ResNetRuntime:
    """One replica's buffers and compute: the model for real/replay compute, zero buffers of
    the plan's sizes otherwise."""

    def __init__(
        self,
        cfg: ResNetConfig | None,
        plan: Plan,
        mode: str,
        d: int,
        B: int,
        args: argparse.Namespace,
        dtype: type = np.float32,
        shard: int = 0,
    ) -> None:
        self.cfg, self.d, self.B, self.dp = cfg, d, B, len(plan.groups["dp"])
        self.args, self.dtype = args, dtype
        self.model = self.fsdp = None
        if mode in ("real", "replay") and cfg is not None:
            from proxies.resnet.model import ResNetModel

            self.model = ResNetModel(cfg, args.seed, dtype, pad=max(shard, 1))
            if shard:  # ZeRO-3: the shards, gathered into the model per unit (fsdp.py)
                fill = 0.0 if mode == "replay" else np.nan
                self.fsdp = ResNetShards(cfg, self.model, shard, d % shard, fill)
        self.bufs: dict[str, np.ndarray] = {}
        grads = self.model.grads if self.model else None
        for coll in plan.ops:
            if not isinstance(coll, Collective):
                continue
            name = coll.buf.name if isinstance(coll.buf, Span) else coll.buf
            flat = name == "grads" or name.startswith("grad:")  # slices of the one array
            if name.startswith("fsdp") and self.fsdp is None:  # model/none: one zero slot each
                size = max(coll.count, len(self.bufs.get(name, ())))
                self.bufs[name] = pages.zeros(size, dtype)
            elif name.startswith("fsdp"):
                continue
            elif flat and grads is None:
                grads = pages.zeros(cfg.num_params, dtype)
            elif name in ("bn_stats", "bn_counts") and self.model is not None:
                self.bufs[name] = getattr(self.model, name)  # broadcast in place
            elif not flat:
                kind = np.int64 if coll.dtype == "int64" else dtype  # a 16-bit wire: cast
                self.bufs[name] = pages.zeros(coll.count, kind)
        self.grads = grads
        self.x = None
        self.loss, self.losses = 0.0, 0

    def buffer(self, name: str | Span, mb: int, chunk: int) -> np.ndarray:
        if self.fsdp is not None and isinstance(name, str) and name.startswith("fsdp"):
            return self.fsdp.buffer(name, mb)
        if isinstance(name, Span):
            return self.grads[name.lo : name.hi]
        if name == "grads":
            return self.grads
        if name.startswith("grad:"):
            lo, hi = self._offsets()[name[5:]]
            return self.grads[lo:hi]
        return self.bufs[name]

    def _offsets(self) -> dict[str, tuple[int, int]]:
        if self.model is not None:
            return self.model.offsets
        if not hasattr(self, "_offs"):
            self._offs, lo = {}, 0
            for t, n in reversed(self.cfg.tensors):
                self._offs[t] = (lo, lo + n)
                lo += n
        return self._offs

    def compute(self, op: Compute, iteration: int) -> None:
        m = self.model
        if m is None:
            return
        piece, _, step = op.name.rpartition(".")
        if op.name == "data":
            from proxies.resnet.model import batch

            first = iteration * self.dp * self.B + self.d * self.B  # global sample index
            self.x, self.labels = batch(self.cfg, self.args.seed, first, self.B, self.dtype)
        elif op.name == "optimizer" and self.fsdp is not None:
            a = self.args
            self.fsdp.step(a.lr, a.momentum, a.weight_decay, 1.0 / self.dp)
        elif op.name.startswith("fsdp_"):
            if self.fsdp is not None:
                self.fsdp.compute(op.name, op.mb)
        elif op.name == "optimizer":
            a = self.args
            m.step(a.lr, a.momentum, a.weight_decay, 1.0 / self.dp)  # DDP averages
            m.zero_grad()
        elif step == "forward":
            if piece == "head":
                self.loss += m.forward_piece("head", self.x, self.labels)
                self.losses += 1
            else:
                self.x = m.forward_piece(piece, self.x)
        elif step == "backward":
            self.x = m.backward_piece(piece, None if piece == "head" else self.x)
        else:
            raise ValueError(f"unknown compute op {op.name}")

    def finish_iteration(self, iteration: int) -> tuple[float, int]:
        """(this replica's loss / replicas, 1 on rank 0): summed over the ranks, the mean
        loss of the global batch and 1."""
        out = (self.loss / self.dp, int(self.d == 0 and self.losses > 0))
        self.loss, self.losses = 0.0, 0
        return out


def resolve(
    args: argparse.Namespace, world: int
) -> tuple[ResNetConfig | None, CppPreset | None, int, tuple[float, float]]:
    """(model config or None, C++ preset or None, batch per replica, C++ times in us)."""
    if args.model in CPP_PRESETS:
        pre = CPP_PRESETS[args.model]
        real = args.compute in ("real", "replay")
        for opt, val in (
            ("--image-size", None if real else args.image_size),
            ("--classes", args.classes),
            ("--grad-sync", args.grad_sync),
            ("--bucket-mb", args.bucket_mb),
            ("--broadcast-buffers", args.broadcast_buffers),
            ("--fsdp", args.fsdp or None),
            ("--fsdp-shard-size", args.fsdp_shard_size),
        ):
            if val is not None:
                raise cli.UsageError(
                    f"{opt}: --model {args.model} sends the C++ proxy's fixed messages "
                    f"({pre.source}); use --model resnet50 or resnet152 to change them"
                )
        if real and not tensor_bounded(pre.model, pre.sizes):
            raise cli.UsageError(
                f"--compute {args.compute}: --model {args.model}'s allreduce sizes do not end "
                f"where a backward of torchvision's {pre.model.name} completes gradients "
                f"(they follow TensorFlow's parameter order); use --compute model or none, "
                f"or train --model {pre.model.name}"
            )
        if real:  # the model's own compute: its batch and image size are free
            cfg = dataclasses.replace(pre.model, image_size=args.image_size or 224)
            return cfg, pre, args.batch or pre.batch or 32, (0.0, 0.0)
        fwd, bwd, B = pre.forward_us, pre.backward_us, pre.batch
        if pre.scaled:
            if world not in CPP_SCALED:
                raise cli.UsageError(
                    f"--model {args.model} runs on {', '.join(map(str, CPP_SCALED))} ranks "
                    f"only (a global batch of 32K, as resnet152_scal.cpp), not {world}"
                )
            B, fwd, bwd = CPP_SCALED[world]
        if args.batch is not None and args.batch != B and (fwd or bwd):
            raise cli.UsageError(
                f"--batch {args.batch}: the C++ proxy's A100 times are for batch {B}"
            )
        return None, pre, args.batch or B, (fwd, bwd)
    base = PRESETS[args.model]
    cfg = ResNetConfig(
        base.name,
        base.blocks,
        base.widths,
        base.stem,
        args.image_size or base.image_size,
        args.classes or base.classes,
        base.batch,
    )
    if args.bucket_mb is not None and args.grad_sync not in (None, "buckets"):
        raise cli.UsageError(f"--bucket-mb needs --grad-sync buckets (it is {args.grad_sync})")
    fsdp_rules(args, world)
    return cfg, None, args.batch or base.batch, (0.0, 0.0)


def fsdp_rules(args: argparse.Namespace, world: int) -> None:
    """--fsdp / --fsdp-shard-size against the run (gpt3's rules: transformer/options.py)."""
    n = args.fsdp_shard_size
    if not args.fsdp:
        if n is not None:
            raise cli.UsageError(f"--fsdp-shard-size {n} needs --fsdp")
        return
    if world < 2:
        raise cli.UsageError("--fsdp shards over the data-parallel group, and its degree is 1")
    for opt, given in (("--grad-sync", args.grad_sync), ("--bucket-mb", args.bucket_mb)):
        if given is not None:  # FSDP reduce-scatters per unit: no allreduce buckets
            raise cli.UsageError(f"--fsdp does not combine with {opt}")
    n = world if n is None else n
    if n < 2 or world % n:
        raise cli.UsageError(
            f"--fsdp-shard-size {n} must be at least 2 and divide the data-parallel degree {world}"
        )
    args.fsdp_shard_size = n


def make_job(args: argparse.Namespace, world: int) -> runner.Job:
    cfg, pre, B, (fwd_us, bwd_us) = resolve(args, world)
    if args.lr is None:
        args.lr = 0.1 * B * world / 256
    if args.compute is None:
        if pre is not None:
            args.compute = "model" if pre.forward_us or pre.scaled else "none"
        else:
            args.compute = "real" if args.model == "resnet-tiny" else "model"
    grid = ProcessGrid.create("dp", dp=world)
    everyone = tuple(range(world))
    real = args.compute in ("real", "replay")
    shard = args.fsdp_shard_size if args.fsdp else 0
    policy = "fsdp" if shard else args.grad_sync or "buckets"
    mb = DEFAULT_BUCKET_MB if args.bucket_mb is None else args.bucket_mb
    bucket = math.ceil(mb * 2**20 / 4) if policy == "buckets" else 0
    if pre is not None and cfg is not None:  # real compute, the C++ proxy's buckets
        ops = tuple(model_ops(cfg, B, world, "buckets", 0, real, False, pre.sizes))
    elif pre is not None:
        ops = tuple(cpp_ops(pre, B, fwd_us, bwd_us, world))
    else:
        bn_bcast = args.broadcast_buffers != "off" and world > 1
        ops = () if shard else tuple(model_ops(cfg, B, world, policy, bucket, real, bn_bcast))

    @functools.lru_cache(maxsize=1024)
    def plan(rank: int) -> Plan:
        if shard:
            return fsdp_plan(cfg, B, world, shard, rank, real, bn_bcast)
        return Plan(rank, ops, {"dp": everyone}, {"dp": rank})

    def runtime(rank, MPI, comms, mode, dtype=np.float32):
        return ResNetRuntime(cfg, plan(rank), mode, rank, B, args, dtype, shard)

    model = cfg if cfg is not None else pre.model
    ops0 = plan(0).ops
    sizes = [c.count for c in ops0 if isinstance(c, Collective) and c.kind == "allreduce"]
    bcast = [c.count for c in ops0 if isinstance(c, Collective) and c.kind == "bcast"]
    config = {
        "model": args.model,
        "blocks": list(model.blocks),
        "widths": list(model.widths),
        "image_size": model.image_size,
        "classes": model.classes,
        "params": model.num_params,
        "batch_per_replica": B,
        "global_batch": B * world,
        "dp": world,
        "grad_sync": "cpp" if pre else policy,
        "bucket_mb": mb if policy == "buckets" and not pre else None,
        "broadcast_buffers": bool(bcast),
        "fsdp_shard_size": shard or None,  # FSDP's shard group (world, or HSDP's N); None: off
        # (no list of allreduce sizes: they follow --grad-sync and --bucket-mb, which compare
        # treats as how the same work is done; the header and the dry run list them)
        "compute": args.compute,
        "cpp_forward_us": fwd_us if pre else None,
        "cpp_backward_us": bwd_us if pre else None,
        "optimizer": "sgd-momentum",
        "lr": args.lr,
        "momentum": args.momentum,
        "weight_decay": args.weight_decay,
        "seed": args.seed,
        "iters": args.iters,
        "warmup": args.warmup,
        "check": args.check,
        "allreduce": args.allreduce,
        "device_tflops": args.device_tflops,
    }
    if shard:
        units = [u for u, _, _ in shard_units(cfg, shard)]
        sizes = [u.padded(shard) for u in units]  # the header lists the units' gathers
    header = describe(args, model, pre, B, world, policy, mb, sizes, fwd_us, bwd_us)
    if bcast:
        header.insert(
            3,
            f"batch-norm buffers broadcast from rank 0 before each forward (DDP's "
            f"broadcast_buffers): {bcast[0]:,} floats and {bcast[1]} int64 counters",
        )
    return runner.Job(
        prog=PROG,
        proxy="resnet",
        config=config,
        grid=grid,
        plan=plan,
        group_names=("dp", "fsdp", "hsdp"),
        label=lambda rank: "replica",
        header=header,
        runtime=runtime,
        dtypes=cli.wire_dtypes(args),
        grad_categories=frozenset({"dp_allreduce", "fsdp_reduce_scatter", "hsdp_allreduce"}),
        fp32_buffers=frozenset({"bn_stats"}),  # DDP broadcasts buffers in their own dtype
        memory=lambda rank, plan: estimate_memory(cfg, B, args.compute, plan, shard),
        categories=SPEC.categories,
        short=SPEC.short,
    )


def describe(args, model, pre, B, world, policy, mb, sizes, fwd_us, bwd_us) -> list[str]:
    S = model.image_size
    head = (
        f"[bold]{PROG}[/] · {args.model}: bottleneck blocks {'-'.join(map(str, model.blocks))}"
        f", widths {'-'.join(map(str, model.widths))}, {S}x{S} images, {model.classes} "
        f"classes · {model.num_params:,} parameters"
    )
    grid = f"grid: {world} data-parallel replica(s) x {B} images = global batch {B * world}"
    if pre is not None and args.compute in ("real", "replay"):
        sync = (
            f"the C++ proxy's {pre.source} sizes: {len(pre.sizes)} buckets, each allreduced "
            "non-blocking once the backward has completed its last tensor"
        )
    elif pre is not None:
        kind = "blocking, after the backward" if pre.blocking else "non-blocking, one after "
        kind += "" if pre.blocking else f"each tenth of the backward ({bwd_us:g} us each)"
        sync = (
            f"the C++ proxy's {pre.source}: {len(pre.sizes)} allreduces, {kind}; "
            f"forward {fwd_us:g} us (A100)"
            if pre.forward_us or pre.scaled
            else f"the C++ proxy's {pre.source}: {len(pre.sizes)} allreduces, {kind}"
        )
    elif policy == "fsdp":
        sync = (
            f"{fsdp_text(world, args.fsdp_shard_size)}: {len(sizes)} units (stem, blocks, "
            "head), each all-gathered before its forward and its backward, reduce-scattered "
            "after its backward"
        )
    elif world == 1:
        sync = "gradients: no allreduce on 1 rank"
    elif policy == "buckets":
        sync = f"gradients: {len(sizes)} bucket(s) of <= ~{mb:g} MiB posted during backward"
    else:
        sync = f"gradients: {policy}, {len(sizes)} allreduce(s) after the backward"
    if sizes:
        shown = ", ".join(f"{n:,}" for n in sizes[:12]) + (", ..." if len(sizes) > 12 else "")
        sync += f" · {'padded units' if policy == 'fsdp' else 'floats'}: {shown}"
    return [
        head,
        grid,
        sync,
        f"SGD lr {args.lr:g} momentum {args.momentum:g} weight decay {args.weight_decay:g} · "
        f"iterations {args.warmup} warm-up + {args.iters} timed",
    ]


def main(argv: list[str] | None = None) -> int:
    return runner.main(make_job, parser(), argv)


def entry() -> None:
    cli.run_main(PROG, main)
