"""Every command of `python -m proxies`, listed once: the proxies (each package's SPEC, a
core.spec.ProxySpec) and the other commands. `python -m proxies`, the sweep (which proxies
exist, their parsers) and the reports (category labels) read this list.

Importing it imports each proxy package's __init__ only (its SPEC): no model code, no NumPy.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from proxies import bert, cosmoflow, dlrm, gpt2, gpt3, llama, resnet
from proxies.core.spec import Command, ProxySpec

if TYPE_CHECKING:
    from proxies.core.report import Categories

PROXIES: dict[str, ProxySpec] = {
    s.name: s
    for s in (
        gpt2.SPEC,
        gpt3.SPEC,
        llama.SPEC,
        bert.SPEC,
        cosmoflow.SPEC,
        dlrm.SPEC,
        resnet.SPEC,
    )
}

# Runnable, but not proxies a sweep launches: the collectives benchmark's JSON holds rows of
# sizes and bandwidths, not the iteration times a sweep records and reports.
APPS: dict[str, Command] = {
    c.name: c
    for c in (
        Command("collectives", "allreduce algorithms benchmark (nccl-tests style table)"),
        Command("sweep", "run a YAML scaling sweep"),
        Command("report", "tables and plots of a sweep's results"),
        Command("compare", "is B faster than A: two results or sweeps, per category, noise stated"),
        Command("calibrate", "measure this allocation and write a machine file (--machine)"),
        Command("timeline", "a --trace file as a picture: a few ranks over one iteration"),
    )
}

COMMANDS: dict[str, str] = {n: c.summary for n, c in (*PROXIES.items(), *APPS.items())}


def runnable(name: str) -> bool:
    """Whether `python -m proxies.<name>` can run (a package with a __main__, not a folder
    still being written)."""
    try:
        return importlib.util.find_spec(f"proxies.{name}.__main__") is not None
    except (ImportError, ValueError):
        return False


def available() -> dict[str, str]:
    """The commands that can run: name -> one line."""
    return {k: v for k, v in COMMANDS.items() if runnable(k)}


def proxy(name: str) -> ProxySpec | None:
    """The runnable proxy called `name`, else None (an app command is not a proxy)."""
    spec = PROXIES.get(name)
    return spec if spec is not None and runnable(name) else None


def proxies() -> list[str]:
    """The runnable proxies' names, sorted."""
    return sorted(n for n in PROXIES if runnable(n))


def report_categories() -> Categories:
    """Core's categories and every one any proxy adds (in registry order), labelled: for the
    tables of results whose job is gone (the sweep report, compare)."""
    from proxies.core.report import Categories  # NumPy: not for `python -m proxies --help`

    labels: dict[str, str] = {}
    short: dict[str, str] = {}
    for s in PROXIES.values():
        labels |= s.categories
        short |= s.short
    return Categories.of(labels, short)
