"""What a proxy package declares about itself: one ProxySpec, its package's SPEC.

The registry (proxies/registry.py) lists the specs; `python -m proxies`, the sweep and the
reports read them instead of keeping their own lists of proxies. A spec is cheap to build:
it names the module holding the parser and the job builder, imported on first use, so
listing the proxies (`python -m proxies --help`) loads no model code and no NumPy.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import argparse

    from proxies.core.runner import Job


@dataclass(frozen=True)
class ProxySpec:
    """One proxy: `python -m proxies.<name>`.

    `module` holds `parser()` (a cli.Parser) and `make_job(args, world)` (a runner.Job).
    `categories`: the display label of each timing category this proxy adds, in display
    order (core/report.py places them after compute and pipeline send/recv, before the
    engine's own); `short`: column headers for those whose abbreviation (report.abbrev)
    would not read well."""

    name: str
    summary: str
    module: str
    categories: Mapping[str, str] = field(default_factory=dict)
    short: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:  # frozen: nobody edits a registered proxy's tables
        object.__setattr__(self, "categories", MappingProxyType(dict(self.categories)))
        object.__setattr__(self, "short", MappingProxyType(dict(self.short)))

    def load(self) -> Any:
        """The module with parser() and make_job (imported now: model code, NumPy)."""
        return importlib.import_module(self.module)

    def parser(self) -> argparse.ArgumentParser:
        return self.load().parser()

    def make_job(self, args: argparse.Namespace, world: int) -> Job:
        return self.load().make_job(args, world)


@dataclass(frozen=True)
class Command:
    """A command of `python -m proxies` that is not a proxy (a benchmark, the sweep, ...)."""

    name: str
    summary: str
