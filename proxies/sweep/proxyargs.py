"""A proxy's command line, read from its own argparse parser: which sweep `args` are
positional (by name, in order), which are options, which are flags, and whether a value is
one the proxy accepts. Checking against the parser means a sweep file is validated by the
same rules as the command it will launch, for every proxy the registry lists.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from proxies import registry

# Options the sweep itself sets on every launch.
RESERVED = ("json", "dry_run", "world_size", "help")
# Options the sweep sets from its own keys (validated there, paths resolved there).
MACHINE_KEYS = ("machine", "machine_set", "ranks_per_node", "predict")


@dataclass(frozen=True)
class ProxyArgs:
    """The arguments of `python -m proxies.<proxy>`.

    `known` is False when its parser recorded no `arguments` (not a cli.Parser): every
    arg is then passed as `--name value` (true/false as a bare flag or nothing) unchecked."""

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
    """Whether `proxy` is a registered proxy that can run (proxies/registry.py)."""
    return registry.proxy(proxy) is not None


def proxies() -> list[str]:
    """The proxies installed (the registry's, the app commands left out)."""
    return registry.proxies()


def lookup(proxy: str) -> ProxyArgs | None:
    """The proxy's arguments, read from its spec's parser; None when no such proxy is
    installed. A proxy module that fails to import raises ImportError with the reason."""
    spec = registry.proxy(proxy)
    if spec is None:
        return None
    try:
        p = spec.parser()
    except Exception as e:  # a proxy being written: say so, do not crash the sweep
        raise ImportError(f"importing {spec.module}: {type(e).__name__}: {e}") from None
    return from_parser(proxy, p)


def from_parser(proxy: str, p: argparse.ArgumentParser) -> ProxyArgs:
    """The arguments a cli.Parser recorded (`arguments`: argparse keeps no public list of
    its actions); another parser's are unknown, and its args go through unchecked."""
    recorded = getattr(p, "arguments", None)
    if recorded is None:
        return ProxyArgs(proxy, known=False)
    actions = {a.dest: a for a in recorded if a.dest != argparse.SUPPRESS}
    positionals = tuple(a.dest for a in recorded if not a.option_strings)
    return ProxyArgs(proxy, True, positionals, actions)
