"""GPT-2's whole-stage operations on StageShard (model.py): a chunk's forward, its backward,
and the backward cut at GPT-2's gradient buckets, each a run of the shard's own pieces.

GPT-2's plans (plan.gpt2_plan) name coarse compute: "forward", "backward" and, for the
last micro-batch under --grad-sync buckets, "backward:<piece>" with the pieces of
config.backward_pieces ("head", "h.<l>" from the top layer down, "embed"), after each of
which the gradients of that piece's ranges are final and go out. With no collective between
the shard's pieces (tp = 1, no expert parallelism), they run back to back:

- "forward": the chunk's forward pieces (fwd_embed, fwd_attn:l, fwd_mlp:l ..., then
  fwd_head and fwd_loss, or fwd_out), as plan.Pieces lists them;
- "backward:head": bwd_head, then ln_f's backward (bwd_settle: the layernorm backward a
  shard piece otherwise leaves to the next one), so ln_f's and wte's gradients are final;
- "backward:h.<l>": layer l's pieces, then its ln_1 backward; the bottom layer's also sends
  the input gradient (bwd_end) on a stage without the embedding;
- "backward:embed": bwd_end (the embedding's backward);
- "backward": all of them.
"""

from __future__ import annotations

from proxies.core.plan import Collective
from proxies.transformer.plan import Pieces


class WholeStage:
    """Mixed into StageShard: runs its pieces through its compute()."""

    def _whole(self, chunk: int) -> tuple[tuple[str, ...], dict[str, list[str]]]:
        """(forward piece names, {GPT-2 backward piece: shard piece names}) of a chunk."""
        known = self.__dict__.setdefault("_whole_of", {})
        if chunk not in known:
            known[chunk] = self._whole_names(chunk)
        return known[chunk]

    def _whole_names(self, chunk: int) -> tuple[tuple[str, ...], dict[str, list[str]]]:
        ch = self.chunks[chunk]
        pieces = Pieces(self.S)
        fwd, bwd = pieces.forward(ch), pieces.backward(ch)
        if any(isinstance(it, Collective) for it in fwd + bwd):
            raise ValueError("whole-stage ops need no collective between pieces (tp = 1, ep = 1)")
        groups: dict[str, list[str]] = {}
        for it in bwd:
            kind, _, layer = it.name.partition(":")
            if kind == "bwd_head":
                groups["head"] = [it.name, f"bwd_settle:{ch.layers[-1] + 1}"]
            elif layer:
                groups.setdefault(f"h.{layer}", []).append(it.name)
            elif ch.embed:  # bwd_end: the embedding's backward
                groups["embed"] = [it.name]
            else:  # bwd_end: the input gradient, after the bottom layer
                groups[f"h.{ch.layers[0]}"] += [f"bwd_settle:{ch.layers[0]}", it.name]
        for l in ch.layers:  # ln_1's backward ends the layer's piece
            if f"bwd_settle:{l}" not in groups[f"h.{l}"]:
                groups[f"h.{l}"].append(f"bwd_settle:{l}")
        return tuple(it.name for it in fwd), groups

    def pieces(self, chunk: int = 0) -> tuple[str, ...]:
        """GPT-2's backward pieces of the chunk, in backward order (config.backward_pieces)."""
        return tuple(self._whole(chunk)[1])

    def forward(self, mb: int, chunk: int = 0) -> float | None:
        """The chunk's forward of micro-batch mb (tokens from self.batch, or the act_in
        message); the mean loss on the head chunk (the gradient is of loss_scale x it)."""
        loss = None
        for name in self._whole(chunk)[0]:
            out = self.compute(name, mb, chunk)
            loss = out if out is not None else loss
        return loss

    def backward_piece(self, piece: str, mb: int, chunk: int = 0) -> None:
        """One of pieces(): its gradients are final after it. Pieces run in order."""
        for name in self._whole(chunk)[1][piece]:
            self.compute(name, mb, chunk)

    def backward(self, mb: int, chunk: int = 0) -> None:
        """The chunk's whole backward of mb: gradients accumulate (written afresh the first
        time in an iteration), the grad_in message holds the input gradient (no embedding)."""
        for piece in self.pieces(chunk):
            self.backward_piece(piece, mb, chunk)

    def free(self, mb: int, chunk: int = 0) -> None:
        """Drop mb's saved state without a backward (evaluation-only forwards)."""
        self._free(mb, chunk)
