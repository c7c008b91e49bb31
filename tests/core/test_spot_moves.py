"""Spot economics in the core: Young/Daly checkpoint advice per pool, spot-return
make-before-break, and deadlines that switch to on-demand in time."""

from __future__ import annotations

import math

import msgspec
import pytest

from agents.workload_env import muster_env
from broker.core.effects import Effect, Send, split_reply
from broker.core.inputs import Checkpoint, Cycle, Restore, SubmitJob, Tick
from broker.core.invariants import violations
from broker.core.machine import Machine
from broker.core.records import record_decoder, record_encoder
from broker.core.risk import MAX_ADVISED_S, NOTICE_MISS, young_daly_s
from broker.core.spotreturn import MIN_RUN_S, RECLAIMED_BACKOFF_S
from schemas.agent import (
    Cancel,
    CheckpointNow,
    CheckpointReport,
    ClusterSnapshot,
    Dispatch,
    Heartbeat,
    NodeGone,
    NodeUpsert,
    SpotNotice,
    WorkloadStatus,
)
from schemas.job import CheckpointSpec, Deadline, JobSpec, SpotPolicy
from tests.core.helpers import NOW, flavor, nodes
from tests.core.spot_pools import (
    SPOT_OK,
    Agent,
    dispatches,
    live_attempts,
    running,
    sends,
    setup,
    spot_job,
)

SPOT = ("east", "v100-spot")


def checkpoint(agent: Agent, d: Dispatch, step: int, now: float) -> None:
    agent.send(
        CheckpointReport(job_id=d.job_id, attempt=d.attempt, step=step, uri=f"s3://b/ck/{step}"),
        now=now,
    )


def tick(m: Machine, agent: Agent, now: float) -> list[Effect]:
    """The agent's heartbeat, then the machine's timer (a silent cluster would be lost)."""
    agent.send(Heartbeat(), now=now)
    return m.handle(Tick(), now)


def accepted(m: Machine, spec: JobSpec, now: float) -> bool:
    return split_reply(m.handle(SubmitJob(spec), now))[0].accepted


def test_dispatch_advises_young_daly_for_its_pool_and_the_advice_follows_the_pool() -> None:
    m, agent = setup()
    agent.send(NodeUpsert(node=nodes("spot-up", "v100-spot", 2)[0]), now=NOW + 2)
    spec = spot_job(
        "advised",
        capacity="spot-then-on-demand",
        checkpoint=CheckpointSpec(uri="s3://b/ck", interval_s=600, cost_s=50),
    )
    assert split_reply(m.handle(SubmitJob(spec), NOW + 3))[0].accepted
    (d,) = dispatches(m.handle(Cycle(), NOW + 4))
    assert d.flavor == "v100-spot"
    # No notice seen yet: every reclaim counts as a loss at the pool's learned rate.
    rate = m.scheduler.pool_interruption_rate(SPOT, NOW + 4)
    assert rate > 0
    assert d.checkpoint_interval_s == round(math.sqrt(2 * 50 * 3600 / rate), 1)
    assert muster_env(d)["MUSTER_CHECKPOINT_INTERVAL_S"] == f"{d.checkpoint_interval_s:g}"

    # A notice with AWS's 120 s window: a 50 s checkpoint fits, so only the misses count and
    # the next attempt (on the same pool) is advised to checkpoint far less often.
    running(agent, d, NOW + 10)
    node = d.assignment[0].nodes[0]
    agent.send(SpotNotice(node=node, deadline=NOW + 140), now=NOW + 20)
    agent.send(NodeUpsert(node=nodes("spot-more", "v100-spot", 1)[0]), now=NOW + 21)
    effects = m.handle(
        Checkpoint(
            CheckpointReport(job_id="advised", attempt=d.attempt, step=5, uri="s3://b/ck/5")
        ),
        NOW + 70,
    )
    m.jobs["advised"].avoid.clear()  # (the lost pool's avoidance is not what this tests)
    effects += m.handle(Cycle(), NOW + 71)
    (d2,) = sends(effects, Dispatch)
    assert isinstance(d2, Dispatch)
    if d2.flavor == "v100-spot":
        rate2 = m.scheduler.pool_interruption_rate(SPOT, NOW + 70)
        want = young_daly_s(50, rate2 * NOTICE_MISS)
        assert d2.checkpoint_interval_s == pytest.approx(want, rel=1e-3)
        assert d2.checkpoint_interval_s > 2 * d.checkpoint_interval_s
    else:  # moved to on-demand, where nothing is reclaimed
        assert d2.checkpoint_interval_s == MAX_ADVISED_S


def test_no_advice_without_a_checkpoint_cost() -> None:
    m, agent = setup()
    agent.send(NodeUpsert(node=nodes("spot-up", "v100-spot", 1)[0]), now=NOW + 2)
    spec = spot_job("unadvised", checkpoint=CheckpointSpec(uri="s3://b/ck"))
    assert split_reply(m.handle(SubmitJob(spec), NOW + 3))[0].accepted
    (d,) = dispatches(m.handle(Cycle(), NOW + 4))
    assert d.checkpoint_interval_s == 0.0
    assert "MUSTER_CHECKPOINT_INTERVAL_S" not in muster_env(d)


def on_demand_job(m: Machine, agent: Agent, name: str) -> Dispatch:
    """A spot-then-on-demand job that fell back to on-demand because spot was empty."""
    spec = spot_job(
        name,
        capacity="spot-then-on-demand",
        checkpoint=CheckpointSpec(uri="s3://b/ck", interval_s=600, cost_s=30),
        spot=SpotPolicy(fallback_after_wait_s=0),
    )
    assert split_reply(m.handle(SubmitJob(spec), NOW + 2))[0].accepted
    assert dispatches(m.handle(Cycle(), NOW + 3)) == []
    tick(m, agent, NOW + 4)
    (d,) = dispatches(m.handle(Cycle(), NOW + 5))
    assert d.flavor == "v100-od"
    running(agent, d, NOW + 60)
    return d


def test_spot_return_moves_back_make_before_break_and_never_two_copies() -> None:
    m, agent = setup()
    d = on_demand_job(m, agent, "returner")
    agent.send(NodeUpsert(node=nodes("spot-back", "v100-spot", 1)[0]), now=NOW + 100)
    # Too early: a job that has run a few minutes is not worth a checkpoint-and-move.
    effects = tick(m, agent, NOW + 60 + MIN_RUN_S / 2)
    assert sends(effects, CheckpointNow) == [] and m.jobs["returner"].state == "running"

    now = NOW + 60 + 3 * MIN_RUN_S
    checkpoint(agent, d, 500, now - 10)
    effects = tick(m, agent, now)
    record = m.jobs["returner"]
    # Make: the spot placement is reserved and a checkpoint asked for; nothing is cancelled
    # and nothing dispatched yet, and only the on-demand attempt is live.
    assert [c.attempt for c in sends(effects, CheckpointNow)] == [d.attempt]  # type: ignore[attr-defined]
    assert sends(effects, Cancel) == [] and sends(effects, Dispatch) == []
    assert record.state == "preempting" and record.preempting is not None
    rep = record.preempting.replacement
    assert rep is not None and rep.flavor == "v100-spot"
    assert live_attempts(m, "returner") == 1
    assert m.handle(Cycle(), now + 1) == [] or dispatches(m.handle(Cycle(), now + 1)) == []

    # Break: the checkpoint lands; the old attempt is cancelled, then the new one sent.
    effects = m.handle(
        Checkpoint(
            CheckpointReport(job_id="returner", attempt=d.attempt, step=600, uri="s3://b/ck/600")
        ),
        now + 30,
    )
    kinds = [type(e.command).__name__ for e in effects if isinstance(e, Send)]
    assert kinds.index("Cancel") < kinds.index("Dispatch")
    (cancel,) = sends(effects, Cancel)
    (new,) = sends(effects, Dispatch)
    assert isinstance(cancel, Cancel) and isinstance(new, Dispatch)
    assert cancel.attempt == d.attempt
    assert new.flavor == "v100-spot" and new.attempt == d.attempt + 1
    assert new.resume_from is not None and new.resume_from.step == 600
    assert live_attempts(m, "returner") == 1
    assert record.current is not None and record.current.flavor == "v100-spot"
    assert record.preemptions == 0  # a move by choice is not a loss
    assert not record.spot_exhausted


def test_no_spot_no_move() -> None:
    m, agent = setup()
    d = on_demand_job(m, agent, "stays")
    effects = tick(m, agent, NOW + 60 + 3 * MIN_RUN_S)
    assert sends(effects, CheckpointNow) == []
    record = m.jobs["stays"]
    assert record.state == "running" and record.preempting is None
    assert record.current is not None and record.current.attempt == d.attempt


def deadline_job(name: str, within_s: float, runtime_s: float) -> JobSpec:
    return spot_job(
        name,
        capacity="spot-then-on-demand",
        checkpoint=CheckpointSpec(uri="s3://b/ck", interval_s=600, cost_s=30),
        # Spot-then-on-demand alone would wait a day for spot: only the deadline moves it.
        spot=SpotPolicy(fallback_after_wait_s=86_400, fallback_after_preemptions=100),
        deadline=Deadline(within_s=within_s, runtime_s=runtime_s, total_steps=int(runtime_s)),
    )


def test_a_deadline_job_finishes_in_time_when_spot_vanishes() -> None:
    """Steps are seconds of work. Spot runs 20 min, checkpointing every 10, then every spot
    node goes and none comes back. The job waits while its slack allows, then switches."""
    within, runtime = 4 * 3600.0, 3600.0
    m, agent = setup()
    agent.send(NodeUpsert(node=nodes("spot-up", "v100-spot", 1)[0]), now=NOW + 2)
    submitted = NOW + 3
    assert accepted(m, deadline_job("due", within, runtime), submitted)
    (d,) = dispatches(m.handle(Cycle(), NOW + 4))
    assert d.flavor == "v100-spot"
    start = NOW + 64
    running(agent, d, start)
    checkpoint(agent, d, 600, start + 600)
    checkpoint(agent, d, 1200, start + 1230)
    gone = start + 1500
    agent.send(NodeGone(node=d.assignment[0].nodes[0]), now=gone)
    record = m.jobs["due"]
    assert record.state == "queued"

    # The world from here: no spot. Tick and cycle once a minute until it is dispatched.
    now, od = gone, None
    while od is None and now < submitted + within:
        now += 60
        tick(m, agent, now)
        sent = dispatches(m.handle(Cycle(), now))
        od = sent[0] if sent else None
    assert od is not None and od.flavor == "v100-od", record.reason
    assert record.deadline_on_demand
    assert now - gone > 3600  # it used its slack waiting for spot, not at once
    assert od.resume_from is not None and od.resume_from.step == 1200
    # It runs the rest on on-demand: start-up, restore, then the work left.
    run_at = now + 60 + 30
    running(agent, od, run_at)
    done = run_at + (runtime - 1200)
    agent.send(
        WorkloadStatus(job_id="due", attempt=od.attempt, phase="succeeded", nodes=["od-0"]),
        now=done,
    )
    assert record.state == "succeeded"
    assert record.finished_at is not None and record.finished_at <= submitted + within


def test_a_deadline_job_on_spot_moves_to_on_demand_make_before_break() -> None:
    m, agent = setup()
    agent.send(NodeUpsert(node=nodes("spot-up", "v100-spot", 1)[0]), now=NOW + 2)
    # An hour of work due in 80 min: ~15 min of slack, gone while it runs on spot.
    assert accepted(m, deadline_job("tight", 80 * 60.0, 3600.0), NOW + 3)
    (d,) = dispatches(m.handle(Cycle(), NOW + 4))
    assert d.flavor == "v100-spot"
    running(agent, d, NOW + 64)
    effects: list[Effect] = []
    now = NOW + 64
    while not sends(effects, CheckpointNow) and now < NOW + 3600:
        now += 60
        effects = tick(m, agent, now)
    record = m.jobs["tight"]
    assert record.deadline_on_demand and record.state == "preempting"
    assert record.preempting is not None and record.preempting.replacement is not None
    assert record.preempting.replacement.flavor == "v100-od"
    assert live_attempts(m, "tight") == 1
    report = CheckpointReport(job_id="tight", attempt=d.attempt, step=900, uri="s3://b/ck/900")
    effects = m.handle(Checkpoint(report), now + 30)
    kinds = [type(e.command).__name__ for e in effects if isinstance(e, Send)]
    assert kinds.index("Cancel") < kinds.index("Dispatch")
    assert record.current is not None and record.current.flavor == "v100-od"
    assert live_attempts(m, "tight") == 1
    # Never back to spot: a later spot-return scan leaves it on on-demand.
    agent.send(NodeUpsert(node=nodes("spot-new", "v100-spot", 1)[0]), now=now + 40)
    running(agent, sends(effects, Dispatch)[0], now + 100)  # type: ignore[arg-type]
    assert sends(tick(m, agent, now + 100 + 3 * MIN_RUN_S), CheckpointNow) == []


def test_a_spot_only_job_cannot_have_a_deadline() -> None:
    with pytest.raises(msgspec.ValidationError, match="spot-then-on-demand or any"):
        msgspec.convert(
            {
                "name": "x",
                "capacity": "spot",
                "gang": [{"name": "w", "gpu": 1}],
                "deadline": {"within_s": 10, "runtime_s": 5, "total_steps": 5},
            },
            JobSpec,
        )


def test_a_deadline_move_of_a_job_without_checkpoints_dispatches_its_reserved_placement() -> None:
    """Nothing to wait for: the old attempt is cancelled and the reserved on-demand placement
    dispatched at once; the reservation is neither leaked nor charged twice."""
    m, agent = setup()
    agent.send(NodeUpsert(node=nodes("spot-up", "v100-spot", 1)[0]), now=NOW + 2)
    spec = msgspec.structs.replace(
        deadline_job("bare", 80 * 60.0, 3600.0), checkpoint=None, labels=SPOT_OK
    )
    assert accepted(m, spec, NOW + 3)
    (d,) = dispatches(m.handle(Cycle(), NOW + 4))
    assert d.flavor == "v100-spot"
    running(agent, d, NOW + 64)
    effects: list[Effect] = []
    now = NOW + 64
    record = m.jobs["bare"]
    while not record.deadline_on_demand and now < NOW + 3600:
        now += 60
        effects = tick(m, agent, now)
    assert record.deadline_on_demand
    kinds = [type(e.command).__name__ for e in effects if isinstance(e, Send)]
    assert kinds == ["Cancel", "Dispatch"]
    (od,) = sends(effects, Dispatch)
    assert od.flavor == "v100-od" and od.attempt == d.attempt + 1  # type: ignore[attr-defined]
    assert record.current is not None and record.current.attempt == od.attempt  # type: ignore[attr-defined]
    assert live_attempts(m, "bare") == 1
    assert violations(m) == []
    # The cycle finds nothing more to place for it: the reservation was not left behind.
    assert dispatches(m.handle(Cycle(), now + 1)) == []
    assert violations(m) == []


def _return_to_spot(m: Machine, agent: Agent, d: Dispatch, now: float, step: int) -> Dispatch:
    """Tick at `now` (the job may return), land the checkpoint: the spot attempt, running."""
    checkpoint(agent, d, step, now - 10)
    assert [c.attempt for c in sends(tick(m, agent, now), CheckpointNow)] == [d.attempt]  # type: ignore[attr-defined]
    uri = f"s3://b/ck/{step + 1}"
    report = CheckpointReport(job_id=d.job_id, attempt=d.attempt, step=step + 1, uri=uri)
    (new,) = sends(m.handle(Checkpoint(report), now + 30), Dispatch)
    assert isinstance(new, Dispatch) and new.flavor == "v100-spot"
    running(agent, new, now + 60)
    return new


def test_a_return_that_was_reclaimed_backs_the_job_off() -> None:
    """A job reclaimed after a return stops bouncing: it stays on on-demand for
    RECLAIMED_BACKOFF_S after the reclaim, however long it has run there, then may return."""
    m, agent = setup()
    d = on_demand_job(m, agent, "bouncer")
    agent.send(NodeUpsert(node=nodes("spot-a", "v100-spot", 1)[0]), now=NOW + 100)
    now = NOW + 60 + 3 * MIN_RUN_S
    on_spot = _return_to_spot(m, agent, d, now, 500)
    # Spot takes its node back; the job falls back to on-demand and runs there again.
    reclaimed_at = now + 120
    agent.send(NodeGone(node=on_spot.assignment[0].nodes[0]), now=reclaimed_at)
    record = m.jobs["bouncer"]
    record.avoid.clear()  # (the lost pool's avoidance is not what this tests)
    tick(m, agent, reclaimed_at + 1)
    (od,) = dispatches(m.handle(Cycle(), reclaimed_at + 2))
    assert od.flavor == "v100-od"
    started = reclaimed_at + 60
    running(agent, od, started)
    agent.send(NodeUpsert(node=nodes("spot-b", "v100-spot", 1)[0]), now=started + 1)
    # A run that paid for the first return is not enough while the job backs off ...
    later = reclaimed_at + RECLAIMED_BACKOFF_S - 60
    checkpoint(agent, od, 700, later - 10)
    assert sends(tick(m, agent, later), CheckpointNow) == []
    assert record.state == "running" and record.current is not None
    assert record.current.attempt == od.attempt
    # ... after the backoff it may return.
    _return_to_spot(m, agent, od, reclaimed_at + RECLAIMED_BACKOFF_S + 60, 800)
    assert live_attempts(m, "bouncer") == 1
    assert violations(m) == []


def test_no_return_takes_spot_a_queued_job_of_equal_priority_could_use() -> None:
    """Spot that comes back goes to the queue first: a running on-demand job does not move
    onto it while a queued job of its priority or higher would take spot."""
    m, agent = setup()
    d = on_demand_job(m, agent, "returner")
    waiting = spot_job("waiting", capacity="spot")
    assert split_reply(m.handle(SubmitJob(waiting), NOW + 200))[0].accepted
    now = NOW + 60 + 3 * MIN_RUN_S
    checkpoint(agent, d, 500, now - 10)
    agent.send(NodeUpsert(node=nodes("spot-back", "v100-spot", 1)[0]), now=now - 5)
    assert sends(tick(m, agent, now), CheckpointNow) == []
    assert m.jobs["returner"].preempting is None
    # The queued job takes the spot node; with nothing waiting the return is free to happen.
    (placed,) = dispatches(m.handle(Cycle(), now + 1))
    assert placed.job_id == "waiting" and placed.flavor == "v100-spot"
    agent.send(NodeUpsert(node=nodes("spot-more", "v100-spot", 1)[0]), now=now + 2)
    later = now + 2 * 60
    checkpoint(agent, d, 600, later - 10)
    assert [c.attempt for c in sends(tick(m, agent, later), CheckpointNow)] == [d.attempt]  # type: ignore[attr-defined]


def test_a_deadline_survives_a_broker_restart_and_still_switches_in_time() -> None:
    """The deadline is followed from the persisted record: a broker that restarts while the
    job runs on spot moves it to on-demand when the slack runs out, as the first would have."""
    m, agent = setup()
    agent.send(NodeUpsert(node=nodes("spot-up", "v100-spot", 1)[0]), now=NOW + 2)
    assert accepted(m, deadline_job("kept", 80 * 60.0, 3600.0), NOW + 3)
    (d,) = dispatches(m.handle(Cycle(), NOW + 4))
    assert d.flavor == "v100-spot"
    running(agent, d, NOW + 64)
    # The broker dies; a new one restores what was persisted, and the agent resyncs.
    persisted = [record_decoder.decode(record_encoder.encode(r)) for r in m.jobs.values()]
    m2 = Machine(m.config)
    m2.handle(Restore(persisted), NOW + 100)
    agent2 = Agent(m2, "east")
    status = WorkloadStatus(
        job_id="kept",
        attempt=d.attempt,
        phase="running",
        running_replicas=1,
        total_replicas=1,
        nodes=[d.assignment[0].nodes[0]],
    )
    agent2.send(
        ClusterSnapshot(
            flavors=[flavor("v100-spot", "spot", "v100", 0.9), flavor("v100-od", price=3.0)],
            nodes=nodes("spot-up", "v100-spot", 1) + nodes("od", "v100-od", 1),
            workloads=[status],
        ),
        now=NOW + 101,
    )
    record = m2.jobs["kept"]
    assert record.state == "running" and not record.deadline_on_demand
    effects: list[Effect] = []
    now = NOW + 101
    while not sends(effects, CheckpointNow) and now < NOW + 3600:
        now += 60
        effects = tick(m2, agent2, now)
    assert record.deadline_on_demand and record.state == "preempting"
    assert record.preempting is not None and record.preempting.replacement is not None
    assert record.preempting.replacement.flavor == "v100-od"
    assert now < NOW + 80 * 60 - 3600 + 15 * 60  # while the slack still covers the move
    assert violations(m2) == []
