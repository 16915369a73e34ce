"""Quantities with units, as machine files write them: '15 us', '25 Gb/s', '150 TFLOP/s'.

Every time, bandwidth and rate carries its unit: a bare 10 could mean Gb/s or GB/s, a
factor of 8, so it is refused. Case matters only where it must: 'Gb/s' is bits, 'GB/s'
bytes; 'gb/s' is bits too (the b decides), 'kB/s' and 'KB/s' are both 1000 bytes/s.

    time       s, ms, us (µs), ns
    bandwidth  B/s kB/s MB/s GB/s TB/s (1000s), KiB/s MiB/s GiB/s TiB/s (1024s),
               b/s kb/s Mb/s Gb/s Tb/s (bits, 1000s; 'Gbit/s' and 'Gbps' too)
    rate       FLOP/s, kFLOP/s ... PFLOP/s (or FLOPS)
    count      a whole number of bytes: B, KB MB GB TB (1000s), KiB MiB GiB TiB (1024s),
               or a bare integer (bytes are not ambiguous)
"""

from __future__ import annotations

import math
import re

KINDS = ("time", "bandwidth", "rate", "count")

NOUNS = {"time": "time", "bandwidth": "bandwidth", "rate": "rate", "count": "size"}
EXAMPLES = {
    "time": "a time like '15 us' or '0.5 ms'",
    "bandwidth": "a bandwidth like '10 Gb/s' or '25 GB/s'",
    "rate": "a rate like '100 GFLOP/s' or '150 TFLOP/s'",
    "count": "a size like '2 KiB', '64 MB' or 4096 (bytes)",
}

TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ns": 1e-9}
DECIMAL = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
BINARY = {"k": 2.0**10, "m": 2.0**20, "g": 2.0**30, "t": 2.0**40}

_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|[+-]?(?:inf|nan)"
_QUANTITY = re.compile(rf"\s*({_NUMBER})\s*(.*?)\s*", re.IGNORECASE)
_RATE = re.compile(r"([kmgtp]?)flop(?:/s|s)")
# prefix, binary i, then bytes (B) or bits (b, bit), then per second (/s or ps)
_BANDWIDTH = re.compile(r"([kKmMgGtTpP]?)([iI]?)(B|b|bit|Bit)(/[sS]|ps)")
_SIZE = re.compile(r"([kKmMgGtTpP]?)([iI]?)(B)")


def _prefix(letter: str, binary: str) -> float | None:
    if binary:
        return BINARY.get(letter.lower())  # None for 'iB' or 'PiB'
    return DECIMAL[letter.lower()]


def classify(unit: str) -> tuple[str, float] | None:
    """(kind, scale to seconds, bytes/s, FLOP/s or bytes) of a unit, None if unknown."""
    if unit.lower() in TIME or unit in TIME:
        return "time", TIME.get(unit, TIME.get(unit.lower(), 0.0))
    m = _RATE.fullmatch(unit.lower())
    if m:
        return "rate", DECIMAL[m.group(1)]
    m = _BANDWIDTH.fullmatch(unit)
    if m:
        scale = _prefix(m.group(1), m.group(2))
        bits = m.group(3) != "B"
        return None if scale is None else ("bandwidth", scale / 8 if bits else scale)
    m = _SIZE.fullmatch(unit)
    if m:
        scale = _prefix(m.group(1), m.group(2))
        return None if scale is None else ("count", scale)
    return None


def parse_quantity(text: object, kind: str) -> float:
    """The value of `text` in seconds, bytes/s, FLOP/s or bytes (kind 'count').

    Raises ValueError with a one-line message (what was expected, what came) that callers
    prefix with the file and key."""
    if kind not in KINDS:
        raise ValueError(f"unknown quantity kind {kind!r} (choose from {', '.join(KINDS)})")
    want = f"expected {EXAMPLES[kind]}"
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise ValueError(f"{want}, got {text!r}")
    if isinstance(text, (int, float)):
        number, unit, shown = float(text), "", repr(text)
    else:
        m = _QUANTITY.fullmatch(text)
        if not m:
            raise ValueError(f"{want}, got {text!r}")
        number, unit, shown = float(m.group(1)), m.group(2), repr(text)
    if not unit:
        if kind != "count":
            hint = " (10 could mean Gb/s or GB/s)" if kind == "bandwidth" else ""
            raise ValueError(f"{want}, got a bare number {shown}: give its unit{hint}")
        scale = 1.0
    else:
        found = classify(unit)
        if found is None or found[0] != kind:
            raise ValueError(f"{want}, got {shown}")
        scale = found[1]
    # dividing by 1e6 is exact where multiplying by 1e-6 is not: 15 us = 1.5e-05 exactly
    value = number / round(1 / scale) if scale < 1 else number * scale
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{shown} is not a positive, finite {NOUNS[kind]}")
    if kind == "count" and value != round(value):
        raise ValueError(f"{shown} is not a whole number of bytes")
    return value


def _units(kind: str) -> list[tuple[str, float]]:
    """(unit, scale) candidates for writing, largest first."""
    if kind == "time":
        return [("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)]
    if kind == "count":
        return [("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10), ("B", 1)]
    suffix = "B/s" if kind == "bandwidth" else "FLOP/s"
    out = [(p + suffix, DECIMAL[p.lower()]) for p in ("P", "T", "G", "M", "k", "")]
    if kind == "bandwidth":
        out += [(p + "iB/s", BINARY[p.lower()]) for p in ("T", "G", "M", "K")]
    return out


def format_quantity(value: float, kind: str) -> str:
    """Text that parse_quantity reads back: in the largest unit under the value, 6
    significant digits, when that gives the value back (to 1e-9: '1.426 us', not
    '1426 ns'), else in the unit that does ('1 GiB/s', not '1.07374 GB/s'); measured
    figures with more digits keep 6 in the first unit (they are not more precise)."""
    if kind not in KINDS:
        raise ValueError(f"unknown quantity kind {kind!r}")
    if kind == "count":
        n = int(value)
        unit, scale = next((u, int(s)) for u, s in _units(kind) if n % s == 0)
        return f"{n // scale} {unit}"
    units = _units(kind)
    base = next(u for u in units if u[1] == 1.0)
    natural = next(((u, s) for u, s in units if value >= s), units[-1] if kind == "time" else base)
    # then the other units, those writing the value nearest to 10 first
    units.sort(key=lambda u: abs(math.log10(value / u[1]) - 1))
    for unit, scale in [natural, *units]:
        text = f"{value / scale:.6g} {unit}"
        if "e" not in text and math.isclose(parse_quantity(text, kind), value, rel_tol=1e-9):
            return text
    return f"{value / natural[1]:.6g} {natural[0]}"
