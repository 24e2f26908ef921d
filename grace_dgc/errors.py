"""Errors raised for bad configuration: each says what was wrong and what is accepted.

Every part validates its parameters with these helpers: numbers with :func:`check_range`
(finite unless infinity has a documented meaning), flags with :func:`check_bool`.
"""

import difflib
import math
import numbers
from collections.abc import Callable
from typing import Any, TypeVar, overload

import numpy as np

E = TypeVar("E", bound=BaseException)
N = TypeVar("N")  # check_range's kind: int or float


class GraceConfigError(ValueError):
    """A name, parameter or combination that grace_dgc cannot build."""


class GraceDataError(ValueError):
    """A data file that is not what its workload reads (corrupt, truncated, another format);
    the message names the file and what was expected."""


class GraceNonFiniteError(FloatingPointError):
    """A gradient held NaN or Inf on some rank and the policy is ``nonfinite="raise"``."""


class GraceCommError(RuntimeError):
    """A collective failed or timed out; the message names the ranks that did not answer."""


class StepDiscarded(GraceCommError):
    """A collective of this step failed in a fault-tolerant job (a replica group was lost): this
    group's step does not commit, and the way in discards it, grace's state as before (torchft
    decides per group; a group left behind heals from a peer: :mod:`grace_dgc.training.torchft`)."""

    on_every_rank = True  # the groups that exchanged with the lost one meet it alike: nothing to tell


def on_every_rank(error: E) -> E:
    """Mark ``error`` as raised alike on every rank (a handshake mismatch, the non-finite
    policy "raise"): the ranks stay in step, so nothing needs to tear the group down."""
    error.on_every_rank = True  # type: ignore[attr-defined]  # read with getattr(error, "on_every_rank", False)
    return error


@overload
def check_range(
    name: str,
    value: object,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    kind: Callable[[Any], N],
    allow_inf: bool = False,
) -> N: ...


@overload
def check_range(
    name: str,
    value: object,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    allow_inf: bool = False,
) -> float: ...


def check_range(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    kind: Callable[[Any], Any] = float,
    allow_inf: bool = False,
) -> Any:
    """Validate ``low <(=) value <(=) high`` and return ``kind(value)``.

    NaN is never accepted, infinity only with ``allow_inf`` (where it means something, e.g.
    a threshold nothing reaches). The message names the parameter and what is accepted,
    e.g. ``compress_ratio=1.5 is out of range; accepted: (0, 1]``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise GraceConfigError(f"{name}={value!r} must be a number of type {kind.__name__}")
    if math.isnan(value) or (math.isinf(value) and (kind is int or not allow_inf)):
        raise GraceConfigError(f"{name}={value!r} must be a finite number of type {kind.__name__}")
    if kind is int and int(value) != value:
        raise GraceConfigError(f"{name}={value!r} must be a number of type int")
    converted = kind(value)
    bad_low = low is not None and (converted <= low if low_open else converted < low)
    bad_high = high is not None and (converted >= high if high_open else converted > high)
    if bad_low or bad_high:
        left = ("(" if low_open else "[") + ("-inf" if low is None else f"{low:g}")
        right = ("inf" if high is None else f"{high:g}") + (")" if high_open else "]")
        raise GraceConfigError(f"{name}={value!r} is out of range; accepted: {left}, {right}")
    return converted


def closest(word: str, choices: Any) -> str | None:
    """The closest of ``choices`` to a misspelt ``word`` (difflib's match), else None: the one
    suggestion behind every "did you mean", here and in the apps on the library."""
    close = difflib.get_close_matches(word, [str(choice) for choice in choices], n=1)
    return close[0] if close else None


def did_you_mean(word: str, choices: Any) -> str:
    """`` Did you mean 'x'?`` for the :func:`closest` of ``choices`` to ``word``, else ``""``."""
    close = closest(word, choices)
    return f" Did you mean {close!r}?" if close else ""


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a real boolean (``True``/``False``, numpy's included), else an error:
    a truthy string such as ``"false"`` must not silently mean True."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise GraceConfigError(f"{name}={value!r} must be True or False (a boolean, not {type(value).__name__})")


def check_choice(name: str, value: object, choices: Any) -> Any:
    """``value`` if it is one of ``choices`` (names, usually a dict's keys), else an error listing
    them; a value of another type (a list where a name is expected) is named too, not a TypeError."""
    if isinstance(value, str) and value in choices:
        return value
    listed = ", ".join(map(str, choices))
    kind = "" if isinstance(value, str) else f" (of type {type(value).__name__}: a name is expected)"
    raise GraceConfigError(f"{name}={value!r}{kind}; accepted: {listed}")


def parse_value(text: str) -> Any:
    """A command-line or ``--param`` value: a Python literal (``0.01``, ``[1, 2]``, ``None``),
    ``true``/``false`` in any case as booleans, else the text itself."""
    import ast

    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
