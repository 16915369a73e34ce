"""The shipped configs (sweep files, machine files) found from a checkout or an installed
wheel, so `--machine configs/machines/dgx-a100.yaml`, `--machine dgx-a100` and
`python -m proxies sweep configs/smoke.yaml` work from any folder.

In a checkout the files live in configs/ at the top; the wheel installs the same tree as
proxies/configs/ (pyproject.toml / setup.py map one onto the other), so nothing is copied
and the README's paths stay true.
"""

from __future__ import annotations

import os

PREFIX = "configs/"


def root() -> str | None:
    """The folder holding the shipped configs: proxies/configs/ in an installed wheel, the
    checkout's configs/ beside the package otherwise; None when neither exists."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../proxies
    for folder in (os.path.join(package, "configs"), os.path.join(package, "..", "configs")):
        if os.path.isdir(folder):
            return os.path.normpath(folder)
    return None


def resolve(path: str, kind: str = "") -> str:
    """`path` itself when it exists (a user's file always wins); else the shipped file it
    names: `configs/X` -> <root>/X, a bare name `N` -> <root>/<kind>/N.yaml (kind
    "machines" for --machine, "" for sweep files). Unchanged when nothing matches, so the
    caller's "no such file" message names what the user typed."""
    if os.path.exists(path) or os.path.isabs(path):
        return path
    base = root()
    if base is None:
        return path
    candidates = []
    if path.startswith(PREFIX):
        candidates.append(os.path.join(base, path[len(PREFIX) :]))
    elif "/" not in path and os.sep not in path:
        name = path if path.endswith((".yaml", ".yml")) else path + ".yaml"
        candidates.append(os.path.join(base, kind, name))
    return next((c for c in candidates if os.path.isfile(c)), path)


def shipped(kind: str = "") -> list[str]:
    """Names of the shipped .yaml files of one kind ("machines", or "" for sweep files)."""
    base = root()
    folder = os.path.join(base, kind) if base else None
    if folder is None or not os.path.isdir(folder):
        return []
    return sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))
