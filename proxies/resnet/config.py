"""ResNet presets and shapes: torchvision's bottleneck ResNet v1.5 (the stride on the 3x3
conv of a stage's first block), and the C++ proxies' (spcl/DNN-cpp-proxies) message sizes
and A100 times.

Every layer's shape, parameter count and FLOPs derive from the config here, with no NumPy,
so a dry run of ResNet-152 for 2,048 ranks plans without allocating the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

EXPANSION = 4  # bottleneck: out channels = 4 x width


@dataclass(frozen=True)
class ResNetConfig:
    name: str
    blocks: tuple[int, ...]  # bottleneck blocks per stage
    widths: tuple[int, ...] = (64, 128, 256, 512)  # each stage's 3x3 width
    stem: int = 64  # the 7x7/2 stem's channels
    image_size: int = 224
    classes: int = 1000
    batch: int = 32  # default images per replica

    @cached_property
    def layers(self) -> list[Conv]:
        """Every conv (with its batch norm) in forward order, shapes at this image size."""
        out = [Conv("conv1", 3, self.stem, 7, 2, 3, *_sizes(self.image_size, 7, 2, 3))]
        h = _out(out[0].h, 3, 2, 1)  # the 3x3/2 max pool
        cin = self.stem
        for s, (n, wd) in enumerate(zip(self.blocks, self.widths, strict=True)):
            for j in range(n):
                stride = 2 if s > 0 and j == 0 else 1
                p = f"layer{s + 1}.{j}."
                ho = _out(h, 3, stride, 1)
                cout = wd * EXPANSION
                out.append(Conv(p + "conv1", cin, wd, 1, 1, 0, h, h))
                out.append(Conv(p + "conv2", wd, wd, 3, stride, 1, ho, ho))
                out.append(Conv(p + "conv3", wd, cout, 1, 1, 0, ho, ho))
                if j == 0:  # torchvision: a projection when the shape changes
                    out.append(Conv(p + "downsample", cin, cout, 1, stride, 0, ho, ho))
                cin, h = cout, ho
        return out

    @property
    def features(self) -> int:
        return self.widths[-1] * EXPANSION

    def block_names(self) -> list[str]:
        return [f"layer{s + 1}.{j}" for s, n in enumerate(self.blocks) for j in range(n)]

    @cached_property
    def tensors(self) -> list[tuple[str, int]]:
        """(name, elements) of every parameter tensor in torchvision's parameters() order."""
        out = []
        for c in self.layers:
            if c.name.endswith("downsample"):
                conv, bn = c.name + ".0.weight", c.name + ".1"
            else:
                conv, bn = c.name + ".weight", c.name.replace("conv", "bn")
            out += [(conv, c.params), (bn + ".weight", c.cout), (bn + ".bias", c.cout)]
        out += [("fc.weight", self.classes * self.features), ("fc.bias", self.classes)]
        return out

    @property
    def bn_channels(self) -> int:
        """Channels of every batch norm: its running mean and var are 2x this many floats."""
        return sum(c.cout for c in self.layers)

    @property
    def num_params(self) -> int:
        return sum(n for _, n in self.tensors)

    def forward_flops(self, B: int) -> dict[str, float]:
        """Forward FLOPs (2 per multiply-add) per plan piece: "stem", each block, "head".
        Batch norm, ReLU and pooling are elementwise and left out (as FLOP counts of CNNs do)."""
        out: dict[str, float] = {}
        for c in self.layers:
            piece = "stem" if c.name == "conv1" else c.name.rsplit(".", 1)[0]
            out[piece] = out.get(piece, 0.0) + c.flops(B)
        out["head"] = 2.0 * B * self.features * self.classes
        return out


@dataclass(frozen=True)
class Conv:
    name: str
    cin: int
    cout: int
    k: int
    stride: int
    pad: int
    h: int  # output height (= width)
    w: int

    @property
    def params(self) -> int:
        return self.cout * self.cin * self.k * self.k

    def flops(self, B: int) -> float:
        return 2.0 * B * self.cout * self.h * self.w * self.cin * self.k * self.k


def _out(n: int, k: int, stride: int, pad: int) -> int:
    return (n + 2 * pad - k) // stride + 1


def _sizes(n: int, k: int, stride: int, pad: int) -> tuple[int, int]:
    o = _out(n, k, stride, pad)
    return o, o


PRESETS: dict[str, ResNetConfig] = {
    "resnet50": ResNetConfig("resnet50", (3, 4, 6, 3)),
    "resnet152": ResNetConfig("resnet152", (3, 8, 36, 3)),
    # tests and CI: one block per stage, 4..32 wide, CIFAR-sized images and classes
    "resnet-tiny": ResNetConfig(
        "resnet-tiny", (1, 1, 1, 1), (4, 8, 16, 32), 8, image_size=32, classes=10, batch=4
    ),
}


# -- the C++ proxies (spcl/DNN-cpp-proxies) ------------------------------------------------


@dataclass(frozen=True)
class CppPreset:
    """A C++ proxy's iteration: allreduce sizes in its order, blocking or not, its A100
    times (forward once, then one backward slice before each allreduce), and the model whose
    FLOPs --compute model falls back to where it slept nothing."""

    name: str
    source: str
    sizes: tuple[int, ...]
    blocking: bool
    model: ResNetConfig
    batch: int
    forward_us: float = 0.0
    backward_us: float = 0.0  # per slice: one slice before each allreduce
    scaled: bool = False  # resnet152_scal.cpp: batch and times chosen by the world size


# comm_only/resnet50.cpp (MSGAGG): its 161 gradients (TensorFlow's ResNet-50, 1001 classes)
# aggregated into six blocking MPI_Allreduces after the backward; it sleeps nothing.
CPP_RESNET50_SIZES = (3104745, 4461568, 4462592, 4986880, 4468736, 4074560)
# comm-and-compute/resnet152.cpp: ten buckets, MPI_Iallreduce each after a tenth of the
# backward, MPI_Waitall at the end; A100 at batch 128: forward 119 ms, backward 10 x 23.8 ms.
CPP_RESNET152_SIZES = (
    6511592, 6567936, 5905920, 6113280, 6176256, 6112768, 6176256, 6112768, 5321216, 5194816,
)  # fmt: skip
# resnet152_scal.cpp: a global batch of 32K over 256..2048 ranks; world size -> (local
# batch, forward us, backward us per bucket), its table.
CPP_SCALED = {
    256: (128, 119000, 23800),
    512: (64, 63000, 12600),
    1024: (32, 36000, 7200),
    2048: (16, 27667, 5533),
}

CPP_PRESETS: dict[str, CppPreset] = {
    "dnn-cpp-proxies-resnet50": CppPreset(
        "dnn-cpp-proxies-resnet50",
        "proxies/comm_only/resnet50.cpp",
        CPP_RESNET50_SIZES,
        True,
        ResNetConfig("resnet50", (3, 4, 6, 3), classes=1001),
        batch=32,
    ),
    "dnn-cpp-proxies-resnet152": CppPreset(
        "dnn-cpp-proxies-resnet152",
        "comm-and-compute/resnet152.cpp",
        CPP_RESNET152_SIZES,
        False,
        PRESETS["resnet152"],
        batch=128,
        forward_us=119000,
        backward_us=23800,
    ),
    "dnn-cpp-proxies-resnet152-scal": CppPreset(
        "dnn-cpp-proxies-resnet152-scal",
        "proxies/resnet152_scal.cpp",
        CPP_RESNET152_SIZES,
        False,
        PRESETS["resnet152"],
        batch=0,  # from the world size
        scaled=True,
    ),
}
