"""The README's commands, run as written, so the README cannot rot."""

import os
import re
import shlex
import sys

import pytest
from launch import ROOT, mpiexec, run

README = open(os.path.join(ROOT, "README.md")).read()


def commands(section: str) -> list[str]:
    body = README.split(f"## {section}")[1].split("\n## ")[0]
    blocks = re.findall(r"```sh\n(.*?)```", body, re.S)
    lines = [line.split("  #")[0].strip() for b in blocks for line in b.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_quick_start_has_exactly_two_commands():
    assert commands("Quick start") == ["./dev.sh run", "./dev.sh test"]


@pytest.mark.mpi
@pytest.mark.skipif(
    not os.path.isfile(os.path.join(ROOT, ".venv/bin/python")),
    reason="./dev.sh run would create a new environment",
)
def test_quick_start_run():
    r = run(["./dev.sh", "run"], timeout=300)
    assert r.returncode == 0, r.stderr
    assert "time per iteration" in r.stdout and "loss per iteration" in r.stdout


SECTIONS = (
    "Examples",
    "Performance of the real compute",
    "GPT-3 proxy",
    "BERT proxy",
    "LLaMA and Mixtral proxy",
    "CosmoFlow proxy",
    "DLRM proxy",
    "ResNet proxy",
    "Allreduce algorithms",
    "Scaling sweeps",
)
EXAMPLES = [c for section in SECTIONS for c in commands(section)]


def marker(argv: list[str]) -> str:
    """What a command that worked prints."""
    if "sweep" in argv or "report" in argv:
        return "srun" if "--print-commands" in argv else ""
    if "--dry-run" in argv:
        return "plan valid"
    if "proxies.collectives" in argv or "collectives" in argv:
        return "# average busbw"
    if any(a.endswith("gpt2_step.py") for a in argv) or "proxies.gpt2.bench" in argv:
        return "ms/step median"
    return "time per iteration"


def test_examples_are_there():
    assert any(c.startswith("mpiexec -n 32 python -m proxies.gpt2 64 8") for c in EXAMPLES)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """One folder for all the examples (a report reads what the sweep before it wrote),
    outside the checkout: results/ and the /tmp/ paths the README names land there."""
    d = tmp_path_factory.mktemp("readme")
    for folder in ("configs", "benchmarks"):
        os.symlink(os.path.join(ROOT, folder), d / folder)
    return d


@pytest.mark.mpi
@pytest.mark.parametrize("command", EXAMPLES, ids=[c[:70] for c in EXAMPLES])
def test_example(command, workdir):
    # Not in the checkout: a sweep's results/ left there made the reader's next sweep run
    # 0 of its points. Only the README's own /tmp/ paths move (the checkout, and with it the
    # venv's executables, may itself be under /tmp).
    argv = [
        str(workdir / a[len("/tmp/") :]) if a.startswith("/tmp/") else a
        for a in shlex.split(command)
    ]
    argv = [mpiexec() if a == "mpiexec" else sys.executable if a == "python" else a for a in argv]
    r = run(argv, timeout=600, cwd=str(workdir), env={"PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    assert marker(argv) in r.stdout
    assert "Traceback" not in r.stderr
