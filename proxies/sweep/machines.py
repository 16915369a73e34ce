"""The machine model of a sweep run (`machine: FILE`, `machine_set`, `ranks_per_node`,
`predict`), resolved and validated when the sweep file is loaded, and the words it adds to
every point's command line:

    --machine /abs/FILE [--machine-set KEY=VALUE ...] [--ranks-per-node N] [--predict MODE]

A measured point carries these so its JSON holds the prediction beside the measurement; a
predicted-only point (`predict_ranks`) runs `--dry-run --world-size N` with them.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class MachineSpec:
    file: str  # as written in the sweep file (for records and messages)
    path: str  # resolved, absolute: what the proxy is given
    overrides: tuple[str, ...] = ()  # "KEY=VALUE", as --machine-set takes them
    ranks_per_node: int | None = None
    predict: str | None = None  # --predict; None: the proxy's default
    digest: str = ""  # of the file's bytes: a predicted point is redone when it changes

    def argv(self) -> list[str]:
        words = ["--machine", self.path]
        for text in self.overrides:
            words += ["--machine-set", text]
        if self.ranks_per_node is not None:
            words += ["--ranks-per-node", str(self.ranks_per_node)]
        if self.predict is not None:
            words += ["--predict", self.predict]
        return words

    def identity(self) -> dict:
        """What a prediction depends on besides the point (part of a predicted point's id).
        The file's content, not its path: moving the results or the checkout keeps them."""
        return {
            "digest": self.digest,
            "set": list(self.overrides),
            "ranks_per_node": self.ranks_per_node,
            "predict": self.predict,
        }


def override_text(key: str, value: object) -> str:
    """KEY=VALUE for --machine-set; the proxy reads VALUE as YAML, so a list or mapping is
    written as JSON (valid YAML) and null removes the key."""
    if value is None:
        return f"{key}=null"
    if isinstance(value, bool):
        return f"{key}={str(value).lower()}"
    if isinstance(value, (list, dict)):
        return f"{key}={json.dumps(value)}"
    return f"{key}={value}"


def resolve(sweep_path: str, file: str) -> str | None:
    """The machine file: absolute as given, else beside the sweep file, else from the
    current directory; None when none exists."""
    if os.path.isabs(file):
        candidates = [file]
    else:
        candidates = [os.path.join(os.path.dirname(os.path.abspath(sweep_path)), file), file]
    for c in candidates:
        if os.path.isfile(c):
            return os.path.abspath(c)
    return None


def spec(
    sweep_path: str,
    file: str,
    file_key: str,
    sets: dict[str, tuple[object, str]],
    ranks_per_node: tuple[int, str] | None,
    predict: str | None,
    fail,
) -> MachineSpec:
    """Resolve and validate with proxies.core.machine.load, as the proxy will: a problem of
    the file is reported under its key, one of an override under the key that set it."""
    from proxies.core import machine as machines

    path = resolve(sweep_path, file)
    if path is None:
        here = os.path.dirname(os.path.abspath(sweep_path))
        fail(
            file_key,
            f"{file}: no such file (looked beside the sweep file, in {here}/, and in the "
            "current directory)",
        )
    try:
        machines.load(path)
    except machines.MachineError as e:
        fail(file_key, str(e))
    texts = [override_text(k, v) for k, (v, _) in sets.items()]
    rpn = ranks_per_node[0] if ranks_per_node else None
    try:
        # All together, as the proxy applies them (inter_node=null needs switch=null too).
        machines.load(path, texts, rpn)
    except machines.MachineError as e:
        # The file alone is valid: the message names the override at fault (the machine
        # module labels keys set by --machine-set / --ranks-per-node so).
        msg, where = str(e), file_key
        for key, (_, at) in sets.items():
            if f"--machine-set {key}" in msg:
                where = at
        if ranks_per_node and "--ranks-per-node" in msg:
            where = ranks_per_node[1]
        fail(where, msg)
    with open(path, "rb") as f:
        digest = hashlib.sha1(f.read()).hexdigest()[:16]
    return MachineSpec(file, path, tuple(texts), rpn, predict, digest)
