"""The CosmoFlow proxy: spatial (model) x data parallelism on a 3D CNN.

    mpirun -n 8 python -m proxies.cosmoflow --shards 4    # 2 data-parallel x 4 spatial shards

Each rank holds one spatial shard (an H x W tile of every volume, D whole) of one
data-parallel replica, as the C++ proxy (spcl/DNN-cpp-proxies): shard = rank % shards. One
iteration, as that proxy orders it:

    forward   data; for each conv layer: halo exchange with the neighbours, conv (conv0's
              halo is the input volume's: exact halos only, the C++ proxy has none)
              for each dense layer: allgather its input over the shards, dense
    backward  for each dense layer, last first: dense backward, reduce-scatter of its input
              gradient; then the dense gradients (one fused buffer, as the C++ proxy) start
              their allreduce over the replicas, non-blocking
              for each conv layer, last first: weight gradient, its allreduce over all ranks
              starts (non-blocking), halo exchange of the output gradient, input gradient
    then      wait for every allreduce; SGD with momentum

The messages are the C++ proxy's; one order differs: it starts a conv layer's allreduce after
that layer's backward halo exchange, we start it as soon as the weight gradient exists.
Dense widths that the shards do not divide are split unevenly (Allgatherv / Reduce_scatter
in whole columns of B samples). --dense replicate (the MLPerf HPC spatial-parallel
reference's scheme) allgathers only the conv output, runs every dense layer whole on every
shard (no reduce-scatter) and allreduces the dense gradients over all ranks.

The non-blocking allreduces run under the rest of backward; the engine polls them between
ops (the C++ proxy's MPI_Testany) and reports what finished under other work as
`<category>_hidden` and what the final waits blocked for as `<category>`.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from proxies.core import check, cli, pages, runner
from proxies.core.grads import Flat, GradSync, Unit
from proxies.core.grid import ProcessGrid
from proxies.core.plan import P2P, Collective, Compute, Msg, Plan
from proxies.cosmoflow import SPEC
from proxies.cosmoflow.config import (
    CPP_BWD_US,
    CPP_FWD_US,
    CPP_REFERENCE,
    CPP_SHARDS,
    DENSE_MODES,
    DIR_NAMES,
    PRESETS,
    CosmoFlowConfig,
    K,
    Shards,
    halos,
    opposite,
    parse_shards,
    validate,
)
from proxies.cosmoflow.describe import derivation, describe
from proxies.cosmoflow.memory import estimate as estimate_memory

PROG = "proxies.cosmoflow"
DEFAULT_MODEL = "cosmoflow-tiny"
PHASES = ("forward", "backward")
ORDERS = ("sp-dp", "dp-sp")


def parser() -> argparse.ArgumentParser:
    p = cli.Parser(
        prog=f"python -m {PROG}",
        description="CosmoFlow training proxy: each volume split over spatial shards (halo "
        "exchange per conv layer, dense layers spread over the shards), data parallelism over "
        "the rest of the ranks, gradient allreduces overlapped with backward.",
    )
    p.add_argument(
        "--model",
        choices=sorted(PRESETS),
        default=DEFAULT_MODEL,
        help="cosmoflow: MLPerf HPC (128^3 x 4, conv 32..512, dense 128-64-4); "
        "dnn-cpp-proxies: the same with the C++ proxy's message sizes and A100 layer times; "
        "cosmoflow-tiny: 32^3, conv 4-8-16, dense 16-6-4, for tests and CI (the default)",
    )
    p.add_argument(
        "--shards",
        default="4",
        metavar="N|PYxPX",
        help="spatial shards per replica: a count (4 -> 2x2, 8 -> 2x4) or a split of H x W "
        "(1x4); data-parallel degree = world size / shards (default 4: 2x2, as the C++ proxy)",
    )
    p.add_argument(
        "--global-batch",
        type=cli.positive_int,
        metavar="G",
        help="samples per iteration over all replicas, a multiple of the replicas (default: "
        "the preset's batch per replica x replicas: 8 for the 128^3 presets, as the C++ "
        "proxy, 2 for cosmoflow-tiny)",
    )
    p.add_argument(
        "--order",
        choices=ORDERS,
        default="sp-dp",
        help="rank order, fastest first (default sp-dp: shard = rank %% shards, as the C++ "
        "proxy; dp-sp: the shards of a replica are far apart)",
    )
    p.add_argument(
        "--dense",
        choices=DENSE_MODES,
        default="split",
        help="dense layers: split = output columns over the shards, allgather of the input and "
        "reduce-scatter of its gradient per layer (the C++ proxy's; uneven when the shards do "
        "not divide a width; the default); replicate = every shard runs them whole after one "
        "allgather of the conv output (the MLPerf HPC spatial-parallel reference's)",
    )
    p.add_argument(
        "--lr",
        type=cli.learning_rate,
        default=1e-3,
        help=f"SGD learning rate, in (0, {cli.LR_MAX:g}] (default 0.001, the MLPerf "
        "reference's base rate)",
    )
    p.add_argument(
        "--momentum",
        type=cli.momentum,
        default=0.9,
        help="SGD momentum, in [0, 1) (default 0.9, as MLPerf)",
    )
    p.add_argument(
        "--layer-times",
        choices=("a100", "flops"),
        default="a100",
        help="--compute model: a100 = the C++ proxy's per-layer A100 times, scaled by each "
        "layer's FLOPs relative to its configuration (so exactly its times there; the "
        "default); flops = FLOPs / --device-tflops",
    )
    cli.add_common(
        p,
        compute=None,  # resolved per preset in make_job
        compute_help=(
            "real: the NumPy kernels (conv3d, pooling, dense, with backward) on real data; "
            "replay: each compute op timed once with the real kernels, ranks on a node "
            "taking turns, then slept; model: sleep per-layer times (see --layer-times); "
            "none: communication only (default: real for cosmoflow-tiny, model for the "
            "128^3 presets)"
        ),
    )
    return p


# -- sizes and times -----------------------------------------------------------------------


def tag(l: int, phase: str, k: int) -> int:
    """Halo tag: conv layer, phase and the sender's direction (below 32768 for l < 1000)."""
    return 16 * (2 * l + PHASES.index(phase)) + k


def conv_flops(cfg: CosmoFlowConfig, shards: Shards, l: int, B: int) -> float:
    """One pass (forward, weight gradient or input gradient) of conv layer l on one shard:
    2 per multiply-add, 27 Ci Co per output voxel."""
    d, h, w = shards.local(cfg.extent(l))
    ci, co = cfg.channels(l)
    return 2.0 * B * d * h * w * K**3 * ci * co


def dense_flops(cfg: CosmoFlowConfig, shards: Shards, k: int, B: int, s: int = 0) -> float:
    """Forward of dense layer k's columns on shard s (backward is twice this)."""
    lo, hi = cfg.dense_columns(k, shards.size, s)
    return 2.0 * B * cfg.dense_io(k)[0] * (hi - lo)


def a100_seconds(cfg: CosmoFlowConfig, shards: Shards, B: int, s: int = 0) -> dict[str, float]:
    """Per compute op: the C++ proxy's A100 time of the same layer, scaled by FLOPs relative
    to its configuration (batch 8, 2x2 shards, 128^3): its exact times there. Its conv
    backward (one number, 2 x forward) is split evenly between the weight and the input
    gradient; conv0 has no input gradient and keeps its whole backward time. Dense layers:
    shard s's columns."""
    ref, rs, rb = CPP_REFERENCE, Shards(*CPP_SHARDS), 8
    out = {}
    for l in range(cfg.layers):
        r = min(l, ref.layers - 1)  # deeper than the reference: its last layer's rate
        ratio = conv_flops(cfg, shards, l, B) / conv_flops(ref, rs, r, rb)
        bwd = CPP_BWD_US[len(ref.dense) + ref.layers - 1 - r] * 1e-6 * ratio
        out[f"conv{l}.forward"] = CPP_FWD_US[r] * 1e-6 * ratio
        out[f"conv{l}.backward_weights"] = bwd if l == 0 else bwd / 2
        if l:
            out[f"conv{l}.backward_data"] = bwd / 2
    nd = len(ref.dense)
    for k in range(len(cfg.dense)):
        r = min(k, nd - 1)
        ratio = dense_flops(cfg, shards, k, B, s) / dense_flops(ref, rs, r, rb)
        out[f"dense{k}.forward"] = CPP_FWD_US[ref.layers + r] * 1e-6 * ratio
        out[f"dense{k}.backward"] = CPP_BWD_US[nd - 1 - r] * 1e-6 * ratio
    return out


# -- the runtime (buffers and real compute) ------------------------------------------------


class CosmoFlowRuntime:
    """Buffers and compute of one rank: a ShardModel for real/replay compute, plain buffers
    of the plan's sizes for model/none. Buffers are allocated from the plan itself."""

    def __init__(
        self,
        cfg: CosmoFlowConfig,
        shards: Shards,
        s: int,
        d: int,
        B: int,
        G: int,
        plan: Plan,
        mode: str,
        seed: int = 0,
        lr: float = 1e-3,
        momentum: float = 0.9,
        dtype=np.float32,
    ):
        self.cfg, self.shards, self.s, self.d, self.B, self.G = cfg, shards, s, d, B, G
        self.seed, self.lr, self.momentum, self.dtype = seed, lr, momentum, dtype
        self.model = None
        S = shards.size
        if mode in ("real", "replay"):
            from proxies.cosmoflow.model import ShardModel

            self.model = ShardModel(cfg, shards, s, B, seed=seed, dtype=dtype)
        bufs: dict[str, np.ndarray] = {}
        for _, m, _ in plan.messages():
            bufs[m.buf] = pages.zeros(m.count, dtype)
        for k in range(len(cfg.dense)):
            i = cfg.dense_io(k)[0]
            bufs[f"dense{k}.in"] = pages.zeros(B * i, dtype)  # whole: S blocks of B * i / S
            bufs[f"dense{k}.din"] = pages.zeros(B * i, dtype)
        m = self.model
        for l in range(cfg.layers):
            bufs[f"conv{l}.grads"] = m.conv_g[l] if m else pages.zeros(cfg.conv_params(l), dtype)
        n = sum(cfg.dense_params(k, S, s) for k in range(len(cfg.dense)))
        bufs["dense.grads"] = m.dense_g if m else pages.zeros(n, dtype)
        self.bufs = bufs
        # Halo messages per (layer, phase): (direction, send buffer, recv buffer).
        self.halo = {
            (l, ph): [
                (h.k, bufs[halo_buf(l, ph, h.k, "to")], bufs[halo_buf(l, ph, h.k, "from")])
                for h in halos(cfg, shards, s, l, ph, B)
            ]
            for l in range(cfg.layers)
            for ph in PHASES
        }
        # Each shard's (B, columns) block of a dense layer's gathered output, in shard order.
        self.widths = [
            [hi - lo for lo, hi in (cfg.dense_columns(k, S, t) for t in range(S))]
            for k in range(len(cfg.dense))
        ]
        self.replicate = cfg.dense_mode == "replicate"
        self.loss_sum, self.loss_count = 0.0, 0

    def buffer(self, name: str, mb: int, chunk: int) -> np.ndarray:
        return self.bufs[name]

    def _block(self, name: str, unit: int = 1) -> np.ndarray:
        """This shard's block of a whole allgather / reduce-scatter buffer (as the engine
        splits it: whole units of `unit` elements)."""
        return check.blocks(self.bufs[name], self.shards.size, unit)[self.s]

    def compute(self, op: Compute, iteration: int) -> None:
        from proxies.cosmoflow import model as M

        m, cfg, S = self.model, self.cfg, self.shards.size
        L, last = cfg.layers, len(cfg.dense) - 1
        layer, _, step = op.name.partition(".")
        if op.name == "data":
            first = iteration * self.G + self.d * self.B  # global sample index
            tile = m.load([M.sample(cfg, self.seed, first + b, self.dtype) for b in range(self.B)])
            for k, send, _ in self.halo[(0, "forward")]:  # what the neighbours' conv0 needs
                M.pack_face(send, tile, k)
        elif op.name == "optimizer":
            m.step(self.lr, self.momentum, 1.0 / S if self.replicate else 1.0)
            m.zero_grad()
        elif layer.startswith("conv") and step == "forward":
            l = int(layer[4:])
            for k, _, recv in self.halo[(l, "forward")]:
                M.unpack_face(m.x_pad[l], recv, k)
            out = m.conv_forward(l)
            if l + 1 < L:  # the next layer's input, and the faces its neighbours need
                d, h, w = m.local[l + 1]
                m.x_pad[l + 1][:, 1 : d + 1, 1 : h + 1, 1 : w + 1] = out
                for k, send, _ in self.halo[(l + 1, "forward")]:
                    M.pack_face(send, out, k)
            else:
                self._block("dense0.in")[...] = out.reshape(-1)
        elif layer.startswith("dense") and step == "forward":
            k = int(layer[5:])
            whole = self.bufs[f"dense{k}.in"]
            if k == 0:
                inp = M.features_from_blocks(whole, self.shards, m.conv_out_local)
            elif self.replicate:  # the previous layer's whole output, here already
                inp = m.d_out[k - 1]
            else:
                inp = M.columns_from_blocks(whole, self.widths[k - 1], self.B)
            out = m.dense_forward(k, inp)
            if k < last:
                if not self.replicate:
                    self._block(f"dense{k + 1}.in", self.B)[...] = out.reshape(-1)
            else:
                # The mean over the global batch and the outputs; the gradients' sum over
                # the replicas is then the gradient of the global loss. Replicated, every
                # shard of a replica has the same loss: shard 0's counts.
                loss = m.loss(1.0 / (cfg.dense[-1] * self.G))
                if not self.replicate or self.s == 0:
                    self.loss_sum += loss
                self.loss_count += self.s == 0 and self.d == 0
        elif layer.startswith("dense") and step == "backward":
            k = int(layer[5:])
            if k == last:
                dout = None
            elif self.replicate:  # the next layer's whole input gradient: no reduce-scatter
                dout = m.d_dinp[k + 1]
            else:
                dout = self._block(f"dense{k + 1}.din", self.B)
            dinp = m.dense_backward(k, dout)
            if k == 0:
                M.blocks_from_features(self.bufs["dense0.din"], dinp, self.shards, m.conv_out_local)
            elif not self.replicate:
                M.blocks_from_columns(self.bufs[f"dense{k}.din"], dinp, self.widths[k - 1])
        elif layer.startswith("conv") and step == "backward_weights":
            l = int(layer[4:])
            dpooled = self._block("dense0.din") if l == L - 1 else m.dx[l + 1]
            dy = m.conv_backward_weights(l, dpooled)
            if l:
                d, h, w = m.local[l]
                m.dy_pad[l][:, 1 : d + 1, 1 : h + 1, 1 : w + 1] = dy
                for k, send, _ in self.halo[(l, "backward")]:
                    M.pack_face(send, dy, k)
        elif layer.startswith("conv") and step == "backward_data":
            l = int(layer[4:])
            for k, _, recv in self.halo[(l, "backward")]:
                M.unpack_face(m.dy_pad[l], recv, k)
            m.conv_backward_data(l)
        else:
            raise ValueError(f"unknown compute op {op.name}")

    def finish_iteration(self, iteration: int) -> tuple[float, int]:
        """(this rank's share of the global mean loss, 1 on rank 0 else 0): their sums over
        the ranks are the loss and 1."""
        out = (self.loss_sum, int(self.loss_count))
        self.loss_sum, self.loss_count = 0.0, 0
        return out


def halo_buf(l: int, phase: str, k: int, way: str) -> str:
    """'conv2.x.to_e' (forward: the input x) or 'conv2.dy.from_n' (backward: the output
    gradient), the direction seen from this shard."""
    return f"conv{l}.{'x' if phase == 'forward' else 'dy'}.{way}_{DIR_NAMES[k]}"


# -- the job -------------------------------------------------------------------------------


def make_job(args, world: int) -> runner.Job:
    cfg = dataclasses.replace(PRESETS[args.model], dense_mode=args.dense)
    try:
        shards = parse_shards(args.shards)
    except ValueError as e:
        raise cli.UsageError(f"--shards: {e}") from None
    if args.compute is None:
        args.compute = cfg.compute
    if cfg.halo == "cpp" and args.compute in ("real", "replay"):
        raise cli.UsageError(
            f"--model {args.model} sends the C++ proxy's halo sizes (forward faces sized before "
            f"pooling, no diagonal neighbours), which cannot carry a sharded convolution's data: "
            f"--compute {args.compute} needs --model cosmoflow; use --compute model or none"
        )
    if cfg.halo == "cpp" and cfg.dense_mode != "split":
        raise cli.UsageError(
            f"--model {args.model} sends the C++ proxy's messages, whose dense layers are split "
            f"over the shards: --dense {cfg.dense_mode} needs --model cosmoflow"
        )
    S = shards.size
    if world % S:
        raise cli.UsageError(
            f"world size {world} is not a multiple of --shards {S} ({shards}): the "
            "data-parallel degree is world size / shards"
        )
    try:
        validate(cfg, shards)
    except ValueError as e:
        raise cli.UsageError(str(e)) from None
    dp = world // S
    G = args.global_batch or cfg.batch * dp
    if G % dp:
        raise cli.UsageError(
            f"--global-batch {G} is not divisible by the {dp} data-parallel replicas "
            f"(world size {world} / {S} shards)"
        )
    B = G // dp
    L, nd = cfg.layers, len(cfg.dense)
    grid = ProcessGrid.create(args.order, sp=S, dp=dp)
    a100 = args.layer_times == "a100"
    times = {s: a100_seconds(cfg, shards, B, s) if a100 else {} for s in range(S)}
    real = args.compute in ("real", "replay")
    split = cfg.dense_mode == "split"

    def halo_op(rank: int, l: int, phase: str) -> P2P | None:
        c = grid.coords(rank)
        s, sends, recvs = c["sp"], [], []
        for h in halos(cfg, shards, s, l, phase, B):
            peer = grid.rank_of(sp=h.shard, dp=c["dp"])
            sends.append(Msg(peer, tag(l, phase, h.k), halo_buf(l, phase, h.k, "to"), 0, h.count))
            recvs.append(
                Msg(peer, tag(l, phase, opposite(h.k)), halo_buf(l, phase, h.k, "from"), 0, h.count)
            )
        if not sends:
            return None
        return P2P(f"halo {phase} conv{l}", tuple(sends), tuple(recvs), category="halo")

    def plan(rank: int) -> Plan:
        c = grid.coords(rank)
        s = c["sp"]

        def compute(name: str, flops: float) -> Compute:
            return Compute(name, flops=flops, seconds=times[s].get(name, 0.0))

        def dense(kind: str, k: int, buf: str) -> Collective:
            """The allgather of dense layer k's input / reduce-scatter of its gradient. Past
            dense0 the blocks are the previous layer's column slices: whole columns of B
            samples (unit B), uneven when the shards do not divide the width."""
            return Collective(kind, "sp", buf, B * cfg.dense_io(k)[0], unit=B if k else 1)

        groups = {
            "sp": grid.group("sp", rank),
            "dp": grid.group("dp", rank),
            "world": tuple(range(world)),
        }
        # Synthetic volumes (category "data") only where the compute is real: the C++ proxy
        # has no data loading.
        ops: list = [Compute("data", category="data")] if real else []
        # forward
        for l in range(L):
            if op := halo_op(rank, l, "forward"):
                ops.append(op)
            ops.append(compute(f"conv{l}.forward", conv_flops(cfg, shards, l, B)))
        for k in range(nd):
            # replicated: only the conv output is gathered, the rest is computed whole here
            if S > 1 and (split or k == 0):
                ops.append(dense("allgather", k, f"dense{k}.in"))
            ops.append(compute(f"dense{k}.forward", dense_flops(cfg, shards, k, B, s)))
        # backward
        for k in reversed(range(nd)):
            ops.append(compute(f"dense{k}.backward", 2 * dense_flops(cfg, shards, k, B, s)))
            if S > 1 and split:
                ops.append(dense("reduce_scatter", k, f"dense{k}.din"))
        # The gradient sync (core/grads.py): every unit on its own (buckets of size 0), each
        # its own array keyed by name. The dense slice: split, over the replicas holding it;
        # replicated, over every rank, as the reference's Horovod allreduce (the optimizer
        # scales the sum by 1/S). The conv layers: over every rank.
        group, members = ("dp", dp) if split else ("world", world)
        n = sum(cfg.dense_params(k, S, s) for k in range(nd))
        flats = []
        if members > 1 and n:
            flats.append(Flat("dense.grads", group, n, "dense_allreduce", whole=True, req="dense"))
        if world > 1:
            flats += [
                Flat(
                    f"conv{l}.grads",
                    "world",
                    cfg.conv_params(l),
                    "conv_allreduce",
                    whole=True,
                    req=f"conv{l}",
                )
                for l in range(L)
            ]
        units = [Unit("dense", (("dense.grads", 0, n),))]
        units += [Unit(l, ((f"conv{l}.grads", 0, cfg.conv_params(l)),)) for l in reversed(range(L))]
        sync = GradSync("buckets", flats, units, bucket=0)
        ops += sync.after(["dense"])
        for l in reversed(range(L)):
            ops.append(compute(f"conv{l}.backward_weights", conv_flops(cfg, shards, l, B)))
            ops += sync.after([l])
            if l:
                if op := halo_op(rank, l, "backward"):
                    ops.append(op)
                ops.append(compute(f"conv{l}.backward_data", conv_flops(cfg, shards, l, B)))
        ops += sync.end()
        return Plan(rank, tuple(ops), groups, c)

    def label(rank: int) -> str:
        s = grid.coords(rank)["sp"]
        si, sj = shards.coords(s)
        return f"shard {s} ({si},{sj})"

    def runtime(rank, MPI, comms, mode, dtype=np.float32):
        c = grid.coords(rank)
        return CosmoFlowRuntime(
            cfg,
            shards,
            c["sp"],
            c["dp"],
            B,
            G,
            plan(rank),
            mode,
            seed=args.seed,
            lr=args.lr,
            momentum=args.momentum,
            dtype=dtype,
        )

    config = {
        "model": args.model,
        "volume": list(cfg.volume),
        "in_channels": cfg.in_channels,
        "filters": list(cfg.filters),
        "dense": list(cfg.dense),
        "kernel": K,
        "params": cfg.num_params,
        "halo": cfg.halo,
        "shards": str(shards),
        "sp": S,
        "dp": dp,
        "order": grid.order,
        "global_batch": G,
        "batch_per_replica": B,
        "compute": args.compute,
        "layer_times": args.layer_times,
        "optimizer": "sgd-momentum",
        "lr": args.lr,
        "momentum": args.momentum,
        "seed": args.seed,
        "iters": args.iters,
        "warmup": args.warmup,
        "check": args.check,
        "allreduce": args.allreduce,
        "device_tflops": args.device_tflops,
    }
    header = describe(PROG, cfg, shards, dp, B, G, args)
    if args.dry_run:
        header += derivation(cfg, shards, B, world)
    return runner.Job(
        prog=PROG,
        proxy="cosmoflow",
        config=config,
        grid=grid,
        plan=plan,
        group_names=("sp", "dp", "world"),
        label=label,
        header=header,
        runtime=runtime,
        dtypes=cli.wire_dtypes(args),
        grad_categories=frozenset({"conv_allreduce", "dense_allreduce"}),
        memory=lambda rank, plan: estimate_memory(
            cfg, shards, grid.coords(rank)["sp"], B, args.compute, plan
        ),
        categories=SPEC.categories,
        short=SPEC.short,
    )


def main(argv: list[str] | None = None) -> int:
    return runner.main(make_job, parser(), argv)


def entry() -> None:
    cli.run_main(PROG, main)
