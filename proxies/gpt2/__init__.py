"""GPT-2: model config and parameter layout, NumPy kernels, and the pipeline x data proxy."""

from proxies.core.spec import ProxySpec
from proxies.transformer.categories import CATEGORIES, SHORT

# What python -m proxies, the sweep and the reports know of this proxy (proxies/registry.py);
# proxies.gpt2.proxy is imported only when a parser or a job is built.
SPEC = ProxySpec(
    name="gpt2",
    summary="GPT-2: pipeline x data parallelism, real NumPy training",
    module="proxies.gpt2.proxy",
    categories=CATEGORIES,
    short=SHORT,
)
