"""The agent runtime on the wire, with the fake backend, over a real nats-server."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import nats
import pytest
import structlog
from nats.aio.client import Client

from agents import runtime as runtime_module
from agents.backend import BackendError, CannotResize
from agents.fake.cluster import FakeCluster
from agents.runtime import AgentRuntime, heartbeat_phase
from schemas.agent import (
    Applied,
    Cancel,
    CheckpointNow,
    CheckpointReport,
    ClusterSnapshot,
    CommandAck,
    Dispatch,
    Heartbeat,
    Resync,
    WireRefused,
)
from schemas.codec import decode_command_ack, encode_msgpack
from schemas.job import Simulation
from schemas.wire import WIRE_VERSION
from shell.natsio import flush
from tests.agents.conftest import MakeAgent, fast_config
from tests.agents.helpers import BrokerWire, dispatch, unique
from tests.support import wait_for

FAST = Simulation(total_steps=40, steps_per_second=100.0, checkpoint_every=10)
SLOW = Simulation(total_steps=100_000, steps_per_second=20.0, checkpoint_every=10)


async def test_first_batch_is_snapshot_then_contiguous_seq_and_heartbeats(
    make_agent: MakeAgent,
) -> None:
    a = await make_agent(heartbeat_s=0.05)
    wire = a.wire
    await wire.wait_for(lambda: len(wire.events(Heartbeat)) >= 6, timeout=3)
    first = wire.batches[0]
    assert first.seq == 1
    assert first.cluster == a.name
    assert isinstance(first.events[0], ClusterSnapshot)
    snap = first.events[0]
    assert len(snap.nodes) == 8
    assert {f.name for f in snap.flavors} == {"spot-a100", "od-a100"}
    assert snap.nodes[0].name == f"{a.name}-spot-a100-0"
    assert [b.seq for b in wire.batches] == list(range(1, len(wire.batches) + 1))
    assert {b.instance for b in wire.batches} == {a.runtime.instance}
    assert len(wire.events(ClusterSnapshot)) == 1
    assert wire.errors == []


def test_clusters_beat_at_phases_spread_over_the_period() -> None:
    """Fifty clusters' agents started at once do not beat (and so are not acknowledged, and
    do not extend their fences) in the same instant: no tenth of the period holds more than
    a quarter of them, and a cluster keeps its phase from one start to the next."""
    phases = [heartbeat_phase(f"c{i}") for i in range(50)]
    assert all(0 < p <= 1 for p in phases)
    per_tenth = [sum(1 for p in phases if k / 10 < p <= (k + 1) / 10) for k in range(10)]
    assert max(per_tenth) <= 50 // 4, per_tenth
    assert heartbeat_phase("c7") == phases[7]


async def test_an_agent_beats_again_at_its_clusters_phase_after_starting(nc: Client) -> None:
    """The first heartbeat goes with the start's snapshot; the second after the cluster's
    phase of the period, and every later one a whole period after the one before."""
    name = next(n for i in range(100) if 0.2 <= heartbeat_phase(n := f"phase-{i}") <= 0.5)
    phase, period = heartbeat_phase(name), 1.5
    wire = await BrokerWire(nc, name).start()
    runtime = AgentRuntime(FakeCluster(name, fast_config()), nc, heartbeat_s=period)
    await runtime.start()
    try:
        beats = await wire.wait_for(
            lambda: b if len(b := wire.events(Heartbeat)) >= 3 else None, timeout=10
        )
        second, third = beats[1].at - beats[0].at, beats[2].at - beats[1].at
        # `at` is the wall clock when a beat is queued; the beats are timed on the monotonic
        # one, and each is queued a moment after it falls due
        assert period * phase - 0.05 <= second < period * phase + 0.5, (phase, second)
        assert period - 0.05 <= third < period + 0.5, third
    finally:
        await runtime.stop()
        await wire.stop()


async def test_a_beat_held_up_does_not_move_the_later_ones(make_agent: MakeAgent) -> None:
    """The agent's loop is held up for two and a half periods: the beat it missed goes as
    soon as it can, and the ones after it fall back on the cluster's grid, so clusters held
    up together (a busy process, a stalled node) do not go on beating together."""
    period = 0.5
    a = await make_agent(heartbeat_s=period)
    wire = a.wire

    def beats(n: int) -> list[Heartbeat] | None:
        got = wire.events(Heartbeat)
        return got if len(got) >= n else None

    before = await wire.wait_for(lambda: beats(3), timeout=10)
    grid = before[2].at
    time.sleep(2.5 * period)  # noqa: ASYNC251 - holds the loop the agent runs on, on purpose
    after = (await wire.wait_for(lambda: beats(len(before) + 3), timeout=10))[len(before) :]
    late, *later = after
    assert late.at - grid > 2.5 * period  # sent once the loop ran again
    for beat in later:
        off = (beat.at - grid) % period
        assert min(off, period - off) < 0.2 * period, (beat.at - grid, period)


async def test_restart_gets_new_instance_and_seq_from_one(make_agent: MakeAgent) -> None:
    a = await make_agent()
    first_instance = a.runtime.instance
    await a.wire.wait_for(lambda: a.wire.batches)
    await a.runtime.stop()
    await flush(a.wire.nc)
    n = len(a.wire.batches)
    await a.runtime.start()
    await a.wire.wait_for(lambda: len(a.wire.batches) > n)
    b = a.wire.batches[n]
    assert b.instance != first_instance and b.seq == 1
    assert isinstance(b.events[0], ClusterSnapshot)


async def test_dispatch_runs_checkpoints_and_succeeds(make_agent: MakeAgent) -> None:
    a = await make_agent()
    nodes = a.cluster.nodes_of("spot-a100")[:2]
    ack = await a.wire.send(dispatch("job-a", nodes, sim=FAST))
    assert ack.ok, ack.error
    created = await a.wire.wait_status("job-a", 1, "created")
    assert created.total_replicas == 2 and created.running_replicas == 0
    assert created.nodes == nodes
    running = await a.wire.wait_status("job-a", 1, "running")
    assert running.running_replicas == 2 == running.total_replicas
    done = await a.wire.wait_status("job-a", 1, "succeeded", timeout=5)
    assert done.step == 40
    reports = [r for r in a.wire.events(CheckpointReport) if r.job_id == "job-a"]
    assert [r.step for r in reports] == [10, 20, 30]
    assert reports[0].uri == "s3://ckpt/job-a/step-10"
    phases = [s.phase for s in a.wire.statuses("job-a")]
    assert phases == ["created", "running", "succeeded"]
    (rec,) = a.cluster.history["job-a"]
    assert (rec.attempt, rec.cluster, rec.started_from_step, rec.last_step, rec.end_phase) == (
        1,
        a.name,
        0,
        40,
        "succeeded",
    )
    assert a.cluster.free_gpus(nodes[0]) == 8  # resources released


async def test_duplicate_dispatch_is_idempotent(make_agent: MakeAgent) -> None:
    a = await make_agent()
    cmd = dispatch("job-d", a.cluster.nodes_of("spot-a100")[:1], sim=SLOW)
    acks = await asyncio.gather(*(a.wire.send(cmd) for _ in range(3)))
    assert all(x.ok for x in acks)
    assert (await a.wire.send(cmd)).ok
    await a.wire.wait_status("job-d", 1, "running")
    assert len(a.cluster.history["job-d"]) == 1
    assert [s.phase for s in a.wire.statuses("job-d")].count("created") == 1


async def test_stale_epoch_refused(make_agent: MakeAgent) -> None:
    a = await make_agent()
    nodes = a.cluster.nodes_of("od-a100")[:1]
    assert (await a.wire.send(Resync(epoch=5))).ok
    ack = await a.wire.send(dispatch("job-e", nodes, epoch=4, flavor="od-a100", sim=SLOW))
    assert not ack.ok and ack.stale_epoch and "epoch 4" in ack.error
    assert "job-e" not in a.cluster.history
    ack = await a.wire.send(Cancel(job_id="job-e", epoch=3))
    assert ack.stale_epoch
    ack = await a.wire.send(dispatch("job-e", nodes, epoch=6, flavor="od-a100", sim=SLOW))
    assert ack.ok and a.runtime.max_epoch == 6


async def test_newer_attempt_cancels_older_and_older_is_refused(make_agent: MakeAgent) -> None:
    a = await make_agent()
    n1, n2 = a.cluster.nodes_of("spot-a100")[:2]
    assert (await a.wire.send(dispatch("job-n", [n1], attempt=1, sim=SLOW))).ok
    await a.wire.wait_status("job-n", 1, "running")
    assert (await a.wire.send(dispatch("job-n", [n2], attempt=2, sim=SLOW))).ok
    assert a.cluster.live_workloads() == [("job-n", 2)]
    assert a.cluster.history["job-n"][0].end_phase == "cancelled"
    assert "superseded" in a.cluster.history["job-n"][0].reason
    ack = await a.wire.send(dispatch("job-n", [n1], attempt=1, sim=SLOW))
    assert not ack.ok and "older" in ack.error
    assert a.runtime.live_attempts("job-n") == {2}


async def test_cancel_is_idempotent_and_blocks_late_dispatch(make_agent: MakeAgent) -> None:
    a = await make_agent()
    node = a.cluster.nodes_of("spot-a100")[0]
    assert (await a.wire.send(dispatch("job-c", [node], attempt=3, sim=SLOW))).ok
    for _ in range(2):
        ack = await a.wire.send(Cancel(job_id="job-c", epoch=1, attempt=3, reason="user"))
        assert ack.ok
    assert a.cluster.live_workloads() == []
    rec = a.cluster.history["job-c"][0]
    assert rec.end_phase == "cancelled" and rec.reason == "user"
    assert not (await a.wire.send(dispatch("job-c", [node], attempt=3, sim=SLOW))).ok
    assert (await a.wire.send(Cancel(job_id="never-seen", epoch=1))).ok
    # Cancel(attempt=None) removes every attempt.
    assert (await a.wire.send(dispatch("job-c2", [node], sim=SLOW))).ok
    assert (await a.wire.send(Cancel(job_id="job-c2", epoch=1))).ok
    assert a.cluster.live_workloads() == []


async def test_the_answer_to_a_cancel_carries_an_ending_the_broker_has_not_acknowledged(
    make_agent: MakeAgent,
) -> None:
    """A spot notice may move a job whose success is still on its way: the Cancel's answer
    tells the broker, until an Applied says the batch with the ending was persisted."""
    a = await make_agent()
    node = a.cluster.nodes_of("spot-a100")[0]
    assert (await a.wire.send(dispatch("job-e", [node], attempt=1, sim=FAST))).ok
    done = await a.wire.wait_status("job-e", 1, "succeeded")
    ack = await a.wire.send(Cancel(job_id="job-e", epoch=1, attempt=1, reason="spot-notice"))
    assert ack.ok and ack.ended == done
    # Another attempt's Cancel, or a whole job's, carries nothing.
    assert (await a.wire.send(Cancel(job_id="job-e", epoch=1, attempt=2))).ended is None
    assert (await a.wire.send(Cancel(job_id="job-e", epoch=1))).ended is None
    (carried,) = [b for b in a.wire.batches if done in b.events]
    applied = Applied(epoch=1, instance=carried.instance, seq=carried.seq)
    assert (await a.wire.send(applied)).ok
    ack = await a.wire.send(Cancel(job_id="job-e", epoch=1, attempt=1, reason="spot-notice"))
    assert ack.ok and ack.ended is None


async def test_a_dispatch_onto_the_nodes_a_cancel_just_before_it_frees_finds_them_free(
    make_agent: MakeAgent,
) -> None:
    """A preemption sends the victim's Cancel, then the preemptor's Dispatch onto its node.
    Commands of different jobs run concurrently; the Dispatch waits for the Cancel that came
    first, so the node is free when it is taken (the fake backend refuses an occupied one)."""
    a = await make_agent()
    node = a.cluster.nodes_of("spot-a100")[0]
    assert (await a.wire.send(dispatch("victim", [node], sim=SLOW))).ok
    await a.wire.wait_status("victim", 1, "running")
    for round_ in range(5):
        cancel = a.wire.send(Cancel(job_id="victim", epoch=1, attempt=round_ + 1))
        take = a.wire.send(dispatch("taker", [node], attempt=round_ + 1, sim=SLOW))
        cancelled, taken = await asyncio.gather(cancel, take)  # published in this order
        assert cancelled.ok and taken.ok, (round_, taken.error)
        assert a.cluster.live_workloads() == [("taker", round_ + 1)]
        # The other way round for the next round: the victim takes the node back.
        cancel = a.wire.send(Cancel(job_id="taker", epoch=1, attempt=round_ + 1))
        back = a.wire.send(dispatch("victim", [node], attempt=round_ + 2, sim=SLOW))
        cancelled, taken = await asyncio.gather(cancel, back)
        assert cancelled.ok and taken.ok, (round_, taken.error)


async def test_a_cancel_that_hangs_holds_a_later_dispatch_only_for_the_bound(
    make_agent: MakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Cancel whose backend does not answer (an API server that hangs) holds the Dispatches
    that arrived after it for `CANCEL_WAIT_S` at most: then they go on, the Cancel still
    under way."""
    monkeypatch.setattr(runtime_module, "CANCEL_WAIT_S", 0.3)
    a = await make_agent()
    first, second = a.cluster.nodes_of("spot-a100")[:2]
    assert (await a.wire.send(dispatch("stuck", [first], sim=SLOW))).ok
    release = asyncio.Event()
    calls: list[tuple[str, float]] = []
    cancel, carry_out = a.cluster.cancel, a.cluster.dispatch

    async def hanging_cancel(job_id: str, attempt: int | None, reason: str) -> None:
        calls.append(("cancel", time.monotonic()))
        await release.wait()
        await cancel(job_id, attempt, reason)

    async def timed_dispatch(cmd: Dispatch) -> None:
        calls.append(("dispatch", time.monotonic()))
        await carry_out(cmd)

    monkeypatch.setattr(a.cluster, "cancel", hanging_cancel)
    monkeypatch.setattr(a.cluster, "dispatch", timed_dispatch)
    cancelled = asyncio.ensure_future(a.wire.send(Cancel(job_id="stuck", epoch=1, attempt=1)))
    await wait_for(lambda: calls)  # the Cancel is under way, and stays so
    assert (await a.wire.send(dispatch("later", [second], sim=SLOW))).ok
    assert not cancelled.done()
    (_, began), (_, taken) = calls
    assert taken - began >= 0.3  # it waited for the Cancel first, for the bound
    release.set()
    assert (await cancelled).ok
    assert a.cluster.live_workloads() == [("later", 1)]


async def test_resync_sends_snapshot_with_workloads(make_agent: MakeAgent) -> None:
    a = await make_agent()
    nodes = a.cluster.nodes_of("spot-a100")[:2]
    assert (await a.wire.send(dispatch("job-r", nodes, sim=SLOW))).ok
    await a.wire.wait_status("job-r", 1, "running")
    n = len(a.wire.batches)
    assert (await a.wire.send(Resync(epoch=1, reason="gap"))).ok
    snap = await a.wire.wait_snapshot(since=n)
    (wl,) = snap.workloads
    assert (wl.job_id, wl.attempt, wl.phase, wl.running_replicas) == ("job-r", 1, "running", 2)
    assert wl.nodes == nodes
    seqs = [b.seq for b in a.wire.batches]
    assert seqs == list(range(1, len(seqs) + 1))


async def test_a_wire_refusal_is_logged_with_both_versions(make_agent: MakeAgent) -> None:
    """A broker of another major applies nothing this agent sends: the operator reads why."""
    with structlog.testing.capture_logs() as logs:
        a = await make_agent()
        refusal = WireRefused(
            epoch=1, broker_wire="2.0", agent_wire=WIRE_VERSION, reason="run an agent of 2.x"
        )
        ack = await a.wire.send(refusal)
    assert ack.ok
    (line,) = [e for e in logs if e["event"] == "broker refuses this agent's wire version"]
    assert line["log_level"] == "error" and line["reason"] == "run an agent of 2.x"
    assert (line["agent_wire"], line["broker_wire"]) == (WIRE_VERSION, "2.0")


async def test_a_failed_fence_extension_is_logged_once_and_its_end(
    make_agent: MakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cluster stops an attempt at its old fence when the agent cannot extend it: the
    operator reads that the fence is failing (once per outage) and when it works again."""
    a = await make_agent()
    extend = a.cluster.fence

    async def refused(job_id: str, attempt: int, until: float) -> None:
        raise BackendError("fence store unavailable")

    monkeypatch.setattr(a.cluster, "fence", refused)
    cmd = msgspec.structs.replace(
        dispatch("job-f", a.cluster.nodes_of("spot-a100")[:1], sim=SLOW), fence_after_s=60.0
    )
    with structlog.testing.capture_logs() as logs:
        assert (await a.wire.send(cmd)).ok
        failing = [e for e in logs if e["event"] == "fence extension failing; retried at every ack"]
        (line,) = failing
        assert line["log_level"] == "warning" and line["error"] == "fence store unavailable"
        assert (line["job_id"], line["attempt"]) == ("job-f", 1)
        assert a.runtime.stats["fence_failures"] >= 1
        monkeypatch.setattr(a.cluster, "fence", extend)
        await wait_for(lambda: bool(a.wire.batches))
        seq = a.wire.batches[-1].seq
        await a.wire.send(Applied(epoch=1, instance=a.runtime.instance, seq=seq))
        await wait_for(lambda: any(e["event"] == "fence extended again" for e in logs))


def freeze(seconds: float) -> None:
    """Stop this thread, and the event loop of the agent with it, as SIGSTOP would."""
    time.sleep(seconds)


async def test_a_dispatch_read_after_a_freeze_past_its_fence_starts_nothing(
    make_agent: MakeAgent, nc: Client, nats_url: str
) -> None:
    """An agent frozen (SIGSTOP, a node starved of CPU) for longer than an attempt's fence
    reads a Dispatch the broker sent before the freeze: by then the broker may have declared
    the cluster lost and started the job elsewhere, so it is refused and nothing is made."""
    a = await make_agent()
    nodes = a.cluster.nodes_of("spot-a100")

    async def acknowledge_last_batch() -> None:
        await wait_for(lambda: bool(a.wire.batches))
        seq = a.wire.batches[-1].seq
        assert (await a.wire.send(Applied(epoch=1, instance=a.runtime.instance, seq=seq))).ok

    # Heard a moment ago: a Dispatch with a fence of 2 s starts.
    await acknowledge_last_batch()
    fresh = msgspec.structs.replace(dispatch("job-y", nodes[:1], sim=SLOW), fence_after_s=2.0)
    assert (await a.wire.send(fresh)).ok
    # The request reaches the server, then this process, the agent with it, stops for
    # longer than the fence; the agent reads the request only when it runs again.
    await acknowledge_last_batch()
    late = msgspec.structs.replace(dispatch("job-z", nodes[1:2], sim=SLOW), fence_after_s=2.0)
    ack = await sent_during_freeze(nc, nats_url, a.wire.subjects.agent_cmd(a.name), late, 2.5)
    assert not ack.ok and "job-z not started" in ack.error, ack
    assert a.runtime.stats["late_dispatches"] == 1
    assert [w.job_id for w in a.cluster.live_workloads()] in ([], ["job-y"])
    assert a.wire.statuses("job-z") == []
    assert a.cluster.history.get("job-z") is None


async def sent_during_freeze(
    nc: Client, nats_url: str, subject: str, cmd: Dispatch, seconds: float
) -> CommandAck:
    """The answer to `cmd`, published from another thread while this one (and the agent's
    event loop with it) is frozen for `seconds`."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, max_msgs=1)
    await flush(nc)

    async def broker_sends() -> None:
        other = await nats.connect(nats_url, connect_timeout=5)
        await other.publish(subject, encode_msgpack(cmd), reply=inbox)
        await other.drain()

    sender = threading.Thread(target=asyncio.run, args=(broker_sends(),))
    sender.start()
    freeze(seconds)
    sender.join(timeout=10.0)
    assert not sender.is_alive()
    return decode_command_ack((await sub.next_msg(timeout=5.0)).data)


async def test_a_dispatch_read_after_a_freeze_before_any_ack_starts_nothing(
    make_agent: MakeAgent, nc: Client, nats_url: str
) -> None:
    """An agent that has just started, whose batches no broker has acknowledged yet, is
    frozen past an attempt's fence with a Dispatch waiting for it: that Dispatch is no older
    than the agent's subscription, but the agent reads it more than the fence after it, so
    it is refused as if the broker had last heard the cluster when the agent subscribed."""
    a = await make_agent()  # its batches go to this test's wire, which acknowledges none
    nodes = a.cluster.nodes_of("spot-a100")
    late = msgspec.structs.replace(dispatch("job-n", nodes[:1], sim=SLOW), fence_after_s=2.0)
    ack = await sent_during_freeze(nc, nats_url, a.wire.subjects.agent_cmd(a.name), late, 2.5)
    assert not ack.ok and "job-n not started" in ack.error, ack
    assert a.runtime.stats["late_dispatches"] == 1
    assert a.cluster.history.get("job-n") is None


async def test_on_reconnected_resends_snapshot(make_agent: MakeAgent) -> None:
    a = await make_agent()
    assert (await a.wire.send(dispatch("job-rc", a.cluster.nodes[:1], sim=SLOW))).ok
    n = len(a.wire.batches)
    await a.runtime.on_reconnected()
    snap = await a.wire.wait_snapshot(since=n)
    assert [w.job_id for w in snap.workloads] == ["job-rc"]


async def test_malformed_commands_get_error_acks(make_agent: MakeAgent) -> None:
    a = await make_agent()
    for junk in (
        b"\xc1\xff garbage",
        b"",
        encode_msgpack({"type": "dispatch", "job_id": "x"}),
        encode_msgpack({"type": "launch-missiles", "epoch": 1}),
        encode_msgpack([1, 2, 3]),
        msgspec.json.encode({"type": "cancel", "job_id": "x", "epoch": 1}),
    ):
        ack = await a.wire.send_raw(junk)
        assert not ack.ok and ack.error, junk
    ack = await a.wire.send(dispatch("job-m", a.cluster.nodes[:1], sim=FAST))
    assert ack.ok
    await a.wire.wait_status("job-m", 1, "succeeded")


async def test_backend_errors_are_acked_not_raised(make_agent: MakeAgent) -> None:
    a = await make_agent()
    ack = await a.wire.send(dispatch("job-x", ["no-such-node"], sim=SLOW))
    assert not ack.ok and "no-such-node" in ack.error
    ack = await a.wire.send(dispatch("job-x", a.cluster.nodes[:1], flavor="tpu", sim=SLOW))
    assert not ack.ok and "flavor" in ack.error
    node = a.cluster.nodes_of("spot-a100")[0]
    assert (await a.wire.send(dispatch("job-y", [node], gpu=6, sim=SLOW))).ok
    ack = await a.wire.send(dispatch("job-z", [node], gpu=4, sim=SLOW))
    assert not ack.ok and "over-committed" in ack.error
    # a failed dispatch can be retried once capacity frees up
    assert (await a.wire.send(Cancel(job_id="job-y", epoch=1))).ok
    assert (await a.wire.send(dispatch("job-z", [node], gpu=4, sim=SLOW))).ok


async def test_a_revision_the_workload_cannot_take_is_refused_with_its_reason(
    make_agent: MakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CannotResize is the one refusal of a revision: the broker then moves the gang whole;
    any other resize failure is acknowledged (the replicas on a lost node end with it)."""
    a = await make_agent()
    nodes = a.cluster.nodes_of("spot-a100")[:2]
    first = dispatch("job-r", nodes, gpu=1, sim=SLOW)
    assert (await a.wire.send(first)).ok

    why = "RayJob r-a1: RayJob has no replica count Muster can change"

    async def cannot(cmd: object) -> None:
        raise CannotResize(why)

    monkeypatch.setattr(a.cluster, "resize", cannot)
    revised = msgspec.structs.replace(first, revision=1, assignment=first.assignment[:1])
    ack = await a.wire.send(revised)
    assert (ack.ok, ack.resize_refused) == (False, True)
    assert (
        ack.error
        == "cannot resize in place: RayJob r-a1: RayJob has no replica count Muster can change"
    )

    async def broken(cmd: object) -> None:
        raise BackendError("node gone")

    monkeypatch.setattr(a.cluster, "resize", broken)
    ack = await a.wire.send(msgspec.structs.replace(revised, revision=2))
    assert ack.ok and not ack.resize_refused


async def test_checkpoint_now_reaches_only_the_attempts_own_pods(
    make_agent: MakeAgent, nc: Client
) -> None:
    """The request goes to the backend (the attempt's pods); nothing about it leaves on NATS
    beyond the agent's own subjects, since every workload shares one NATS user."""
    a = await make_agent()
    elsewhere: list[str] = []
    own = f"{a.runtime.subjects.prefix}.agent.{a.runtime.cluster}."

    async def on_any(msg: object) -> None:
        subject: str = msg.subject  # type: ignore[attr-defined]
        if not subject.startswith((own, "_INBOX")):
            elsewhere.append(subject)

    sub = await nc.subscribe(">", cb=on_any)
    assert (await a.wire.send(dispatch("job-k", a.cluster.nodes[:1], sim=SLOW))).ok
    await a.wire.wait_status("job-k", 1, "running")
    await wait_for(lambda: (a.cluster.workload("job-k", 1).step or 0) >= 1)  # type: ignore[union-attr]
    ack = await a.wire.send(CheckpointNow(job_id="job-k", attempt=1, epoch=1, deadline=1e10))
    assert ack.ok
    report = await a.wire.wait_for(
        lambda: [r for r in a.wire.events(CheckpointReport) if r.job_id == "job-k"]
    )
    assert report[-1].attempt == 1  # the backend took the request and checkpointed
    await flush(nc)
    await sub.unsubscribe()
    assert elsewhere == []


async def test_batching_respects_batch_max(make_agent: MakeAgent) -> None:
    a = await make_agent(batch_max=5, batch_interval_s=0.05)
    for _ in range(23):
        a.cluster.add_node("od-a100")
    await a.wire.wait_for(
        lambda: (
            sum(1 for b in a.wire.batches for e in b.events if not isinstance(e, Heartbeat)) >= 24
        )
    )
    assert all(len(b.events) <= 5 for b in a.wire.batches)
    seqs = [b.seq for b in a.wire.batches]
    assert seqs == list(range(1, len(seqs) + 1))


async def test_many_runtimes_share_one_connection(nc: Client) -> None:
    from agents.fake.cluster import FakeCluster
    from tests.agents.conftest import fast_config
    from tests.agents.helpers import BrokerWire

    names = [unique("s") for _ in range(5)]
    wires = [await BrokerWire(nc, n).start() for n in names]
    rts = [AgentRuntime(FakeCluster(n, fast_config()), nc, heartbeat_s=0.05) for n in names]
    for rt in rts:
        await rt.start()
    try:
        for w, n in zip(wires, names, strict=True):
            await w.wait_for(lambda w=w: len(w.batches) >= 3)
            assert {b.cluster for b in w.batches} == {n}
            ack = await w.send(Resync(epoch=0))
            assert ack.ok
    finally:
        for rt in rts:
            await rt.stop()
        for w in wires:
            await w.stop()


async def test_endings_queued_before_a_snapshot_ride_inside_it(make_agent: MakeAgent) -> None:
    """The broker reads a live attempt missing from a snapshot as lost, so an ending that is
    still queued when a snapshot is taken goes inside the snapshot, not after it."""
    a = await make_agent(batch_interval_s=0.2)
    assert (await a.wire.send(dispatch("job-t", a.cluster.nodes[:1], sim=SLOW))).ok
    await a.wire.wait_status("job-t", 1, "running")
    n = len(a.wire.batches)
    a.cluster.remove_node(a.cluster.nodes[0])
    a.runtime.request_snapshot()
    snap = await a.wire.wait_snapshot(since=n)
    (wl,) = snap.workloads
    assert (wl.job_id, wl.phase, wl.reason) == ("job-t", "evicted", "node-removed")
    assert not [s for s in a.wire.statuses("job-t") if s.phase == "evicted"]


async def test_job_finishing_during_outage_is_reported_on_heal(make_agent: MakeAgent) -> None:
    a = await make_agent(heartbeat_s=0.05)
    sim = Simulation(total_steps=30, steps_per_second=100.0, checkpoint_every=10)
    assert (await a.wire.send(dispatch("job-u", a.cluster.nodes[:1], sim=sim))).ok
    await a.wire.wait_status("job-u", 1, "created")
    a.cluster.outage(True)
    await wait_for(lambda: len(a.wire.batches) == a.runtime.seq)  # what was sent has landed
    n = len(a.wire.batches)
    await wait_for(lambda: a.cluster.history["job-u"][0].end_phase == "succeeded")
    assert len(a.wire.batches) == n  # it ended while partitioned: nothing said yet
    a.cluster.outage(False)
    snap = await a.wire.wait_snapshot(since=n)
    assert [(w.job_id, w.phase, w.step) for w in snap.workloads] == [("job-u", "succeeded", 30)]
    first = a.wire.batches[n]
    kinds = [type(e).__name__ for e in first.events]
    assert kinds.count("ClusterSnapshot") == 1
    steps = {e.step for e in first.events if isinstance(e, CheckpointReport)}
    assert steps == {10, 20}  # checkpoints made during the outage are not lost


async def test_closed_connection_does_not_crash_or_spin(nats_url: str) -> None:
    import nats

    from agents.fake.cluster import FakeCluster
    from tests.agents.conftest import fast_config

    own = await nats.connect(nats_url)
    cluster = FakeCluster(unique("z"), fast_config())
    rt = AgentRuntime(cluster, own, heartbeat_s=0.02)
    await rt.start()
    closed = time.monotonic()
    await own.close()
    for _ in range(20):
        cluster.add_node("od-a100")
    await wait_for(lambda: rt.stats["errors"] >= 3, what="three failed publishes")
    # Retried every 0.2 s (RETRY_S), not in a busy loop: at most one failure per pause since
    # the close, however long the wait took.
    assert rt.stats["errors"] <= 1 + (time.monotonic() - closed) / 0.2, rt.stats
    assert rt.looping
    await rt.stop()
