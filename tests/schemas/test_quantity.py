"""Kubernetes quantities as exact integers: millicores and bytes."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.quantity import QuantityError, cpu_milli, memory_bytes, parse_quantity


@pytest.mark.parametrize(
    ("value", "milli"),
    [
        ("64", 64_000),
        ("500m", 500),
        ("1.5", 1500),
        ("2e3", 2_000_000),
        ("0.1", 100),
        ("0.0001", 1),  # rounded up, as Kubernetes does
        ("1k", 1_000_000),
        (" 4 ", 4000),
        ("+2", 2000),
        (8, 8000),
        (0.25, 250),
        ("1000000n", 1),
        ("0", 0),
    ],
)
def test_cpu_milli(value: str | int | float, milli: int) -> None:
    assert cpu_milli(value) == milli


@pytest.mark.parametrize(
    ("value", "size"),
    [
        ("512Gi", 512 * 2**30),
        ("1Ki", 1024),
        ("1.5Gi", 3 * 2**29),
        ("1G", 10**9),
        ("2e3", 2000),
        ("1E", 10**18),  # exa, not an exponent
        ("1Ei", 2**60),
        ("100M", 10**8),
        ("0.5", 1),
        (1073741824, 2**30),
    ],
)
def test_memory_bytes(value: str | int | float, size: int) -> None:
    assert memory_bytes(value) == size


@pytest.mark.parametrize(
    "value",
    [
        "",
        "abc",
        "-1",
        "1.5.5",
        "1Gib",
        "1 Gi",
        "Gi",
        "1e",
        "0x10",
        "1_000",
        "١٢",  # non-ASCII digits
        "9" * 70,
        "8Ei",  # over 2**62
        True,
        False,
        float("nan"),
        float("inf"),
        -0.5,
        10**30,
    ],
)
def test_invalid_quantities(value: str | int | float) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(value)


def test_errors_say_how_to_write_one() -> None:
    with pytest.raises(QuantityError, match=r"e\.g\. '2', '500m', '16Gi'"):
        parse_quantity("lots")


_QUANTITY_TEXT = st.from_regex(
    r"\A[+]?[0-9]{0,6}\.?[0-9]{1,6}([eE][+-]?[0-9]{1,2})?(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?\Z"
)


@settings(max_examples=300, deadline=None)
@given(text=_QUANTITY_TEXT | st.text(max_size=12))
def test_parse_never_raises_anything_else(text: str) -> None:
    try:
        value = parse_quantity(text)
    except QuantityError:
        return
    assert value >= 0 and value <= 2**62


@settings(max_examples=200, deadline=None)
@given(milli=st.integers(0, 10**12))
def test_millicores_round_trip(milli: int) -> None:
    assert cpu_milli(f"{milli}m") == milli
    assert cpu_milli(str(Decimal(milli) / 1000)) == milli


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 2**22), suffix=st.sampled_from(["Ki", "Mi", "Gi", "Ti"]))
def test_binary_suffixes(n: int, suffix: str) -> None:
    scale = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[suffix]
    assert memory_bytes(f"{n}{suffix}") == n * scale


def test_huge_exponent_is_a_quantity_error() -> None:
    with pytest.raises(QuantityError):
        parse_quantity("1e9999999")
