"""The CosmoFlow proxy's header and its --dry-run derivation: every message size of one
iteration from the layer shapes, so a reader can check the plan by hand."""

from __future__ import annotations

from proxies.cosmoflow.config import CosmoFlowConfig, K, Shards, halos


def describe(
    prog: str, cfg: CosmoFlowConfig, shards: Shards, dp: int, B: int, G: int, args
) -> list[str]:
    """The run header: model, grid, compute, and what the messages are."""
    D, H, W = cfg.volume
    d, h, w = shards.local(cfg.volume)
    S = shards.size
    world = S * dp
    conv = "-".join(map(str, cfg.filters))
    fwd = [sum(x.count for x in halos(cfg, shards, 0, l, "forward", B)) for l in range(2)]
    fwd_halo = [f"conv{l} {n:,}" if n else f"conv{l} none" for l, n in enumerate(fwd)]
    if args.compute == "model":
        how = (
            "the C++ proxy's per-layer A100 times scaled by FLOPs"
            if args.layer_times == "a100"
            else f"FLOPs / {args.device_tflops:g} TFLOP/s"
        )
        compute = f"compute model: {how}"
    else:
        compute = f"compute {args.compute}"
    dense_n = sum(cfg.dense_params(k, S) for k in range(len(cfg.dense)))
    if cfg.dense_mode == "split":
        dense = f"dense layers split by columns: allgather / reduce-scatter over the {S} shard(s)"
        grads = f"shard 0's dense slice ({dense_n:,} floats) over {dp} replica(s)"
    else:
        dense = f"dense layers replicated: one allgather of the conv output over {S} shard(s)"
        grads = f"the dense layers ({dense_n:,} floats) over all {world} rank(s), / {S}"
    return [
        f"[bold]{prog}[/] · {args.model}: {D}x{H}x{W} x {cfg.in_channels} input, conv {conv} "
        f"(kernel {K}, each + 2x2x2 max-pool), dense {'-'.join(map(str, cfg.dense))} · "
        f"{cfg.num_params:,} parameters",
        f"grid: {S} spatial shards ({shards}: {d}x{h}x{w} voxels each) x {dp} data-parallel "
        f"(order {args.order}) · global batch {G} = {dp} x {B} · SGD momentum {args.momentum:g}, "
        f"lr {args.lr:g} · {compute}",
        f"messages: halos {cfg.halo} (shard 0, forward floats: {', '.join(fwd_halo)}) · "
        f"{dense} · gradient allreduces non-blocking: conv layers "
        f"over all {world} rank(s), {grads} · iterations {args.warmup} warm-up + "
        f"{args.iters} timed",
    ]


def derivation(cfg: CosmoFlowConfig, shards: Shards, B: int, world: int) -> list[str]:
    """Every message size of one iteration from the layer shapes (float32 elements)."""
    S, dp = shards.size, world // shards.size
    lines = [
        f"[bold]message sizes[/], derived from the layer shapes (B = {B} samples per replica, "
        f"{shards} shards, elements of float32):"
    ]
    for l in range(cfg.layers):
        ci, co = cfg.channels(l)
        d, h, w = shards.local(cfg.extent(l))
        lines.append(
            f"  conv{l}: input {'x'.join(map(str, cfg.extent(l)))} x {ci}, per shard {d}x{h}x{w}"
            f" -> {co} filters -> pool -> {d // 2}x{h // 2}x{w // 2} x {co}; weights "
            f"{K}^3*{ci}*{co} + {co} = {cfg.conv_params(l):,} -> allreduce over {world} ranks"
        )
        for phase in ("forward", "backward"):
            seen = {}
            for s in range(S):
                for x in halos(cfg, shards, s, l, phase, B):
                    seen.setdefault((x.kind, x.count), x)
            for (kind, count), x in seen.items():
                lines.append(
                    f"    halo {phase} {kind}: {x.why}: "
                    + " x ".join(map(str, x.factors))
                    + f" = {count:,}"
                )
    F = cfg.features
    fd = "x".join(map(str, cfg.extent(cfg.layers)))
    split = cfg.dense_mode == "split"
    for k in range(len(cfg.dense)):
        i, o = cfg.dense_io(k)
        what = f"conv output {fd} x {cfg.filters[-1]} = {F:,}" if k == 0 else f"dense{k - 1}"
        if not split:
            msgs = "computed whole on every shard, no messages"
            if k == 0 and S > 1:
                msgs = (
                    f"allgather of the conv output B*F/S = {B} x {F:,} / {S} = {B * F // S:,} "
                    f"per shard (whole {B * F:,}); its gradient needs none (every shard has it)"
                )
            lines.append(
                f"  dense{k}: input {i:,} ({what}); all {o} columns on every shard: "
                f"({i:,} + 1) x {o} = {(i + 1) * o:,} weights; {msgs}"
            )
            continue
        if k == 0:
            gather = f"B*I/S = {B} x {i:,} / {S} = {B * i // S:,} per shard"
        else:  # the previous layer's column slices, whole columns of B samples
            gather = f"B x dense{k - 1}'s columns per shard: {_spread(B, i, S)}"
        lines.append(
            f"  dense{k}: input {i:,} ({what}); {o} columns over {S} shards "
            f"({_spread(1, o, S)}), weights (I + 1) x columns: {_spread(i + 1, o, S)}; "
            f"allgather of the input, {gather} (whole {B * i:,}), reduce-scatter of its "
            f"gradient the same"
        )
    nd = len(cfg.dense)
    if split:
        per = [sum(cfg.dense_params(k, S, s) for k in range(nd)) for s in range(S)]
        sizes = " / ".join(f"{n:,}" for n in sorted(set(per), reverse=True))
        lines.append(
            f"  dense gradients per shard: {sizes} -> one allreduce over the {dp} replicas "
            "holding the same slice"
        )
    else:
        total = sum(cfg.dense_params(k) for k in range(nd))
        lines.append(
            f"  dense gradients: {total:,} on every rank -> one allreduce over all {world} "
            f"ranks (as the reference's Horovod), the sum scaled by 1/{S} (S copies per replica)"
        )
    return lines


def _spread(unit: int, n: int, S: int) -> str:
    """How n columns (x unit elements each) spread over S shards, the larger blocks first."""
    q, r = divmod(n, S)
    if not r:
        return f"{unit * q:,} each"
    first = "shard 0" if r == 1 else f"shards 0-{r - 1}"
    rest = f"shard {r}" if r == S - 1 else f"shards {r}-{S - 1}"
    return f"{unit * (q + 1):,} on {first}, {unit * q:,} on {rest}"
