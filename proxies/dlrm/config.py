"""DLRM model configurations.

Letters used across proxies/dlrm: B global batch, b = B / W local batch (samples per rank),
W world size, NT embedding tables, R rows of a table, D embedding width, P pooling (indices
per sample per table, summed into one bag), F = NT + 1 vectors into the interaction (the
bottom MLP's output and one pooled embedding per table), I = D + F(F-1)/2 interaction width.

A model: dense features -> bottom MLP -> x (b,D); sparse indices -> one embedding bag per
table -> (b,NT,D); the dot interaction of the F vectors (pairwise dots, no self-dots) next to
x -> (b,I); top MLP -> one logit; sigmoid + binary cross-entropy. Every MLP layer has a ReLU
except the top MLP's last (its output is the logit), as dlrm_s_pytorch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# MLPerf DLRM (Criteo Terabyte, dlrm_s_pytorch --max-ind-range=40000000): rows of the 26 tables.
CRITEO_TB_ROWS = (
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10,
    2208, 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36,
)  # fmt: skip


@dataclass(frozen=True)
class DLRMConfig:
    name: str
    dense: int  # dense features per sample: the bottom MLP's input width
    bottom: tuple[int, ...]  # bottom MLP output widths; the last is D
    top: tuple[int, ...]  # top MLP output widths after the interaction; the last is 1
    rows: tuple[int, ...]  # R of each table; NT = len(rows)
    dim: int  # D
    pooling: int  # P, fixed per bag (dlrm_s_pytorch draws 1..P; fixed keeps bags uniform)
    batch: int  # B, global
    lr: float = 1.0  # SGD learning rate (both reference commands use 1.0)

    def __post_init__(self) -> None:
        for name in ("dense", "dim", "pooling", "batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.rows or min(self.rows) <= 0:
            raise ValueError(f"every table needs rows, got {self.rows}")
        if not self.bottom or min(self.bottom) <= 0 or not self.top or min(self.top) <= 0:
            raise ValueError("MLP widths must be positive")
        if self.bottom[-1] != self.dim:
            raise ValueError(
                f"the bottom MLP ends at {self.bottom[-1]} but the embeddings are "
                f"D = {self.dim}: the interaction dots them"
            )
        if self.top[-1] != 1:
            raise ValueError(f"the top MLP must end at 1 (the logit), not {self.top[-1]}")

    @property
    def tables(self) -> int:
        return len(self.rows)

    @property
    def features(self) -> int:
        """F: the bottom MLP output plus one pooled embedding per table."""
        return self.tables + 1

    @property
    def interaction(self) -> int:
        """I = D + F(F-1)/2: x next to every pairwise dot."""
        F = self.features
        return self.dim + F * (F - 1) // 2

    @property
    def bottom_layers(self) -> list[tuple[int, int]]:
        """(C, OC) of each bottom MLP layer."""
        return list(zip((self.dense, *self.bottom[:-1]), self.bottom, strict=True))

    @property
    def top_layers(self) -> list[tuple[int, int]]:
        return list(zip((self.interaction, *self.top[:-1]), self.top, strict=True))

    @staticmethod
    def layer_params(layers: list[tuple[int, int]]) -> list[int]:
        """Weights (OC,C) plus bias (OC,) of each layer."""
        return [C * OC + OC for C, OC in layers]

    @property
    def mlp_params(self) -> int:
        return sum(self.layer_params(self.bottom_layers)) + sum(self.layer_params(self.top_layers))

    @property
    def embedding_params(self) -> int:
        return sum(self.rows) * self.dim

    def with_tables(self, n: int) -> DLRMConfig:
        """n tables, their rows cycling through this preset's."""
        return replace(self, rows=tuple(self.rows[i % self.tables] for i in range(n)))

    def with_max_rows(self, cap: int) -> DLRMConfig:
        """Rows capped at `cap`, as dlrm_s_pytorch's --max-ind-range (0: no cap)."""
        return replace(self, rows=tuple(min(r, cap) for r in self.rows)) if cap else self


PRESETS: dict[str, DLRMConfig] = {
    c.name: c
    for c in (
        # The C++ proxy's (spcl/DNN-cpp-proxies dlrm.cpp) dlrm_s_pytorch command: 4 tables of
        # 80,000 x 128, bottom 128-128-128-128, top (128 + 10 dots = 138)-512-512-512-256-1,
        # mini-batch 2048 over 4 GPUs. Its random data draws 1..10 indices per bag; we use 10.
        DLRMConfig("dnn-cpp-proxies", 128, (128, 128, 128), (512, 512, 512, 256, 1),
                   (80_000,) * 4, 128, 10, 2048),
        # MLPerf training DLRM (Criteo Terabyte): 13 dense features, 26 tables of the sizes
        # above (one index each), bottom 13-512-256-128, top (128 + 351 = 479)-1024-1024-
        # 512-256-1, the reference's mini-batch 2048 and learning rate 1.0.
        DLRMConfig("mlperf", 13, (512, 256, 128), (1024, 1024, 512, 256, 1),
                   CRITEO_TB_ROWS, 128, 1, 2048),
        # Small enough for tests and CI: runs at 1, 2, 4 (and, padded, 3) ranks.
        DLRMConfig("dlrm-tiny", 8, (16, 8), (16, 8, 1), (50, 100, 200, 400), 8, 2, 32, 0.1),
    )
}  # fmt: skip
