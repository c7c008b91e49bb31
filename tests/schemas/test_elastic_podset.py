"""An elastic podset's bounds: min_replicas <= replicas <= max_replicas, said plainly."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.codec import DecodeError, decode_jobspec, encode_json
from schemas.job import JobSpec, PodSet


def _spec(**podset: object) -> bytes:
    return encode_json({"name": "e", "gang": [{"name": "worker", "gpu": 1, **podset}]})


def test_max_below_replicas_is_refused_with_the_fix() -> None:
    with pytest.raises(DecodeError, match=r"max_replicas 3 is less than its 4 replicas.*raise"):
        decode_jobspec(_spec(replicas=4, max_replicas=3))


def test_max_replicas_is_bounded_by_meta() -> None:
    with pytest.raises(DecodeError, match="max_replicas"):
        decode_jobspec(_spec(replicas=1, max_replicas=0))


@given(st.integers(1, 64), st.integers(1, 64), st.integers(1, 64), st.integers(0, 80))
def test_admits_exactly_the_elastic_range(low: int, mid: int, high: int, count: int) -> None:
    low, mid, high = sorted((low, mid, high))
    ps = PodSet(name="worker", replicas=mid, min_replicas=low, max_replicas=high)
    assert ps.elastic and (ps.least, ps.most) == (low, high)
    assert ps.admits(count) == (low <= count <= high)


def test_a_plain_podset_is_not_elastic() -> None:
    ps = msgspec.convert({"name": "w", "replicas": 3, "min_replicas": 2}, PodSet)
    assert not ps.elastic and (ps.least, ps.most) == (2, 3)
    assert not ps.admits(4)


def test_round_trip_keeps_the_bounds() -> None:
    spec = decode_jobspec(_spec(replicas=4, min_replicas=2, max_replicas=8))
    again = msgspec.json.decode(encode_json(spec), type=JobSpec)
    assert (again.gang[0].min_replicas, again.gang[0].max_replicas) == (2, 8)
