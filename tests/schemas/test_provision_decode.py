"""Decoding an agent's autoscaled pool (`FlavorInfo.provision`): whatever an agent puts in it,
the batch decodes to a pool within its bounds or is refused with DecodeError; a flavor
without one (every agent before wire 1.2) decodes as before."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.agent import ClusterSnapshot, EventBatch, FlavorInfo
from schemas.codec import DecodeError, decode_event_batch, encode_msgpack

from .strategies import floats, json_values, provision_pools

FIELDS = [
    "max_nodes",
    "max_gpus",
    "node_gpu",
    "node_cpu_milli",
    "node_memory",
    "labels",
    "taints",
    "ready_s",
    "window_s",
]
HOSTILE = st.one_of(
    json_values,
    floats(-1e12, 1e12),
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, -1, 10**9, 2**64 - 1, "", "8", [], {}, {"": ""}, [{"key": ""}], None]),
)


def batch(flavor: dict[str, Any]) -> bytes:
    raw = msgspec.to_builtins(
        EventBatch(
            cluster="east",
            instance="i",
            seq=1,
            events=[ClusterSnapshot(flavors=[], nodes=[])],
            wire="1.2",
        )
    )
    raw["events"][0]["flavors"] = [flavor]
    return encode_msgpack(raw)


def base_flavor() -> dict[str, Any]:
    return msgspec.to_builtins(FlavorInfo(name="spot-a", capacity_type="spot"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pool=provision_pools,
    edits=st.lists(st.tuples(st.sampled_from(FIELDS), HOSTILE), max_size=3),
)
def test_a_hostile_pool_decodes_within_bounds_or_is_refused(
    pool: Any, edits: list[tuple[str, Any]]
) -> None:
    raw = msgspec.to_builtins(pool)
    for name, value in edits:
        raw[name] = value
    flavor = {**base_flavor(), "provision": raw}
    try:
        got = decode_event_batch(batch(flavor))
    except DecodeError:
        return
    snap = got.events[0]
    assert isinstance(snap, ClusterSnapshot)
    p = snap.flavors[0].provision
    assert p is not None
    assert 0 <= p.max_nodes <= 1_000_000 and 0 <= p.max_gpus <= 2**31
    assert p.limit >= 0 and (p.max_nodes or p.max_gpus) and 1 <= p.node_gpu <= 1024
    assert 0 < p.window_s <= 86_400 and 0 <= p.ready_s <= 86_400
    assert len(p.labels) <= 64 and all(len(v) <= 63 for v in p.labels.values())


@settings(max_examples=50, deadline=None)
@given(pool=provision_pools)
def test_a_valid_pool_round_trips(pool: Any) -> None:
    flavor = {**base_flavor(), "provision": msgspec.to_builtins(pool)}
    snap = decode_event_batch(batch(flavor)).events[0]
    assert isinstance(snap, ClusterSnapshot) and snap.flavors[0].provision == pool


def test_a_flavor_without_a_pool_decodes_as_before() -> None:
    snap = decode_event_batch(batch(base_flavor())).events[0]
    assert isinstance(snap, ClusterSnapshot) and snap.flavors[0].provision is None
