"""ResNet: NumPy kernels (NCHW), torchvision's bottleneck ResNet, and the data-parallel proxy
with gradient buckets overlapped with the backward (PyTorch DDP's way)."""

from proxies.core.spec import ProxySpec

# What python -m proxies, the sweep and the reports know of this proxy (proxies/registry.py);
# proxies.resnet.proxy is imported only when a parser or a job is built.
SPEC = ProxySpec(
    name="resnet",
    summary="ResNet-50/152: data parallel, gradient buckets overlapped with backward",
    module="proxies.resnet.proxy",
    categories={},
)
