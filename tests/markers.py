"""Which tests of a module start MPI, or another process, read from the source (AST).

conftest.py uses it to refuse, at collection, a test that reaches `mpirun` or `mpiexec`
(tests/launch.py: the only ways the tests start a launcher) without the `mpi` marker, and a
test that starts any other process (tests/launch.py's `run`, `subprocess.run`, `Popen`, ...:
an interpreter that imports NumPy and the proxies, a CLI run end to end, a wheel build)
without `slow` or `mpi`, so `pytest -m "not mpi and not slow"` stays a seconds-long inner
loop of in-process tests and the marking cannot rot.

A test reaches a launcher (or a spawn) when its body, a module-level helper it calls, or a
fixture of the same module it takes as a parameter does, transitively. Calls through another
module (a sweep runner starting its points) or a variable are not followed: the check is a
guard for the common shape, not a proof.
"""

from __future__ import annotations

import ast
import functools

# The names tests/launch.py exports that start (or build the command line of) an mpiexec.
LAUNCHERS = frozenset({"mpirun", "mpiexec"})
# What starts a process: subprocess's functions, and tests/launch.py's `run` (imported by
# name, `from launch import run [as x]`, or called as `launch.run`).
SUBPROCESS = frozenset({"run", "Popen", "call", "check_call", "check_output", "getoutput"})
SPAWN = "<spawn>"  # the pseudo-name a call that starts a process adds to a function's calls


def _called_names(fn: ast.AST, runs: frozenset[str] = frozenset()) -> set[str]:
    """Names this function calls or takes as fixtures: `f(...)`, `launch.f(...)`, a bare
    reference to a launcher (passed on as a callable), its parameters; SPAWN if it starts a
    process (`subprocess.X(...)`, `launch.run(...)`, or a call of a name in `runs`: what
    tests/launch.py's run is imported as)."""
    out: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name):
                out.add(f.id)
                if f.id in runs:
                    out.add(SPAWN)
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                if f.value.id == "launch":
                    out.add(f.attr)
                    if f.attr == "run":
                        out.add(SPAWN)
                elif f.value.id == "subprocess" and f.attr in SUBPROCESS:
                    out.add(SPAWN)
        elif isinstance(node, ast.Name) and node.id in LAUNCHERS:
            out.add(node.id)
    if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
        out |= {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    return out


def _functions(tree: ast.Module) -> dict[str, ast.AST]:
    """Module-level functions and methods of module-level classes, by name."""
    out: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                    out[sub.name] = sub
    return out


def _launch_runs(tree: ast.Module) -> frozenset[str]:
    """The local names of tests/launch.py's `run` (`from launch import run as run_cmd`)."""
    return frozenset(
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module == "launch"
        for alias in node.names
        if alias.name == "run"
    )


def _reaching(calls: dict[str, set[str]], targets: frozenset[str]) -> frozenset[str]:
    """Functions whose calls include a target, transitively through module-level helpers
    and fixtures."""
    reach = {name for name, c in calls.items() if c & targets}
    grown = True
    while grown:
        new = {name for name, c in calls.items() if c & reach} - reach
        reach |= new
        grown = bool(new)
    return frozenset(reach)


@functools.cache
def _calls(source: str) -> dict[str, set[str]]:
    tree = ast.parse(source)
    runs = _launch_runs(tree)
    return {name: _called_names(fn, runs) for name, fn in _functions(tree).items()}


def launching(source: str) -> frozenset[str]:
    """Names of the module's functions that reach a launcher (fixtures and helpers too)."""
    return _reaching(_calls(source), LAUNCHERS)


def spawning(source: str) -> frozenset[str]:
    """Names of the module's functions that start a process of any kind, a launcher
    included (fixtures and helpers too)."""
    return _reaching(_calls(source), LAUNCHERS | {SPAWN})


@functools.cache
def _source(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def launching_in(path: str) -> frozenset[str]:
    return launching(_source(path))


def spawning_in(path: str) -> frozenset[str]:
    return spawning(_source(path))
