"""A proxy's command line, read from its own argparse parser: which sweep `args` are
positional (by name, in order), which are options, which are flags, and whether a value is
one the proxy accepts. Checking against the parser means a sweep file is validated by the
same rules as the command it will launch, for any `proxies.<name>` module.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from dataclasses import dataclass, field

# Options the sweep itself sets on every launch.
RESERVED = ("json", "dry_run", "world_size", "help")
# Options the sweep sets from its own keys (validated there, paths resolved there).
MACHINE_KEYS = ("machine", "machine_set", "ranks_per_node", "predict")


@dataclass(frozen=True)
class ProxyArgs:
    """The arguments of `python -m proxies.<proxy>`.

    `known` is False when the module offers no `parser()`: every arg is then passed as
    `--name value` (true/false as a bare flag or nothing) unchecked."""

    proxy: str
    known: bool
    positionals: tuple[str, ...] = ()
    actions: dict[str, argparse.Action] = field(default_factory=dict)  # dest -> action

    def defaults(self) -> dict[str, object]:
        """Defaults the proxy would use (for expressions naming an arg the file leaves out)."""
        return {
            d: a.default
            for d, a in self.actions.items()
            if a.default is not None
            and a.default is not argparse.SUPPRESS
            and d not in RESERVED
            and d not in MACHINE_KEYS
        }

    def check(self, dest: str, value: object) -> str | None:
        """None when `value` is acceptable for `dest`, else the problem in words."""
        if dest in RESERVED:
            return "set by the sweep itself, not in args"
        if dest in MACHINE_KEYS:
            return (
                f"not in args: write {dest}: beside args (the sweep validates "
                "the machine model and finds the file beside the sweep file)"
            )
        if not self.known:
            return None
        action = self.actions.get(dest)
        if action is None:
            options = sorted(set(self.actions) - set(self.positionals) - set(RESERVED))
            names = ", ".join([*self.positionals, *options])
            return f"python -m proxies.{self.proxy} has no argument {dest!r} (it has: {names})"
        if action.nargs == 0:
            if not isinstance(value, bool):
                return f"{option(action)} is a flag: expected true or false, got {value!r}"
            return None
        if isinstance(value, bool):
            return f"expected a value for {option(action)}, got {str(value).lower()}"
        text = fmt(value)
        try:
            converted = action.type(text) if callable(action.type) else text
        except (argparse.ArgumentTypeError, TypeError, ValueError, OverflowError) as e:
            return str(e) or f"invalid value {text!r}"
        if action.choices is not None and converted not in action.choices:
            choices = ", ".join(map(str, action.choices))
            return f"{text!r} is not one of: {choices}"
        return None

    def argv(self, args: dict[str, object]) -> list[str]:
        """Command-line words for resolved args (already checked). Positionals first, in the
        parser's order; they must be a prefix (the proxy cannot take STAGES without LAYERS)."""
        words = []
        given = [p for p in self.positionals if p in args]
        for p in self.positionals[: len(given)]:
            words.append(fmt(args[p]))
        for dest, value in args.items():
            if dest in self.positionals:
                continue
            action = self.actions.get(dest)
            flag = option(action) if action else "--" + dest.replace("_", "-")
            if (action is not None and action.nargs == 0) or isinstance(value, bool):
                if value:
                    words.append(flag)  # true: the bare flag; false: left out
                continue
            words += [flag, fmt(value)]
        return words

    def positional_gap(self, args: dict[str, object]) -> str | None:
        """The first positional left out before one that is given, if any."""
        seen_gap = None
        for p in self.positionals:
            if p not in args:
                seen_gap = seen_gap or p
            elif seen_gap:
                return seen_gap
        return None


def option(action: argparse.Action) -> str:
    """The long option (`--seq-len`), else the first one given."""
    longs = [s for s in action.option_strings if s.startswith("--")]
    return longs[0] if longs else action.option_strings[0]


def fmt(value: object) -> str:
    return str(value)


def installed(proxy: str) -> bool:
    """Whether `python -m proxies.<proxy>` can run (a package with a __main__, not a folder
    still being written)."""
    try:
        return importlib.util.find_spec(f"proxies.{proxy}.__main__") is not None
    except (ImportError, ValueError):
        return False


# Runnable, but not proxies a sweep launches: the collectives benchmark's JSON holds rows of
# sizes and bandwidths, not the iteration times a sweep records and reports.
TOOLS = ("sweep", "report", "calibrate", "collectives", "compare")


def proxies() -> list[str]:
    """The proxies installed: packages proxies.<name> with a __main__, tools left out."""
    import pkgutil

    import proxies as package

    found = (m.name for m in pkgutil.iter_modules(package.__path__) if m.ispkg)
    return sorted(n for n in found if n not in TOOLS and installed(n))


def lookup(proxy: str) -> ProxyArgs | None:
    """The proxy's arguments; None when `proxies.<proxy>` is not installed. The parser is
    `parser()` in `proxies.<proxy>.proxy` or in `proxies.<proxy>` itself. A module that
    exists but fails to import raises ImportError with the reason."""
    if not installed(proxy):
        return None
    for name in (f"proxies.{proxy}.proxy", f"proxies.{proxy}"):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue
            raise ImportError(f"importing {name}: {e}") from None
        except Exception as e:  # a proxy being written: say so, do not crash the sweep
            raise ImportError(f"importing {name}: {type(e).__name__}: {e}") from None
        make = getattr(module, "parser", None)
        if callable(make):
            p = make()
            if isinstance(p, argparse.ArgumentParser):
                return from_parser(proxy, p)
    return ProxyArgs(proxy, known=False)


def from_parser(proxy: str, p: argparse.ArgumentParser) -> ProxyArgs:
    actions = {a.dest: a for a in p._actions if a.dest != argparse.SUPPRESS}
    positionals = tuple(a.dest for a in p._actions if not a.option_strings)
    return ProxyArgs(proxy, True, positionals, actions)
