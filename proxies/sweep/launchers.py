"""Launcher templates (`launcher:` of a sweep file, --launcher): a name or a template with
{ranks} and {command}. Their own module: the schema validates them and launch.py uses
them, and launch.py builds on the schema's Point (no import cycle between the two)."""

from __future__ import annotations

import shlex

LAUNCHERS = {
    "mpiexec": "mpiexec -n {ranks} {command}",
    "mpirun": "mpirun -n {ranks} {command}",
    "srun": "srun -n {ranks} {command}",
}
PLACEHOLDERS = ("{ranks}", "{command}")


def template(launcher: str) -> str:
    """The template for a launcher name or a template; ValueError says what is wrong."""
    t = LAUNCHERS.get(launcher.strip(), launcher)
    if any(ord(c) < 32 or ord(c) == 127 for c in t):
        raise ValueError(f"{launcher!r}: a launcher may not hold a newline or control character")
    try:
        words = shlex.split(t)
    except ValueError as e:
        raise ValueError(f"{launcher!r}: {e}") from None
    if words.count("{command}") != 1:
        raise ValueError(
            f"{launcher!r}: expected mpiexec, mpirun, srun, or a template with {{command}} "
            "as one word and {ranks}, e.g. 'mpiexec -n {ranks} --bind-to core {command}'"
        )
    if "{ranks}" not in t:
        raise ValueError(f"{launcher!r}: the template must say where {{ranks}} goes")
    rest = t
    for ph in PLACEHOLDERS:
        rest = rest.replace(ph, "")
    if "{" in rest or "}" in rest:
        raise ValueError(f"{launcher!r}: only {{ranks}} and {{command}} may appear in braces")
    return t
