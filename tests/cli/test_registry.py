"""The registry of proxies (proxies/registry.py), the arguments a cli.Parser records, and
the keyword-built runner.Job."""

from __future__ import annotations

import argparse
import os
import pkgutil
import sys

import pytest
from launch import ROOT, run

import proxies
from proxies import registry
from proxies.core import cli, report, runner


def test_every_runnable_package_is_registered_once():
    # a package with a __main__ is a command of python -m proxies: the registry lists it
    runnable = {
        m.name
        for m in pkgutil.iter_modules(proxies.__path__)
        if m.ispkg and os.path.exists(os.path.join(ROOT, "proxies", m.name, "__main__.py"))
    }
    assert runnable == set(registry.COMMANDS)
    assert not set(registry.PROXIES) & set(registry.APPS)
    assert registry.proxies() == sorted(registry.PROXIES)
    assert registry.proxy("collectives") is None and registry.proxy("gpt5") is None


@pytest.mark.parametrize("name", sorted(registry.PROXIES))
def test_spec_builds_a_recording_parser(name):
    spec = registry.PROXIES[name]
    p = spec.parser()
    assert isinstance(p, cli.Parser) and p.prog.endswith(f"proxies.{name}")
    dests = [a.dest for a in p.arguments]
    assert {"iters", "allreduce", "dry_run", "world_size"} <= set(dests)
    assert len(dests) == len(set(dests))


@pytest.mark.parametrize("name", sorted(registry.PROXIES))
def test_spec_categories_are_not_core_ones(name):
    # a proxy adds categories; relabelling core's would make one category two names
    spec = registry.PROXIES[name]
    core = {**report.HEAD, **report.TAIL}
    assert not set(spec.categories) & set(core), name
    assert set(spec.short) <= set(spec.categories)


def test_parser_records_arguments_of_groups_in_order():
    p = cli.Parser(prog="t")
    p.add_argument("n", type=int)
    g = p.add_argument_group("g")
    g.add_argument("--a", type=int)
    x = g.add_mutually_exclusive_group()
    x.add_argument("--b", action="store_true")
    x.add_argument("--c", action="store_true")
    y = p.add_mutually_exclusive_group()
    y.add_argument("--d", action="store_true")
    assert [a.dest for a in p.arguments] == ["help", "n", "a", "b", "c", "d"]
    assert p.parse_args(["3", "--a", "4", "--c"]) == argparse.Namespace(
        n=3, a=4, b=False, c=True, d=False
    )


def test_job_is_built_by_keyword_only():
    with pytest.raises(TypeError):
        runner.Job("proxies.x", "x", {}, None, None, (), str)  # type: ignore[misc]


@pytest.mark.slow
def test_main_lists_the_registry_and_hints_a_misspelling():
    r = run([sys.executable, "-m", "proxies"], timeout=60, cwd=ROOT)
    assert r.returncode == 0
    for name, summary in registry.COMMANDS.items():
        assert f"  {name:12} {summary}" in r.stdout
    r = run([sys.executable, "-m", "proxies", "gtp2"], timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "unknown command 'gtp2'" in r.stderr
