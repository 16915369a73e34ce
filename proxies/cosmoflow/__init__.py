"""CosmoFlow: model config and shard layout, NumPy 3D-CNN kernels, and the spatial x data
parallel proxy."""

from proxies.core.spec import ProxySpec

# What python -m proxies, the sweep and the reports know of this proxy (proxies/registry.py);
# proxies.cosmoflow.proxy is imported only when a parser or a job is built.
SPEC = ProxySpec(
    name="cosmoflow",
    summary="CosmoFlow: 3D CNN, spatial x data parallelism",
    module="proxies.cosmoflow.proxy",
    categories={
        "halo": "halo exchange (spatial neighbours)",
        "sp_allgather": "allgather over the shards (dense inputs)",
        "sp_reduce_scatter": "reduce-scatter over the shards (dense input gradients)",
        "conv_allreduce": "conv gradient allreduce (all ranks)",
        "dense_allreduce": "dense-slice gradient allreduce (replicas)",
    },
)
