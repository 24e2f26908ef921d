"""Errors raised for bad configuration: each says what was wrong and what is accepted."""
import numbers


class GraceConfigError(ValueError):
    """A name, parameter or combination that grace_dgc cannot build."""


def check_range(name, value, low=None, high=None, *, low_open=False, high_open=False, kind=float):
    """Validate ``low <(=) value <(=) high`` and return ``kind(value)``.

    The message names the parameter and the accepted interval, e.g.
    ``compress_ratio=1.5 is out of range; accepted: (0, 1]``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or (
            kind is int and int(value) != value):
        raise GraceConfigError(f"{name}={value!r} must be a number of type {kind.__name__}")
    converted = kind(value)
    bad_low = low is not None and (converted <= low if low_open else converted < low)
    bad_high = high is not None and (converted >= high if high_open else converted > high)
    if bad_low or bad_high:
        left = ("(" if low_open else "[") + ("-inf" if low is None else f"{low:g}")
        right = ("inf" if high is None else f"{high:g}") + (")" if high_open else "]")
        raise GraceConfigError(f"{name}={value!r} is out of range; accepted: {left}, {right}")
    return converted
