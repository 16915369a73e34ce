"""The C++ GPT-2 proxy's iteration, message for message: `--schedule cpp` (any preset) and
`--model dnn-cpp-proxies` (its sizes and that schedule).

Source: spcl/DNN-cpp-proxies, proxies/comm_only/gpt2_large.cpp (gpt2_large.cpp at the
repository root before it moved there), with MSGAGG defined as it is there. One iteration
(its run_pipeline) of pipeline stage s, each step a blocking wait before the next:

- forward, micro-batch i = 0 .. M-1: stage 0 sends activation i to stage 1, the last stage
  receives activation i from its predecessor, a middle stage does both at once (MPI_Isend
  to s+1 and MPI_Irecv from s-1 for the same i, then MPI_Waitall);
- backward, i = 0 .. M-1: the mirror image (gradients go to s-1, come from s+1);
- if the data-parallel group has more than one rank: one blocking MPI_Allreduce per layer of
  the stage, in forward layer order. Stage 0's first message carries wte and wpe with its
  layer (85,317,120 floats at GPT-2-large widths), the last stage's last carries wte and
  ln_f with its layer (84,008,960), every other one layer (19,677,440). There is no
  allreduce of the tied embedding between the first and the last stage.

It computes and sleeps nothing (the file lives under comm_only/; the A100 sleeps and the
"1F1B" line of the suite are in its GPT-3 proxy), so neither does this mode. The activation
is B x T x C floats: 808,960 at B = 1, T = 632, C = 1280.

Not copied: the C++ proxy gives every stage LAYERS // STAGES layers and drops the rest; here
every layer is kept (proxy.split_layers: the first LAYERS % STAGES stages take one more). Its
parameter counts are 32-bit ints (the printed total wraps from 103 layers on); ours are Python
ints. With one stage it would send to a rank its pipeline communicator does not have; here a
one-stage pipeline sends nothing and its only stage carries wte + wpe in its first message
and ln_f in its last (the C++ stage-0 branch would leave ln_f out).
"""

from __future__ import annotations

from collections.abc import Sequence

from proxies.core import cli
from proxies.core.pipeline import BACKWARD, FORWARD, p2p_batch, p2p_tag
from proxies.core.plan import Collective, Msg, Op, Span
from proxies.transformer.config import GPT2Config
from proxies.transformer.setup import Setup

PRESET = "dnn-cpp-proxies"  # --model: the C++ proxy's sizes, as cosmoflow's and dlrm's
WIDTHS = "gpt2-large"  # its widths: C = 1280, 20 heads, V = 50257, context 1024
# The C++ proxy's fixed sizes (P2PSIZE = 1 x 632 x 1280) and its only compute: none.
PRESET_DEFAULTS = {"seq_len": 632, "micro_batch": 1, "schedule": "cpp", "compute": "none"}


def layer_messages(cfg: GPT2Config, layers: range, first: bool, last: bool) -> list[int]:
    """Element counts of a stage's data-parallel allreduces, in the C++ proxy's order: one
    per layer, in forward order; the first stage's first also holds wte and wpe, the last
    stage's last wte (unless the stage is also first: one copy) and ln_f."""
    C, V = cfg.n_embd, cfg.vocab_size
    counts = [cfg.layer_params] * len(layers)
    if first:
        counts[0] += V * C + cfg.max_seq_len * C
    if last:
        counts[-1] += (0 if first else V * C) + 2 * C
    return counts


def cpp_ops(S: Setup, stage: int, pp_ranks: Sequence[int]) -> list[Op]:
    """One iteration of one rank, as run_pipeline in gpt2_large.cpp (see the module doc).

    Buffers: "act_out"/"act_in"/"grad_in"/"grad_out" per micro-batch as the pipeline's
    (proxies.core.pipeline), and Span("grads", LO, HI) for the allreduces: consecutive ranges of the
    stage's flat gradient buffer, whose size equals the sum of the messages, so the runtime
    of --compute none serves them unchanged."""
    cfg, layers, m, act, dp = S.cfg, S.split[stage], S.m, S.act, S.dp
    pp = len(pp_ranks)
    first, last = stage == 0, stage == pp - 1
    ops: list[Op] = []
    if pp > 1:
        nxt, prev = (pp_ranks[stage + d] if 0 <= stage + d < pp else None for d in (1, -1))
        for direction, way, to, frm in (
            (FORWARD, "forward", nxt, prev),
            (BACKWARD, "backward", prev, nxt),
        ):
            out, inp = ("act_out", "act_in") if direction == FORWARD else ("grad_in", "grad_out")
            for i in range(m):
                tag = p2p_tag(direction, 0, i, 1)
                sends = [(f"send_{way}", Msg(to, tag, out, i, act))] if to is not None else []
                recvs = [(f"recv_{way}", Msg(frm, tag, inp, i, act))] if frm is not None else []
                ops.append(p2p_batch(sends, recvs))
    if dp > 1:
        lo = 0
        for count in layer_messages(cfg, layers, first, last):
            ops.append(Collective("allreduce", "dp", Span("grads", lo, lo + count), count))
            lo += count
    return ops


def resolve(args) -> None:
    """Fill the options left unset (None) from the preset and schedule, and refuse what the
    C++ proxy's iteration cannot do: one line each, exit status 2 (cli.UsageError)."""
    preset = args.model == PRESET
    for name, value in PRESET_DEFAULTS.items():
        if getattr(args, name) is None and preset:
            setattr(args, name, value)
    defaults = {"seq_len": 64, "micro_batch": 1, "schedule": "1f1b"}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    cpp = args.schedule == "cpp"
    if args.compute is None:
        args.compute = "none" if cpp else "real"
    if not cpp:
        if args.grad_sync is None:
            args.grad_sync = "fused"
        return
    if args.compute != "none":
        raise cli.UsageError(
            f"--schedule cpp is the C++ GPT-2 proxy's iteration, which computes and sleeps "
            f"nothing (comm_only/gpt2_large.cpp) and has no tied-embedding allreduce, so the "
            f"two wte copies would not train one model: --compute {args.compute} needs "
            f"--schedule gpipe or 1f1b; here use --compute none"
        )
    for flag, bad in (
        ("--grad-sync", args.grad_sync is not None),
        ("--bucket-mb", args.bucket_mb is not None),
        ("--zero", args.zero != 0),
        ("--data", args.data is not None),
    ):
        if bad:
            raise cli.UsageError(
                f"{flag} does not apply to --schedule cpp: the C++ proxy allreduces one "
                "message per layer after the pipeline and trains nothing"
            )
    args.grad_sync = "per-layer"
