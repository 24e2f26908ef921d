"""Parsing and printing of rates, latencies, byte counts and durations (shared by the
survey's config, ``project`` and ``netem``)."""

import math
import os
import re

from grace_dgc.errors import GraceConfigError

# tc's rate units, in bits per second. tc reads "bps" as *bytes* per second, which is easy
# to get wrong, so only the unambiguous "bit" forms are accepted.
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_rate(text: object) -> float:
    """``"1gbit"`` → 1e9 bits per second. Accepts a number with bit, kbit, mbit, gbit or tbit
    (decimal prefixes, as tc uses them), or a plain number of bits per second."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), "bit"
    else:
        match = _RATE.match(str(text))
        if not match:
            raise GraceConfigError(
                f"bandwidth {text!r} is not a rate; accepted: a number with one of "
                f"{', '.join(_RATE_UNITS)} (e.g. 1gbit, 100mbit)"
            )
        value, unit = float(match.group(1)), (match.group(2) or "bit").lower()
        if unit not in _RATE_UNITS:
            hint = " (tc reads 'bps' as bytes per second; say mbit/gbit)" if unit.endswith("bps") else ""
            raise GraceConfigError(
                f"bandwidth {text!r}: unknown unit {unit!r}{hint}; accepted: "
                f"{', '.join(_RATE_UNITS)} (e.g. 1gbit, 100mbit)"
            )
    bits = value * _RATE_UNITS[unit]
    if not (bits > 0 and math.isfinite(bits)):
        raise GraceConfigError(f"bandwidth {text!r} must be a positive rate, e.g. 1gbit")
    return bits


def parse_latency(value: object) -> float:
    """Latency in milliseconds (a number ≥ 0, or a string like ``"0.1"`` / ``"0.1ms"``)."""
    text = str(value).strip().lower()
    if text.endswith("ms"):
        text = text[:-2]
    try:
        ms = float(text)
    except ValueError:
        raise GraceConfigError(f"latency {value!r} is not a number of milliseconds (e.g. 0.1)") from None
    if not (ms >= 0 and math.isfinite(ms)):
        raise GraceConfigError(f"latency {value!r} must be >= 0 milliseconds")
    return ms


def format_rate(bits_per_second: float) -> str:
    for unit, scale in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:g}{unit}"
    return f"{bits_per_second:g}bit"


def human_bytes(n: float | None) -> str:
    """``1536`` → ``"1.5 KB"`` (binary prefixes: 1 KB = 1024 bytes, as the seeds' tables)."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "n/a"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} GB"


def human_seconds(seconds: float | None) -> str:
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "n/a"
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} minutes"
    return f"{seconds / 3600:.3g} hours"


def shown_path(spec: str | None) -> str | None:
    """A path, or a ``file.py:factory`` spec, as outputs show it: the file's name only. A
    report or a results line carries no absolute path (a user's home, a cluster's layout); a
    script is identified by its content hash beside it."""
    if not spec:
        return spec
    target, colon, attr = spec.rpartition(":")
    if colon and target.endswith(".py"):
        return f"{os.path.basename(target)}:{attr}"
    return os.path.basename(spec) if os.path.isabs(spec) else spec
