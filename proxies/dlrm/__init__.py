"""DLRM: presets, NumPy kernels, the sharded model, and the embedding all-to-all x
data-parallel MLP proxy."""

from proxies.core.spec import ProxySpec

# What python -m proxies, the sweep and the reports know of this proxy (proxies/registry.py);
# proxies.dlrm.proxy is imported only when a parser or a job is built.
SPEC = ProxySpec(
    name="dlrm",
    summary="DLRM: model-parallel embeddings x data-parallel MLPs",
    module="proxies.dlrm.proxy",
    categories={
        "emb_alltoall": "embedding all-to-all",
        "emb_input": "embedding ids and lengths all-to-all (row-wise)",
        "emb_reduce_scatter": "pooled-embedding reduce-scatter (row-wise)",
        "emb_allgather": "pooled-gradient all-gather (row-wise)",
    },
    short={
        "emb_alltoall": "emb a2a",
        "emb_input": "ids a2a",
        "emb_reduce_scatter": "emb rs",
        "emb_allgather": "emb ag",
    },
)
