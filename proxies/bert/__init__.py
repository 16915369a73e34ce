"""BERT proxy: a bidirectional encoder with the masked-LM head, pipeline x data (x tensor)
parallel on the GPT family's transformer."""

from proxies.core.spec import ProxySpec
from proxies.transformer.categories import CATEGORIES, SHORT

# What python -m proxies, the sweep and the reports know of this proxy (proxies/registry.py);
# proxies.bert.proxy is imported only when a parser or a job is built.
SPEC = ProxySpec(
    name="bert",
    summary="BERT encoder (masked LM): pipeline x data (x tensor) parallelism",
    module="proxies.bert.proxy",
    categories=CATEGORIES,
    short=SHORT,
)
