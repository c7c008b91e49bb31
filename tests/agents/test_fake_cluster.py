"""The fake backend: simulated progress, spot notices, failures, outages and scale."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from nats.aio.client import Client

from agents.config import FakeClusterConfig, FakeFlavor, make_fleet_configs
from agents.fake.cluster import FakeCluster
from agents.fleet import start_fake_fleet
from schemas.agent import (
    AgentEvent,
    CheckpointNow,
    CheckpointRef,
    CheckpointReport,
    ClusterSnapshot,
    GpuHealth,
    Heartbeat,
    NodeGone,
    NodeUpsert,
    SpotNotice,
)
from schemas.job import Simulation
from schemas.subjects import DEFAULT_SUBJECTS
from tests.agents.conftest import MakeAgent, fast_config
from tests.agents.helpers import BrokerWire, dispatch, unique
from tests.support import wait_for

SLOW = Simulation(total_steps=100_000, steps_per_second=50.0, checkpoint_every=10)


def ckpts(wire: BrokerWire, job_id: str) -> list[CheckpointReport]:
    return [r for r in wire.events(CheckpointReport) if r.job_id == job_id]


async def test_spot_notice_evicts_and_loses_uncheckpointed_progress(make_agent: MakeAgent) -> None:
    a = await make_agent()
    sim = Simulation(total_steps=100_000, steps_per_second=50.0, checkpoint_every=25)
    nodes = a.cluster.nodes_of("spot-a100")[:2]
    assert (await a.wire.send(dispatch("job-s", nodes, sim=sim))).ok
    await a.wire.wait_for(lambda: ckpts(a.wire, "job-s"))
    # Past the checkpoint at 25 but short of the next one at 50.
    await wait_for(lambda: 25 < a.cluster.workload("job-s", 1).step < 45)  # type: ignore[union-attr,operator]
    deadline = a.cluster.spot_notice(nodes[1], lead_s=0.15)
    assert deadline is not None
    notice = await a.wire.wait_for(lambda: a.wire.events(SpotNotice))
    assert notice[0].node == nodes[1] and notice[0].deadline == deadline
    assert a.cluster.node_info(nodes[1]).spot_deadline == deadline  # type: ignore[union-attr]
    evicted = await a.wire.wait_status("job-s", 1, "evicted", timeout=3)
    assert evicted.reason == "spot-reclaimed"
    gone = await a.wire.wait_for(lambda: a.wire.events(NodeGone))
    assert gone[0].node == nodes[1] and gone[0].reason == "spot-reclaimed"
    (rec,) = a.cluster.history["job-s"]
    assert rec.end_phase == "evicted"
    assert rec.last_checkpoint_step is not None and rec.last_checkpoint_step == 25
    assert rec.last_step > rec.last_checkpoint_step  # progress since the checkpoint is lost
    assert nodes[1] not in a.cluster.nodes
    assert a.cluster.free_gpus(nodes[0]) == 8  # the whole gang went, the other node is free


async def test_checkpoint_now_before_deadline_saves_current_step(make_agent: MakeAgent) -> None:
    a = await make_agent()
    sim = Simulation(total_steps=100_000, steps_per_second=50.0, checkpoint_every=1000)
    node = a.cluster.nodes_of("spot-a100")[0]
    assert (await a.wire.send(dispatch("job-cn", [node], sim=sim))).ok
    await a.wire.wait_status("job-cn", 1, "running")
    await wait_for(lambda: (a.cluster.workload("job-cn", 1).step or 0) > 0)  # type: ignore[union-attr]
    deadline = a.cluster.spot_notice(node, lead_s=0.4)
    assert deadline is not None
    ack = await a.wire.send(CheckpointNow(job_id="job-cn", attempt=1, epoch=1, deadline=deadline))
    assert ack.ok
    (report,) = await a.wire.wait_for(lambda: ckpts(a.wire, "job-cn"))
    assert report.step > 0 and report.uri == f"s3://ckpt/job-cn/step-{report.step}"
    await a.wire.wait_status("job-cn", 1, "evicted", timeout=3)
    rec = a.cluster.history["job-cn"][0]
    assert rec.last_checkpoint_step == report.step
    assert rec.last_step - report.step <= 0.5 * 50  # lost at most the lead time's work


async def test_resume_from_starts_at_checkpoint(make_agent: MakeAgent) -> None:
    a = await make_agent()
    sim = Simulation(total_steps=60, steps_per_second=100.0, checkpoint_every=10)
    cmd = dispatch(
        "job-rf",
        a.cluster.nodes[:1],
        attempt=2,
        sim=sim,
        resume_from=CheckpointRef(step=35, uri="s3://ckpt/job-rf/step-35"),
    )
    assert (await a.wire.send(cmd)).ok
    created = await a.wire.wait_status("job-rf", 2, "created")
    assert created.step == 35
    done = await a.wire.wait_status("job-rf", 2, "succeeded", timeout=3)
    assert done.step == 60
    assert [r.step for r in ckpts(a.wire, "job-rf")] == [40, 50]
    rec = a.cluster.history["job-rf"][0]
    assert (rec.started_from_step, rec.last_step) == (35, 60)


async def test_fail_at_step_reports_exit_code(make_agent: MakeAgent) -> None:
    a = await make_agent()
    sim = Simulation(total_steps=100, steps_per_second=200.0, fail_at_step=25, exit_code=3)
    assert (await a.wire.send(dispatch("job-f", a.cluster.nodes[:1], sim=sim))).ok
    failed = await a.wire.wait_status("job-f", 1, "failed", timeout=3)
    assert failed.exit_codes == [3] and failed.step == 25
    assert a.cluster.history["job-f"][0].end_phase == "failed"


async def test_gpu_failure_evicts(make_agent: MakeAgent) -> None:
    a = await make_agent()
    node = a.cluster.nodes_of("od-a100")[0]
    assert (await a.wire.send(dispatch("job-g", [node], flavor="od-a100", sim=SLOW))).ok
    await a.wire.wait_status("job-g", 1, "running")
    assert a.cluster.fail_gpu(node, count=2, xid=48)
    health = await a.wire.wait_for(lambda: a.wire.events(GpuHealth))
    assert (health[0].node, health[0].healthy, health[0].xid) == (node, 6, 48)
    ev = await a.wire.wait_status("job-g", 1, "evicted")
    assert "xid-48" in ev.reason
    assert a.cluster.node_info(node).gpu_healthy == 6  # type: ignore[union-attr]
    ack = await a.wire.send(dispatch("job-g2", [node], flavor="od-a100", sim=SLOW))
    assert not ack.ok and "over-committed" in ack.error  # 8 GPUs asked, 6 healthy


async def test_add_and_remove_nodes(make_agent: MakeAgent) -> None:
    a = await make_agent()
    name = a.cluster.add_node("spot-a100")
    assert name == f"{a.name}-spot-a100-4"
    up = await a.wire.wait_for(lambda: a.wire.events(NodeUpsert))
    assert up[0].node.name == name and up[0].node.gpu == 8
    assert a.cluster.remove_node(name)
    await a.wire.wait_for(lambda: [g for g in a.wire.events(NodeGone) if g.node == name])
    assert not a.cluster.remove_node(name)
    assert a.cluster.spot_notice("nope") is None
    with pytest.raises(KeyError):
        a.cluster.add_node("no-flavor")


async def test_outage_stops_traffic_then_resends_snapshot(make_agent: MakeAgent) -> None:
    a = await make_agent(heartbeat_s=0.05)
    sim = Simulation(total_steps=100_000, steps_per_second=100.0, checkpoint_every=10)
    assert (await a.wire.send(dispatch("job-o", a.cluster.nodes[:1], sim=sim))).ok
    await a.wire.wait_status("job-o", 1, "running")
    a.cluster.outage(True)
    # Every batch numbered before the partition has arrived; none is numbered after it.
    await wait_for(lambda: len(a.wire.batches) == a.runtime.seq)
    n = len(a.wire.batches)
    with pytest.raises(asyncio.TimeoutError):
        await a.wire.send(CheckpointNow(job_id="job-o", attempt=1, epoch=1), timeout=0.3)
    sim_s = a.cluster.now()
    await wait_for(lambda: a.cluster.now() > sim_s + 0.3)  # several heartbeats' worth
    assert a.runtime.seq == n and len(a.wire.batches) == n  # nothing sent while partitioned
    a.cluster.outage(False)
    snap = await a.wire.wait_snapshot(since=n)
    (wl,) = snap.workloads
    assert wl.phase == "running" and (wl.step or 0) > 30  # kept running during the outage
    reports = ckpts(a.wire, "job-o")
    assert reports and reports[-1].step >= 30  # the newest checkpoint survives the outage
    seqs = [b.seq for b in a.wire.batches]
    assert seqs == list(range(1, len(seqs) + 1))
    assert (await a.wire.send(CheckpointNow(job_id="job-o", attempt=1, epoch=1))).ok


async def test_the_ticker_runs_the_model_at_time_scale() -> None:
    """10 simulated seconds at time_scale 20: the ticker alone carries the job to the end
    (exact timing is the model's, tested on a manual clock in test_cluster_model.py)."""
    cfg = FakeClusterConfig(
        flavors=[FakeFlavor(name="od", nodes=1)], time_scale=20.0, start_delay_s=0.0, tick_s=0.005
    )
    c = FakeCluster(unique("ts"), cfg)
    got: list[AgentEvent] = []
    await c.start(got.append)
    try:
        sim = Simulation(total_steps=100, steps_per_second=10.0, checkpoint_every=50)
        await c.dispatch(dispatch("job-ts", c.nodes, flavor="od", sim=sim))
        await wait_for(lambda: c.history["job-ts"][0].end_phase, timeout=10)
        assert c.history["job-ts"][0].end_phase == "succeeded"
        assert c.now() >= 10.0
        assert [e.step for e in got if isinstance(e, CheckpointReport)] == [50]
    finally:
        await c.stop()


async def test_fleet_of_50_clusters_is_cheap(nc: Client) -> None:
    """50 clusters x 200 nodes x 8 GPUs in one process: start, snapshot and idle cheaply."""
    fake = FakeClusterConfig(
        flavors=[
            FakeFlavor(name="spot-a100", capacity_type="spot", nodes=100),
            FakeFlavor(name="od-a100", nodes=100),
        ]
    )
    prefix = unique("f")
    configs = make_fleet_configs(50, fake, prefix=prefix, heartbeat_s=0.5)
    snaps: dict[str, int] = {}
    beats: dict[str, int] = {}

    async def on(msg: object) -> None:
        from schemas.codec import decode_event_batch

        b = decode_event_batch(msg.data)  # type: ignore[attr-defined]
        for e in b.events:
            if isinstance(e, ClusterSnapshot):
                snaps[b.cluster] = len(e.nodes)
            elif isinstance(e, Heartbeat):
                beats[b.cluster] = beats.get(b.cluster, 0) + 1

    sub = await nc.subscribe(DEFAULT_SUBJECTS.agent_events_all, cb=on)
    cpu0 = time.process_time()
    fleet = await start_fake_fleet(nc, configs)
    try:
        start_cpu = time.process_time() - cpu0
        await wait_for(lambda: len([k for k in snaps if k.startswith(prefix)]) == 50, 5)
        assert all(snaps[c.cluster] == 200 for c in configs)
        cpu1, wall1 = time.process_time(), time.monotonic()
        # Idle cost is CPU per second, so it takes a window: until every cluster sent three
        # more heartbeats (0.5 s apart: at least a second, and the idle work did happen).
        # CPU time does not grow when a busy machine stretches the window; the bound does.
        had = {c.cluster: beats.get(c.cluster, 0) for c in configs}
        await wait_for(
            lambda: all(beats.get(c, 0) >= n + 3 for c, n in had.items()),
            30,
            what="three heartbeats from every cluster",
        )
        idle_cpu = time.process_time() - cpu1
        idle_s = time.monotonic() - wall1
        assert start_cpu < 5.0, start_cpu
        assert idle_cpu < 0.5 * idle_s, (idle_cpu, idle_s)  # 50 idle clusters cost little
        c0 = fleet[configs[0].cluster]
        assert len(c0.nodes) == 200
    finally:
        await fleet.stop()
        await sub.unsubscribe()


async def test_fleet_handles_outage_and_history(nc: Client) -> None:
    configs = make_fleet_configs(2, fast_config(), prefix=unique("h"), heartbeat_s=0.05)
    fleet = await start_fake_fleet(nc, configs)
    try:
        c0, c1 = (fleet[c.cluster] for c in configs)
        sim = Simulation(total_steps=100_000, steps_per_second=10.0)
        await c0.dispatch(dispatch("job-h", c0.nodes[:1], attempt=1, sim=sim))
        await c0.cancel("job-h", 1, "moved")
        await c1.dispatch(dispatch("job-h", c1.nodes[:1], attempt=2, sim=sim))
        hist = fleet.history("job-h")
        assert [(r.attempt, r.cluster) for r in hist] == [(1, c0.cluster), (2, c1.cluster)]
        assert fleet.live_copies("job-h") == [(c1.cluster, 2)]
        c1.outage(True)
        assert fleet.runtimes[c1.cluster].partitioned
        c1.outage(False)
        assert not fleet.runtimes[c1.cluster].partitioned
    finally:
        await fleet.stop()


async def test_a_job_without_checkpoint_settings_never_checkpoints(make_agent: MakeAgent) -> None:
    a = await make_agent()
    sim = Simulation(total_steps=30, steps_per_second=100.0, checkpoint_every=5)
    node = a.cluster.nodes_of("spot-a100")[0]
    cmd = dispatch("job-nock", [node], sim=sim)
    cmd = msgspec.structs.replace(
        cmd, checkpoint_uri="", spec=msgspec.structs.replace(cmd.spec, checkpoint=None)
    )
    assert (await a.wire.send(cmd)).ok
    await a.wire.wait_status("job-nock", 1, "running")
    ack = await a.wire.send(CheckpointNow(job_id="job-nock", attempt=1, epoch=1, deadline=0.0))
    assert ack.ok  # understood, but there is nowhere to write one
    await a.wire.wait_status("job-nock", 1, "succeeded", timeout=5)
    assert ckpts(a.wire, "job-nock") == []
    (rec,) = a.cluster.history["job-nock"]
    assert rec.checkpoints == 0 and rec.last_checkpoint_step is None
