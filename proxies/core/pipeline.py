"""One rank's pipeline schedule (schedules.py) -> plan ops: compute and p2p batches.

Letters as in schedules.py: pp stages, v model chunks per rank, m micro-batches; vs = c*pp + s
is the virtual stage of chunk c on stage s. Virtual stage 0 holds the embedding (no input
activation), virtual stage v*pp - 1 the loss (no output gradient to receive).

What each action needs and produces:
    F(c, mb): recv "act_in" from vs-1 unless vs = 0;  send "act_out" to vs+1 unless vs is last
    B(c, mb): recv "grad_out" from vs+1 unless last;  send "grad_in" to vs-1 unless vs = 0

Placement. The actions are cut into steps; a step's receives are posted just before it and its
sends just after it. As in Megatron-LM, a step is one action for v = 1 (1F1B, GPipe); for
v > 1 (interleaved) each steady-state (forward, backward) pair after the warm-up is one step:
Megatron runs the two back to back and then exchanges with both neighbours at once
(send_forward_backward_recv_forward_backward). Sending between F and B instead deadlocks
(pp = 2, m = 4, v = 2): stage 0 blocks sending a gradient that stage 1 takes only after its
next forward, while stage 1 blocks sending a gradient that stage 0 takes after its next one.
Where the warm-up is the whole schedule (m*v forwards, e.g. m = pp) there are no pairs.

Fusion: everything between two consecutive steps is ONE P2P batch, sends first. That is
Megatron's send_forward_recv_backward / send_backward_recv_forward: in steady 1F1B stage s
sends F's output to s+1 and waits for a gradient from s+1 while s+1 sends that gradient and
waits for the activation; as two separate blocking steps each side would wait on the other.

Tags: tag = (2*(mb*v + c) + d) mod 32767 + 1, with d = 0 for activations (forward) and 1 for
gradients (backward), c the SENDING side's chunk. Between two ranks, (d, c, mb) names one
message of the iteration, so tags are unique per channel while 2*m*v <= 32767, and always in
1..32767 (MPI guarantees tags up to 32767). Past that they wrap; messages on a channel are
still posted in the same order on both sides, so MPI's non-overtaking rule pairs them right.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .plan import P2P, Compute, Msg, Op
from .schedules import Action, interleaved_warmup

MAX_TAG = 32767  # the minimum MPI_TAG_UB the MPI standard guarantees
FORWARD, BACKWARD = 0, 1  # direction of a message: activations / activation gradients
_NAMES: dict[frozenset, str] = {}  # kinds of message in a batch -> its name (p2p_batch)


def p2p_tag(direction: int, chunk: int, mb: int, v: int) -> int:
    """Tag of the message of `direction` sent by model chunk `chunk` for micro-batch `mb`."""
    return (2 * (mb * v + chunk) + direction) % MAX_TAG + 1


def steps(actions: Sequence[Action], warmup: int | None) -> list[list[Action]]:
    """Cut actions into steps: one action each, except the steady state when `warmup` is given:
    the (F, B) pairs that follow the first `warmup` actions are one step each."""
    if warmup is None:
        return [[a] for a in actions]
    out = [[a] for a in actions[:warmup]]
    i = len(out)
    while i + 1 < len(actions) and actions[i].kind == "F" and actions[i + 1].kind == "B":
        out.append([actions[i], actions[i + 1]])
        i += 2
    return out + [[a] for a in actions[i:]]


def pipeline_ops(
    actions: list[Action],
    stage: int,
    pp_ranks: Sequence[int],
    v: int,
    act_count: int,
    dtype: str = "float32",
    flops: Callable[[str, int], float] | None = None,
    warmup: int | None = None,
) -> list[Op]:
    """The ops of one rank: computes for `actions`, with the p2p batches between them.

    pp_ranks[s] is the world rank of stage s of this rank's pipeline; every message has
    act_count elements of dtype. flops(name, chunk), name "forward" or "backward", gives the
    Compute ops' flops. With `warmup` given, the (F, B) pairs after the first `warmup`
    actions are one step each, with no communication between F and B. Default, as Megatron:
    for v > 1 the interleaved schedule's warm-up count, for v = 1 no pairs.
    """
    pp = len(pp_ranks)
    if not 0 <= stage < pp:
        raise ValueError(f"stage = {stage} is not in 0..{pp - 1} (pp_ranks has {pp} ranks)")
    if v < 1:
        raise ValueError(f"v = {v} model chunks per rank: must be >= 1")
    if warmup is None and v > 1:
        m = sum(a.kind == "F" for a in actions) // v
        warmup = interleaved_warmup(pp, m, stage, v)
    last = v * pp - 1
    comm = pp > 1  # with one stage every virtual stage is local: nothing to send
    ops: list[Op] = []
    sends: list[tuple[str, Msg]] = []
    recvs: list[tuple[str, Msg]] = []

    def msg(other_vs: int, direction: int, sender_chunk: int, buf: str, a: Action) -> Msg:
        tag = p2p_tag(direction, sender_chunk, a.mb, v)
        return Msg(pp_ranks[other_vs % pp], tag, buf, a.mb, act_count, dtype, a.chunk)

    for step in steps(actions, warmup):
        for a in step:  # receive the inputs of the step
            if not 0 <= a.chunk < v:
                raise ValueError(f"action {a} has chunk {a.chunk}, not in 0..{v - 1}")
            vs = a.chunk * pp + stage
            if comm and a.kind == "F" and vs > 0:
                src = vs - 1
                recvs.append(("recv_forward", msg(src, FORWARD, src // pp, "act_in", a)))
            if comm and a.kind == "B" and vs < last:
                src = vs + 1
                recvs.append(("recv_backward", msg(src, BACKWARD, src // pp, "grad_out", a)))
        if sends or recvs:
            ops.append(p2p_batch(sends, recvs))
            sends, recvs = [], []
        for a in step:  # compute, then send the outputs
            vs = a.chunk * pp + stage
            name = "forward" if a.kind == "F" else "backward"
            work = float(flops(name, a.chunk)) if flops is not None else 0.0
            ops.append(Compute(name, a.mb, a.chunk, work))
            if comm and a.kind == "F" and vs < last:
                sends.append(("send_forward", msg(vs + 1, FORWARD, a.chunk, "act_out", a)))
            if comm and a.kind == "B" and vs > 0:
                sends.append(("send_backward", msg(vs - 1, BACKWARD, a.chunk, "grad_in", a)))
    if sends:
        ops.append(p2p_batch(sends, recvs))
    return ops


def p2p_batch(sends: Sequence[tuple[str, Msg]], recvs: Sequence[tuple[str, Msg]]) -> P2P:
    """One batch named as Megatron's p2p_communication names it, from its content.

    "send_forward_recv_backward", "send_backward_recv_forward", "send_forward_recv_forward",
    "send_forward_backward_recv_forward_backward" (both directions each way) ...
    """
    kinds = {k for k, _ in sends} | {k for k, _ in recvs}
    name = _NAMES.get(frozenset(kinds))
    if name is None:
        parts = []
        for verb in ("send", "recv"):
            ways = [w for w in ("forward", "backward") if f"{verb}_{w}" in kinds]
            if ways:
                parts.append(f"{verb}_" + "_".join(ways))
        name = _NAMES[frozenset(kinds)] = "_".join(parts)
    return P2P(name, tuple(m for _, m in sends), tuple(m for _, m in recvs))
