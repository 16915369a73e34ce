"""GPT-3 (+MoE) proxy: data x tensor x pipeline (x expert) parallelism, as Megatron-LM."""

from proxies.core.spec import ProxySpec
from proxies.transformer.categories import CATEGORIES, SHORT

# What python -m proxies, the sweep and the reports know of this proxy (proxies/registry.py);
# proxies.gpt3.proxy is imported only when a parser or a job is built.
SPEC = ProxySpec(
    name="gpt3",
    summary="GPT-3 (+MoE): data x tensor x pipeline (x expert) parallelism",
    module="proxies.gpt3.proxy",
    categories=CATEGORIES,
    short=SHORT,
)
