"""Training tokens: synthetic by default, or an llm.c token file.

Every sample has a global index g; its tokens depend only on (seed, g) or (file, g), so
every parallel layout trains on the same data. A sample is T+1 tokens: inputs are the first
T, targets the last T.
"""

from __future__ import annotations

import os

import numpy as np

LLMC_MAGIC = 20240520  # llm.c data/*.bin: int32 header[256] = magic, version, token count
LLMC_HEADER = 256


class DataError(ValueError):
    pass


class Synthetic:
    """Zipf-distributed tokens: a model learns their frequencies within a few steps, so the
    loss visibly falls from ln(V) and training is seen to work."""

    def __init__(self, seed: int, vocab: int, T: int):
        self.seed, self.vocab, self.T = seed, vocab, T

    def sample(self, g: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 7, g])
        return ((rng.zipf(1.3, self.T + 1) - 1) % self.vocab).astype(np.int32)

    def describe(self) -> str:
        return f"synthetic Zipf(1.3) tokens, seed {self.seed}"


class TokenFile:
    """llm.c's .bin format: a 256 x int32 header (magic 20240520, version 1, token count)
    followed by uint16 tokens. Sample g is the (g mod W)-th of W non-overlapping windows."""

    def __init__(self, path: str, vocab: int, T: int):
        self.path, self.T = path, T
        if not os.path.isfile(path):
            raise DataError(f"--data {path}: no such file")
        try:
            header = np.fromfile(path, dtype=np.int32, count=LLMC_HEADER)
        except OSError as e:
            raise DataError(f"--data {path}: cannot read it ({e.strerror})") from None
        if header.size < LLMC_HEADER or header[0] != LLMC_MAGIC or header[1] != 1:
            raise DataError(
                f"--data {path}: not an llm.c token file (expected header magic "
                f"{LLMC_MAGIC}, version 1)"
            )
        n = int(header[2])
        expected = LLMC_HEADER * 4 + 2 * n
        if os.path.getsize(path) != expected:
            raise DataError(
                f"--data {path}: header says {n} tokens ({expected} bytes), "
                f"the file has {os.path.getsize(path)} bytes"
            )
        if n < T + 1:
            raise DataError(
                f"--data {path}: {n} tokens, fewer than one sample of --seq-len + 1 = {T + 1}"
            )
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r", offset=LLMC_HEADER * 4, shape=(n,))
        top = int(self.tokens.max())
        if top >= vocab:
            raise DataError(
                f"--data {path}: token id {top} is outside the model's vocabulary of {vocab}"
            )
        self.windows = (n - 1) // T

    def sample(self, g: int) -> np.ndarray:
        start = (g % self.windows) * self.T
        return np.asarray(self.tokens[start : start + self.T + 1], dtype=np.int32)

    def describe(self) -> str:
        return f"{self.path} ({self.tokens.size:,} tokens, {self.windows:,} samples)"


def write_token_file(path: str, tokens: np.ndarray) -> None:
    """Write tokens in llm.c's format (for tests and for users preparing data)."""
    header = np.zeros(LLMC_HEADER, dtype=np.int32)
    header[:3] = (LLMC_MAGIC, 1, tokens.size)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())


def batch(source, first_sample: int, B: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets (B,T) for samples first_sample .. first_sample + B - 1."""
    rows = np.stack([source.sample(first_sample + b) for b in range(B)])
    return np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])
