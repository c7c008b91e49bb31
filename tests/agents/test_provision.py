"""Autoscaled pools on the agent side: the runtime reports the declared pools, hands a
`provision` command to the backend, and the fake provider brings nodes up after a seeded
delay, or none in a stockout."""

from __future__ import annotations

import msgspec
import pytest

from agents.config import FakeAutoscale, FakeClusterConfig, FakeFlavor
from agents.fake.model import ClusterModel, ManualClock
from schemas.agent import AgentEvent, ClusterSnapshot, NodeUpsert, Provision, ProvisionPool
from tests.agents.conftest import MakeAgent

POOL = ProvisionPool(max_nodes=4, node_gpu=8, ready_s=60.0, window_s=300.0)


def grown(autoscale: FakeAutoscale, seed: int = 3) -> FakeClusterConfig:
    return FakeClusterConfig(
        flavors=[
            FakeFlavor(name="spot-a", capacity_type="spot", nodes=0, autoscale=autoscale),
            FakeFlavor(name="od-a", nodes=1),
        ],
        tick_s=0.005,
        seed=seed,
    )


def arrivals(seed: int, autoscale: FakeAutoscale) -> list[tuple[float, str]]:
    """When each node asked for comes up on a manual clock: (time, node)."""
    clock = ManualClock()
    m = ClusterModel("c", grown(autoscale, seed), clock)
    got: list[AgentEvent] = []
    m.emit = got.append
    assert m.grow("job-1", "spot-a", 3, deadline=500.0) == 3
    out: list[tuple[float, str]] = []
    while clock.t < 1000 and len(out) < 3:
        clock.advance(1.0)
        m.advance()
        out += [(clock.t, e.node.name) for e in got[len(out) :] if isinstance(e, NodeUpsert)]
    return out


def test_nodes_come_up_after_a_seeded_delay() -> None:
    scale = FakeAutoscale(delay_s=120.0, spread=0.3)
    first = arrivals(11, scale)
    assert len(first) == 3 and arrivals(11, scale) == first  # same seed, same arrivals
    assert all(40 <= t <= 400 for t, _ in first)  # log-normal around 120 s, sigma 0.3
    assert [n for _, n in first] == ["c-spot-a-0", "c-spot-a-1", "c-spot-a-2"]
    assert arrivals(12, scale) != first


def test_a_stockout_brings_no_node_and_an_ask_is_answered_once() -> None:
    clock = ManualClock()
    m = ClusterModel("c", grown(FakeAutoscale(delay_s=10.0, stockouts=[(0.0, 100.0)])), clock)
    assert m.grow("job-1", "spot-a", 2, deadline=50.0) == 0
    assert m.counters["stockouts"] == 1
    clock.advance(200.0)
    m.advance()
    assert m.nodes_of("spot-a") == []
    # after the drought, a new ask (a new deadline) gets nodes; the same ask again does not
    assert m.grow("job-1", "spot-a", 2, deadline=400.0) == 2
    assert m.grow("job-1", "spot-a", 2, deadline=400.0) == 0
    clock.advance(20.0)
    m.advance()
    assert len(m.nodes_of("spot-a")) == 2 and m.counters["provisioned_nodes"] == 2


def test_the_providers_own_limit_caps_what_comes() -> None:
    """A cloud quota below what the agent declared: only the nodes within it come."""
    clock = ManualClock()
    m = ClusterModel("c", grown(FakeAutoscale(delay_s=10.0, spread=0.0, max_nodes=3)), clock)
    assert m.grow("job-1", "spot-a", 2, deadline=50.0) == 2
    assert m.grow("job-2", "spot-a", 2, deadline=50.0) == 1  # 2 coming, room for 1 more
    assert m.grow("job-3", "spot-a", 1, deadline=50.0) == 0
    assert m.counters["stockouts"] == 1
    clock.advance(20.0)
    m.advance()
    assert len(m.nodes_of("spot-a")) == 3


async def test_the_runtime_reports_declared_pools_and_grows_them(make_agent: MakeAgent) -> None:
    a = await make_agent(grown(FakeAutoscale(delay_s=0.05, spread=0.0)), pools={"spot-a": POOL})
    snap = await a.wire.wait_snapshot()
    by_name = {f.name: f for f in snap.flavors}
    assert by_name["spot-a"].provision == POOL and by_name["od-a"].provision is None
    ack = await a.wire.send(Provision(job_id="j1", epoch=1, flavor="spot-a", nodes=2))
    assert ack.ok, ack.error

    def new_nodes() -> list[str] | None:
        names = [e.node.name for e in a.wire.events(NodeUpsert) if e.node.flavor == "spot-a"]
        return names if len(names) == 2 else None

    assert sorted(await a.wire.wait_for(new_nodes)) == [f"{a.name}-spot-a-0", f"{a.name}-spot-a-1"]
    assert a.runtime.stats["provisions"] == 1


async def test_a_flavor_without_a_declared_pool_is_not_grown(make_agent: MakeAgent) -> None:
    a = await make_agent(grown(FakeAutoscale(delay_s=0.05)), pools={"spot-a": POOL})
    ack = await a.wire.send(Provision(job_id="j1", epoch=1, flavor="od-a", nodes=1))
    assert not ack.ok
    assert f"flavor 'od-a' of cluster {a.name} declares no autoscaled pool" in ack.error
    assert a.cluster.counters["provision_asks"] == 0


async def test_a_backend_asks_for_a_full_snapshot_by_emitting_one(make_agent: MakeAgent) -> None:
    a = await make_agent(grown(FakeAutoscale(delay_s=0.05)), pools={"spot-a": POOL})
    await a.wire.wait_snapshot()
    seen = len(a.wire.batches)
    assert a.cluster.emit is not None
    a.cluster.emit(ClusterSnapshot(flavors=[], nodes=[]))  # what the kube backend sends
    snap = await a.wire.wait_snapshot(since=seen)
    by_name = {f.name: f for f in snap.flavors}  # the backend's full view, pools applied
    assert by_name["spot-a"].provision == POOL and "od-a" in by_name


async def test_a_pool_the_backend_reads_is_grown_and_a_declared_one_wins(
    make_agent: MakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    read = msgspec.structs.replace(POOL, max_nodes=2)
    a = await make_agent(grown(FakeAutoscale(delay_s=0.05)), pools={"od-a": POOL})
    await a.wire.wait_snapshot()
    view = a.cluster.view

    def with_read_pools() -> ClusterSnapshot:
        snap = view()
        flavors = [msgspec.structs.replace(f, provision=read) for f in snap.flavors]
        return msgspec.structs.replace(snap, flavors=flavors)

    monkeypatch.setattr(a.cluster, "view", with_read_pools)
    seen = len(a.wire.batches)
    a.runtime.request_snapshot()
    snap = await a.wire.wait_snapshot(since=seen)
    by_name = {f.name: f for f in snap.flavors}
    assert by_name["spot-a"].provision == read and by_name["od-a"].provision == POOL
    ack = await a.wire.send(Provision(job_id="j1", epoch=1, flavor="spot-a", nodes=1))
    assert ack.ok, ack.error
