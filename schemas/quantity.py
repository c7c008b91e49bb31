"""Kubernetes resource quantities ("64", "500m", "512Gi", "1.5", "2e3") as exact integers.

CPU is counted in millicores and memory in bytes, so the core only ever adds integers.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from functools import lru_cache

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
}
_RE = re.compile(r"^([+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]?)$")
_MAX = 2**62


class QuantityError(ValueError):
    """A quantity string that Kubernetes would not accept either."""


def parse_quantity(value: str | int | float) -> Decimal:
    """Parse a Kubernetes quantity into an exact Decimal of base units."""
    if isinstance(value, bool):
        raise QuantityError(
            f"quantity must be a number or a string like '500m' or '4Gi', not {value!r}"
        )
    if isinstance(value, int | float):
        if value != value or value in (float("inf"), float("-inf")):
            raise QuantityError(f"quantity {value!r} is not finite")
        number = Decimal(str(value))
    else:
        text = value.strip()
        match = _RE.match(text)
        if match is None or len(text) > 64:
            raise QuantityError(
                f"invalid quantity {value!r}: use a number with an optional suffix, "
                "e.g. '2', '500m', '16Gi', '1.5G'"
            )
        digits, suffix = match.groups()
        try:
            number = Decimal(digits)
        except (InvalidOperation, ArithmeticError) as exc:
            raise QuantityError(f"invalid quantity {value!r}") from exc
        try:
            number *= _BINARY[suffix] if suffix in _BINARY else _DECIMAL[suffix]
        except ArithmeticError:  # decimal.Overflow on an absurd exponent
            raise QuantityError(f"quantity {value!r} is too large") from None
    if number < 0:
        raise QuantityError(f"quantity {value!r} must not be negative")
    if number > _MAX:
        raise QuantityError(f"quantity {value!r} is too large")
    return number


@lru_cache(maxsize=4096)
def _cpu_milli(value: str | int | float) -> int:
    milli = parse_quantity(value) * 1000
    return int(milli.to_integral_value(rounding="ROUND_CEILING"))


@lru_cache(maxsize=4096)
def _memory_bytes(value: str | int | float) -> int:
    return int(parse_quantity(value).to_integral_value(rounding="ROUND_CEILING"))


def cpu_milli(value: str | int | float) -> int:
    """CPU quantity in millicores, rounded up as Kubernetes does. Cached: the same few
    strings ("8", "500m") arrive in every message, and Decimal parsing is slow."""
    if type(value) is int and value >= 0:
        return value * 1000
    if isinstance(value, bool):
        return parse_quantity(value)  # type: ignore[return-value]  # raises
    return _cpu_milli(value)


def memory_bytes(value: str | int | float) -> int:
    """Memory quantity in bytes, rounded up (cached like cpu_milli)."""
    if type(value) is int and value >= 0:
        return value
    if isinstance(value, bool):
        return parse_quantity(value)  # type: ignore[return-value]  # raises
    return _memory_bytes(value)
