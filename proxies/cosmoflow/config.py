"""CosmoFlow configurations, the spatial shard layout, and every size derived from them.

Letters used across proxies/cosmoflow: B samples per replica (batch), G global batch,
D H W volume extents (global; h w are a shard's local H W), C channels (Ci in, Co out),
L conv layers, S spatial shards = py x px (H split py ways, W split px ways), F features
after the conv stack, K kernel extent (3), I/O a dense layer's input/output width.

The model (MLPerf HPC CosmoFlow): L x [conv3d K^3 'same' + LeakyReLU + 2^3 max-pool], then
dense layers with LeakyReLU, the last one 1.2 * tanh, MSE loss. Activations are channels-last
(B, D, H, W, C) as in the MLPerf reference (input shape [128, 128, 128, 4]).

Spatial parallelism (as the C++ proxy, spcl/DNN-cpp-proxies): every volume is split over the
S shards of a replica along H and W (D stays whole); each shard loads only its own tile. A
conv layer needs a 1-voxel halo from each neighbouring shard, conv0 included (the input
volume's faces and edges; the C++ proxy sends none there). Dense layers, --dense:
- split (default): by output columns, as the C++ proxy. Shard s holds columns
  block_range(O, S, s) of every dense layer (O/S each when S divides O, else sizes differing
  by one, the larger first: any S works), gathers the whole input (allgather, Allgatherv when
  uneven) in forward and reduce-scatters the input gradient in backward. The dense slices'
  gradients are summed over the ranks holding the same slice (the data-parallel group).
- replicate: as the MLPerf HPC spatial-parallel reference (MXNet, SpatialParallelAllgather):
  the conv output is allgathered and every shard runs the whole dense layers on it, so no
  further messages in forward or backward. Every rank holds every dense weight; their
  gradients are summed over all ranks (the reference's Horovod allreduce) and scaled by 1/S
  (its dense lr_mult = 1 / spatial span), since the S shards of a replica hold the same one.
Conv weights are replicated on every rank, so their gradients are summed over all ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from proxies.core.plan import block_range

K = 3  # conv kernel extent: a 1-voxel halo
POOL = 2  # max-pool window and stride, every conv layer

# Halo schemes.
# exact: what the sharded convolution needs (equals the unsharded one): faces of the layer's
#   input in forward and of its output gradient in backward, plus the edge lines to the
#   diagonal neighbours (a 3^3 stencil reaches them).
# cpp: the C++ proxy's messages: faces only, to the (up to) 4 face neighbours; forward faces
#   sized at the previous conv's output resolution, before pooling (4x the face a
#   convolution needs), backward faces of the conv output gradient (as exact). It cannot
#   carry the data a sharded convolution needs, so it runs without real compute.
HALOS = ("exact", "cpp")
DENSE_MODES = ("split", "replicate")

# The C++ proxy (comm-and-compute/cosmoflow.cpp): per-layer times on an A100 for one model
# shard (batch 8, 4 shards, 128^3 x 4 input), microseconds. Forward: conv0..conv4, dense0..2.
# Backward in its order dense2, dense1, dense0, conv4 .. conv0 (conv = 2 x forward).
CPP_FWD_US = (6567, 13135, 6567, 3283, 1641, 5, 3, 1)
CPP_BWD_US = (2, 6, 10, 3283, 6567, 13135, 26270, 13135)


@dataclass(frozen=True)
class CosmoFlowConfig:
    name: str
    volume: tuple[int, int, int] = (128, 128, 128)  # D, H, W
    in_channels: int = 4
    filters: tuple[int, ...] = (32, 64, 128, 256, 512)  # Co of each conv layer
    dense: tuple[int, ...] = (128, 64, 4)  # widths; the last is the output count
    batch: int = 8  # B: samples per replica unless --global-batch (C++ proxy: 8)
    halo: str = "exact"
    dense_mode: str = "split"  # one of DENSE_MODES
    compute: str = "real"  # default --compute for the preset
    leak: float = 0.3  # LeakyReLU slope (Keras default, the MLPerf reference's activation)

    def __post_init__(self) -> None:
        if self.halo not in HALOS:
            raise ValueError(f"halo = {self.halo!r}: expected one of {HALOS}")
        if self.dense_mode not in DENSE_MODES:
            raise ValueError(f"dense_mode = {self.dense_mode!r}: expected one of {DENSE_MODES}")
        if not self.filters or not self.dense:
            raise ValueError("need at least one conv and one dense layer")

    @property
    def layers(self) -> int:
        return len(self.filters)

    def channels(self, l: int) -> tuple[int, int]:
        """(Ci, Co) of conv layer l."""
        return (self.in_channels, *self.filters)[l], self.filters[l]

    def extent(self, l: int) -> tuple[int, int, int]:
        """Global (D, H, W) of conv layer l's input (and, 'same' padding, its output)."""
        f = POOL**l
        return tuple(n // f for n in self.volume)

    @property
    def features(self) -> int:
        """F: flattened size of one sample after the conv stack."""
        return math.prod(self.extent(self.layers)) * self.filters[-1]

    def conv_params(self, l: int) -> int:
        ci, co = self.channels(l)
        return K**3 * ci * co + co

    def dense_io(self, k: int) -> tuple[int, int]:
        """(I, O) of dense layer k."""
        return (self.features, *self.dense)[k], self.dense[k]

    def dense_columns(self, k: int, shards: int = 1, s: int = 0) -> tuple[int, int]:
        """[lo, hi) of the output columns of dense layer k that shard s of `shards` holds:
        all of them when replicated, else block s of O split as np.array_split does (the
        blocks the engine's allgather / reduce-scatter use, in units of B samples)."""
        o = self.dense[k]
        if self.dense_mode == "replicate":
            return 0, o
        return block_range(o, shards, s)

    def dense_params(self, k: int, shards: int = 1, s: int = 0) -> int:
        """Parameters of dense layer k held by shard s of `shards`: (I + 1) x its columns."""
        lo, hi = self.dense_columns(k, shards, s)
        return (self.dense_io(k)[0] + 1) * (hi - lo)

    @property
    def num_params(self) -> int:
        conv = sum(self.conv_params(l) for l in range(self.layers))
        return conv + sum((i + 1) * o for i, o in map(self.dense_io, range(len(self.dense))))


PRESETS: dict[str, CosmoFlowConfig] = {
    c.name: c
    for c in (
        # MLPerf HPC CosmoFlow: 128^3 x 4, conv 32..512, dense 128-64-4. NumPy at this size
        # takes minutes and gigabytes per iteration: modelled compute by default.
        CosmoFlowConfig("cosmoflow", compute="model"),
        # The same model with the C++ proxy's message sizes and A100 layer times.
        CosmoFlowConfig("dnn-cpp-proxies", halo="cpp", compute="model"),
        # Tests and CI: 3 conv layers, so that a 32^3 volume splits up to 4x4 (8 voxels per
        # shard, pooled down to 1); dense 16-6-4, so that from 4 shards a gathered layer
        # (6 columns) splits unevenly.
        CosmoFlowConfig(
            "cosmoflow-tiny", volume=(32, 32, 32), filters=(4, 8, 16), dense=(16, 6, 4), batch=2
        ),
    )
}

# The configuration the C++ proxy's layer times were measured in.
CPP_REFERENCE = PRESETS["dnn-cpp-proxies"]
CPP_SHARDS = (2, 2)


# ---------------------------------------------------------------------------------------
# shard layout


# Neighbour directions (di along H, dj along W), in a fixed order; DIRS[7 - k] = -DIRS[k].
DIRS = ((-1, -1), (-1, 0), (-1, 1), (0, -1), (0, 1), (1, -1), (1, 0), (1, 1))
DIR_NAMES = ("nw", "n", "ne", "w", "e", "sw", "s", "se")  # north = -H, west = -W


def opposite(k: int) -> int:
    return len(DIRS) - 1 - k


@dataclass(frozen=True)
class Shards:
    """The py x px split of (H, W); shard s = si * px + sj (W fastest, as the C++ proxy's
    2x2: its neighbours rank^1 and rank^2 are our 'w'/'e' and 'n'/'s')."""

    py: int
    px: int

    @property
    def size(self) -> int:
        return self.py * self.px

    def __str__(self) -> str:
        return f"{self.py}x{self.px}"

    def coords(self, s: int) -> tuple[int, int]:
        return divmod(s, self.px)

    def neighbours(self, s: int, diagonal: bool = True) -> list[tuple[int, int]]:
        """(direction index, shard) of every neighbour of shard s; volume edges have none."""
        si, sj = self.coords(s)
        out = []
        for k, (di, dj) in enumerate(DIRS):
            if di and dj and not diagonal:
                continue
            i, j = si + di, sj + dj
            if 0 <= i < self.py and 0 <= j < self.px:
                out.append((k, i * self.px + j))
        return out

    def local(self, extent: tuple[int, int, int]) -> tuple[int, int, int]:
        """A shard's (D, h, w) of a global (D, H, W)."""
        d, h, w = extent
        return d, h // self.py, w // self.px


def parse_shards(text: str) -> Shards:
    """'4' -> 2x2 (as square as possible, py <= px); '1x4' -> 1x4 (py x px: H x W)."""
    parts = text.lower().split("x")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"expected a count like 4 or a split like 2x2, got {text!r}") from None
    if len(nums) > 2 or min(nums) < 1:
        raise ValueError(f"expected a positive count like 4 or a split like 2x2, got {text!r}")
    if len(nums) == 2:
        return Shards(*nums)
    n = nums[0]
    py = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return Shards(py, n // py)


def validate(cfg: CosmoFlowConfig, shards: Shards) -> None:
    """Raise ValueError naming the rule when the shards do not fit the model."""
    L, f = cfg.layers, POOL**cfg.layers
    d, h, w = cfg.volume
    if d % f:
        raise ValueError(
            f"volume depth D = {d} cannot be halved by {L} poolings: it must be a multiple of {f}"
        )
    for name, n, p in (("H", h, shards.py), ("W", w, shards.px)):
        if n % (p * f):
            raise ValueError(
                f"--shards {shards}: {name} = {n} split {p} ways is {n / p:g} voxels per shard, "
                f"which {L} poolings (2x2x2) cannot halve evenly: {name} / {p} must be a "
                f"multiple of {f}"
            )


# ---------------------------------------------------------------------------------------
# message sizes


@dataclass(frozen=True)
class Halo:
    """One halo message of one conv layer: to/from the neighbouring shard in direction k."""

    k: int
    shard: int  # the neighbour
    shape: tuple[int, ...]  # (B, D, h, w, C) of the data a convolution needs
    factors: tuple[int, ...]  # count = their product: B, D, the face's extent, C
    why: str  # what the message is, for --dry-run

    @property
    def count(self) -> int:
        return math.prod(self.factors)

    @property
    def kind(self) -> str:
        di, dj = DIRS[self.k]
        return "diagonal edge" if di and dj else "n/s face" if di else "w/e face"


def halos(cfg: CosmoFlowConfig, shards: Shards, s: int, l: int, phase: str, B: int) -> list[Halo]:
    """Halo messages of shard s before conv layer l's forward (its input x, Ci channels) or
    inside its backward (its output gradient dy, Co channels). Layer 0: the input volume's
    faces and edges in forward (exact halos only: the C++ proxy sends none), nothing in
    backward (the input needs no gradient)."""
    if l == 0 and (phase == "backward" or cfg.halo == "cpp"):
        return []
    ci, co = cfg.channels(l)
    d, h, w = shards.local(cfg.extent(l))
    out = []
    for k, t in shards.neighbours(s, diagonal=cfg.halo == "exact"):
        di, dj = DIRS[k]
        shape = (B, d, 1 if di else h, 1 if dj else w, ci if phase == "forward" else co)
        face = math.prod(shape[2:4])  # h or w for a face, 1 for a diagonal edge
        if phase == "backward":
            factors, why = (B, d, face, co), f"conv{l}'s output gradient"
        elif l == 0:
            factors, why = (B, d, face, ci), "conv0's input (the data volume)"
        elif cfg.halo == "cpp":
            # The previous conv's output face, before pooling: POOL x larger per face axis.
            factors = (B, POOL * d, POOL * face, ci)
            why = f"conv{l - 1}'s output before pooling (C++ proxy; {POOL**2}x what conv{l} needs)"
        else:
            factors, why = (B, d, face, ci), f"conv{l}'s input"
        out.append(Halo(k, t, shape, factors, why))
    return out
