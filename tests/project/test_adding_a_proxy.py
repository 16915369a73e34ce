"""The README's "Adding a proxy" example is a working proxy: its plans pass the dry run's
checks, it trains under mpiexec with every message checked, bad input is one line and exit
2, and its JSON result is a valid result (proxies/schema)."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
from launch import ROOT, mpiexec, run

from proxies.schema import check as schema_problems

SECTION = open(os.path.join(ROOT, "README.md")).read().split("## Adding a proxy")[1]
SECTION = SECTION.split("\n## ")[0]


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> str:
    blocks = re.findall(r"```python\n(.*?)```", SECTION, re.S)
    assert len(blocks) == 1, "the section shows one proxy module"
    path = tmp_path_factory.mktemp("toy") / "toy.py"
    path.write_text(blocks[0])
    return str(path)


@pytest.mark.slow
def test_the_example_plans_are_valid_at_any_world_size(toy):
    r = run([sys.executable, toy, "--dry-run", "--world-size", "64"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "plan valid: 64 ranks" in r.stdout


@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2(toy):
    r = run([sys.executable, toy, "--width", "0", "--dry-run"], timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "--width" in r.stderr


@pytest.mark.mpi
def test_the_example_trains_with_every_message_checked(toy, tmp_path):
    out = tmp_path / "toy.json"
    cmd = [mpiexec(), "-n", "2", sys.executable, toy, "--iters", "4", "--check"]
    r = run([*cmd, "--json", str(out)], timeout=180)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert schema_problems(result) == []
    losses = [float(x) for x in r.stdout.split("loss per iteration:")[1].split()]
    assert len(losses) == 6 and all(b < a for a, b in zip(losses, losses[1:], strict=False))
