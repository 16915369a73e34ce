"""LLaMA-3 and Mixtral proxy: GPT-3's parallelisms (tp with sequence parallelism, pp with
virtual stages, dp, cp, ep) on the LLaMA architecture (transformer/llama.py)."""

from proxies.core.spec import ProxySpec
from proxies.transformer.categories import CATEGORIES, SHORT

SPEC = ProxySpec(
    name="llama",
    summary="LLaMA-3 / Mixtral: data x tensor x pipeline x context (x expert) parallelism",
    module="proxies.llama.proxy",
    categories=CATEGORIES,
    short=SHORT,
)
