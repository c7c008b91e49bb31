"""Correlated reclaims in the spot risk term: a zone's burst of notices is one event, a gang
kept within one zone is priced for the bursts that hit it, and at equal price the cluster that
keeps the gang in one zone wins."""

from __future__ import annotations

import math

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from broker.core.risk import (
    BURST_WINDOW_S,
    PoolRisk,
    expected_cost_per_hour,
    gang_cost_per_hour,
    gang_reclaim_rate,
)
from broker.core.scheduler import Scheduler
from broker.core.types import TopologyNeed
from schemas.agent import FlavorInfo, NodeInfo

from .helpers import GI, NOW, config, gang

HALF_LIFE = 7 * 24 * 3600.0
LEVELS = ("topology.kubernetes.io/zone", "kubernetes.io/hostname")
SPOT = FlavorInfo("spot", "spot", "a100", 1.0, topology_levels=LEVELS)


def snode(name: str, zone: str) -> NodeInfo:
    return NodeInfo(
        name=name, flavor="spot", gpu=8, cpu_milli=96_000, memory=1024 * GI, topology=(zone, name)
    )


def test_notices_of_one_zone_close_together_are_one_event() -> None:
    r = PoolRisk(spot=True)
    assert r.burst() == 1.0  # nothing seen: independent reclaims
    for i in range(4):  # one burst in zone a
        r.record_notice(NOW + i, HALF_LIFE, "a")
    assert math.isclose(r.burst(), (4 + 2) / (1 + 2))
    r.record_notice(NOW + 2, HALF_LIFE, "b")  # another zone: its own event
    r.record_notice(NOW + BURST_WINDOW_S + 5, HALF_LIFE, "a")  # later: a new event
    assert math.isclose(r.burst(), (6 + 2) / (3 + 2), rel_tol=1e-4)  # decayed a minute


@given(
    st.floats(0.0, 5.0),
    st.lists(st.tuples(st.integers(1, 16), st.integers(0, 16)), min_size=1, max_size=4),
    st.floats(1.0, 64.0),
)
def test_a_gangs_reclaim_rate_lies_between_its_bounds(
    rate: float, shapes: list[tuple[int, int]], burst: float
) -> None:
    zones = [(k, k + more) for k, more in shapes]  # k of the zone's n nodes are the gang's
    nodes = sum(k for k, _ in zones)
    got = gang_reclaim_rate(rate, zones, burst)
    assert got <= rate * nodes * (1 + 1e-9)  # never above independent reclaims
    assert got >= rate * nodes / burst * (1 - 1e-9)  # an event takes at most `burst` of them
    assert math.isclose(gang_reclaim_rate(rate, zones, 1.0), rate * nodes)


def test_a_gang_in_one_zone_is_hit_by_fewer_bursts_than_one_spread_over_two() -> None:
    one = gang_reclaim_rate(0.1, [(4, 8)], 4.0)
    two = gang_reclaim_rate(0.1, [(2, 8), (2, 8)], 4.0)
    assert one < two < 0.1 * 4


def bursts(s: Scheduler, zone: str, count: int, size: int, t0: float) -> float:
    """`count` bursts of `size` notices each in `zone`, the noticed nodes then gone."""
    t = t0
    for w in range(count):
        for i in range(size):
            info = snode(f"{zone}-w{w}-{i}", zone)
            s.upsert_node("c", info, t)
            s.upsert_node("c", msgspec.structs.replace(info, spot_deadline=t + 120), t + i)
        t += 600.0
        for i in range(size):
            s.remove_node("c", f"{zone}-w{w}-{i}", t)
    return t


def test_the_placement_prices_the_bursts_that_hit_a_gang_in_one_zone() -> None:
    fleet = [snode(f"{z}-{i}", z) for z in ("za", "zb") for i in range(8)]
    calm = Scheduler(config())
    calm.apply_snapshot("c", [SPOT], fleet, NOW)
    rough = Scheduler(config())
    rough.apply_snapshot("c", [SPOT], fleet, NOW)
    now = bursts(rough, "za", 3, 4, NOW)
    for s, at in ((calm, NOW), (rough, now)):
        ((_, p),) = s.schedule([gang("j", (4, 8), checkpoint_interval_s=1800.0)], at).admitted
        rate = s.pool_interruption_rate(("c", "spot"), at)
        bound = expected_cost_per_hour(1.0, 32, rate, 4, 1800.0, 1.0)
        reclaims = s.gang_reclaims_per_hour(p, at)  # what a spot-return weighs (moves.py)
        assert math.isclose(
            gang_cost_per_hour(1.0, 32, reclaims, 1800.0, 1.0), p.expected_cost_per_hour
        )
        if s is calm:  # no bursts seen: reclaims count as independent, as before
            assert p.expected_cost_per_hour == bound
            assert reclaims == rate * 4
        else:  # bursts of 4: the 4-node gang is hit by about one burst where 4 notices come
            assert rate > 0.0
            assert 32.0 < p.expected_cost_per_hour < bound
            assert rate < reclaims < rate * 4


def test_at_equal_price_the_cluster_that_keeps_the_gang_in_one_zone_wins() -> None:
    # "a" (first by name) has room for the gang only across its two zones.
    s = Scheduler(config())
    s.apply_snapshot(
        "a", [SPOT], [snode(f"a{z}-{i}", z) for z in ("za", "zb") for i in range(2)], NOW
    )
    s.apply_snapshot("b", [SPOT], [snode(f"b-{i}", "za") for i in range(4)], NOW)
    req = gang("j", (4, 8), checkpoint_interval_s=1800.0)
    req.topology = TopologyNeed(spread=True)
    ((_, p),) = s.schedule([req], NOW).admitted
    assert p.cluster == "b"
