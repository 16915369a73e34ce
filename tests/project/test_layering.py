"""Two layering rules, read from the source with ast (nothing is imported, so no import side
effects and no MPI):

1. `proxies/core/` (the runtime that knows no model) imports nothing from a model package
   (gpt2, gpt3, transformer, cosmoflow, dlrm) or an app package (the collectives benchmark,
   sweep, calibrate, compare, report, the registry): only proxies.core.* and the `proxies`
   package itself (its __version__). Imports inside functions count too: a lazy import is
   still a dependency.
2. No import cycle between proxies modules at module level. Imports inside a function or a
   class body run when called, after every module involved has finished importing, so a
   cycle through them cannot see a half-initialised module; they are allowed (and are how a
   module may reach up a layer on demand). Imports under `if TYPE_CHECKING:` never run.

(The general architecture test is another file's; this one keeps to these two rules.)
"""

from __future__ import annotations

import ast
import os

from launch import ROOT

PACKAGE = os.path.join(ROOT, "proxies")


def modules() -> dict[str, str]:
    """Module name -> file, for every .py under proxies/."""
    out = {}
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(folder, f), ROOT)[: -len(".py")]
            parts = rel.split(os.sep)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = os.path.join(folder, f)
    return out


MODULES = modules()


def is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def imports(name: str, *, module_level: bool) -> list[tuple[int, str]]:
    """(line, imported proxies module) of one module; with module_level, only the imports
    that run when it is imported (not in a def or class body, not under TYPE_CHECKING)."""
    path = MODULES[name]
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []

    def target(base: str, names: list[str]) -> list[str]:
        # `from a.b import c`: the submodule a.b.c when there is one, else a.b itself
        subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES]
        return subs + ([base] if len(subs) < len(names) else [])

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.extend((node.lineno, a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                found.extend((node.lineno, t) for t in target(base, [a.name for a in node.names]))
            elif module_level and isinstance(
                node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
            ):
                continue  # runs later (see the module docstring)
            elif module_level and isinstance(node, ast.If) and is_type_checking(node):
                visit(node.orelse)
            else:
                visit([c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)])

    visit(tree.body)
    return [(line, m) for line, m in found if m == "proxies" or m.startswith("proxies.")]


def test_the_scan_sees_imports():
    # the rules below mean something only if the scan finds what is plainly there
    engine = {m for _, m in imports("proxies.core.engine", module_level=True)}
    assert {"proxies.core.collectives", "proxies.core.plan"} <= engine  # `from a import b`
    lazy = imports("proxies.core.machine", module_level=False)
    assert any(m == "proxies.core.collectives.steps" for _, m in lazy)
    assert not any(
        m == "proxies.core.collectives.steps"
        for _, m in imports("proxies.core.machine", module_level=True)
    )
    assert {"proxies.gpt2", "proxies.dlrm"} <= {
        m for _, m in imports("proxies.registry", module_level=True)
    }


def test_core_imports_no_model_or_app_package():
    bad = []
    for name in MODULES:
        if name == "proxies.core" or name.startswith("proxies.core."):
            for line, m in imports(name, module_level=False):
                if m != "proxies" and not (m == "proxies.core" or m.startswith("proxies.core.")):
                    bad.append(f"{MODULES[name]}:{line} imports {m}")
    assert not bad, "core/ must not import a model or app package:\n" + "\n".join(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing
    itself (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in graph[v]:
                    out.append(sorted(comp))
    return out


def test_cycles_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"a"}}) == [["a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_level_import_cycle():
    graph = {
        name: {m for _, m in imports(name, module_level=True) if m in MODULES and m != name}
        for name in MODULES
    }
    found = cycles(graph)
    detail = [
        " <-> ".join(comp)
        + ": "
        + "; ".join(f"{a} imports {b}" for a in comp for b in sorted(graph[a]) if b in comp)
        for comp in found
    ]
    assert not found, "module-level import cycles:\n" + "\n".join(detail)
