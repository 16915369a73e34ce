"""Which tests of a module start MPI through tests/launch.py, read from the source (AST).

conftest.py uses it to refuse, at collection, a test that reaches `mpirun` or `mpiexec`
(tests/launch.py: the only ways the tests start a launcher) without the `mpi` marker, so
`pytest -m "not mpi"` stays a seconds-long inner loop and the marking cannot rot.

A test reaches a launcher when its body, a module-level helper it calls, or a fixture of the
same module it takes as a parameter does, transitively. Calls through another module or a
variable are not followed: the check is a guard for the common shape, not a proof.
"""

from __future__ import annotations

import ast
import functools

# The names tests/launch.py exports that start (or build the command line of) an mpiexec.
LAUNCHERS = frozenset({"mpirun", "mpiexec"})


def _called_names(fn: ast.AST) -> set[str]:
    """Names this function calls or takes as fixtures: `f(...)`, `launch.f(...)`, a bare
    reference to a launcher (passed on as a callable), its parameters."""
    out: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name):
                out.add(f.id)
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                if f.value.id == "launch":
                    out.add(f.attr)
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


def launching(source: str) -> frozenset[str]:
    """Names of the module's functions that reach a launcher (fixtures and helpers too)."""
    funcs = _functions(ast.parse(source))
    calls = {name: _called_names(fn) for name, fn in funcs.items()}
    reach = {name for name, c in calls.items() if c & LAUNCHERS}
    grown = True
    while grown:  # the transitive closure through module-level helpers and fixtures
        new = {name for name, c in calls.items() if c & reach} - reach
        reach |= new
        grown = bool(new)
    return frozenset(reach)


@functools.cache
def launching_in(path: str) -> frozenset[str]:
    with open(path, encoding="utf-8") as f:
        return launching(f.read())
