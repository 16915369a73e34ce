"""ResNet: NumPy kernels (NCHW), torchvision's bottleneck ResNet, and the data-parallel proxy
with gradient buckets overlapped with the backward (PyTorch DDP's way)."""

from proxies.core.spec import ProxySpec

# What python -m proxies, the sweep and the reports know of this proxy (proxies/registry.py);
# proxies.resnet.proxy is imported only when a parser or a job is built.
SPEC = ProxySpec(
    name="resnet",
    summary="ResNet-50/152: data parallel, gradient buckets overlapped with backward",
    module="proxies.resnet.proxy",
    # FSDP (--fsdp, resnet/fsdp.py): the transformers' categories for the same collectives
    categories={
        "fsdp_allgather": "FSDP parameter all-gather",
        "fsdp_reduce_scatter": "FSDP gradient reduce-scatter",
        "hsdp_allreduce": "HSDP replica allreduce (reduced shards)",
    },
    short={
        "fsdp_allgather": "fsdp ag",
        "fsdp_reduce_scatter": "fsdp rs",
        "hsdp_allreduce": "hsdp ar",
    },
)
