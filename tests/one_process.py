"""The unsharded model trained in one process on the proxies' samples: the losses every
distributed real-compute test of the GPT family compares with."""

from __future__ import annotations

from proxies.transformer.config import GPT2Config
from proxies.transformer.data import Synthetic, batch
from proxies.transformer.model import StageShard, full_model


def train(
    cfg: GPT2Config, T: int, m: int, iters: int = 2, lr: float = 1e-3, stop_at_optimizer=False
) -> tuple[list[float], StageShard]:
    """(mean loss per iteration, the model): m micro-batches of one sample per iteration,
    sample i of the synthetic stream (seed 0) as the proxies number them, AdamW at lr.
    stop_at_optimizer: return after the first iteration's backward, before its step."""
    model = full_model(cfg, 1, T, seed=0)
    model.loss_scale = 1.0 / m
    source = Synthetic(0, cfg.vocab_size, T)
    losses = []
    for it in range(iters):
        total = 0.0
        for mb in range(m):
            x, y = batch(source, it * m + mb, 1)
            model.batch = lambda _, x=x, y=y: (x, y)
            total += model.forward(mb)
        for mb in range(m):
            model.backward(mb)
        losses.append(total / m)
        if stop_at_optimizer:
            return losses, model
        model.step(lr)
    return losses, model
