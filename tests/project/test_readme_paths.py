"""Every file or folder the README cites in backticks exists, and its Layout lists every
top-level folder of the checkout."""

import glob
import os
import re

from launch import ROOT

README = open(os.path.join(ROOT, "README.md")).read()
TOP = ("proxies/", "configs/", "benchmarks/", "tests/", ".ci/")
# Paths the README names as outputs or placeholders, not files of the checkout.
MADE = ("results/", "proxies/<model>/", "proxies/toy/")  # toy: "Adding a proxy"'s example
OTHER = ("proxies/comm_only/",)  # spcl/DNN-cpp-proxies' files, cited as that project's


def cited() -> list[str]:
    """`configs/...`, `benchmarks/...`, `proxies/...`, `tests/...`, `.ci/...` in backticks
    (the first word: a command's path, not its arguments)."""
    words = [m.split()[0] for m in re.findall(r"`([^`\n]+)`", README) if m.split()]
    return sorted({w.rstrip(",.:;)") for w in words if w.startswith(TOP)})


def test_cited_paths_exist():
    paths = cited()
    assert len(paths) > 10  # the pattern finds them
    missing = [
        p for p in paths if not p.startswith(MADE + OTHER) and not glob.glob(os.path.join(ROOT, p))
    ]
    assert missing == []


def test_layout_lists_every_folder():
    layout = README.split("## Layout")[1].split("\n## ")[0]
    folders = [
        f + "/"
        for f in sorted(os.listdir(ROOT))
        if os.path.isdir(os.path.join(ROOT, f))
        and f not in (".git", ".venv", "results", "build")
        and not f.startswith(".venv-")  # dev.sh's other MPIs' venvs (.gitignore)
        and not f.endswith(("_cache", ".egg-info"))
        and not f.startswith("__")
    ]
    packages = [
        f"proxies/{f}/"
        for f in sorted(os.listdir(os.path.join(ROOT, "proxies")))
        if os.path.isfile(os.path.join(ROOT, "proxies", f, "__init__.py"))
    ]
    unlisted = [f for f in folders + packages if f not in layout]
    assert unlisted == []
