"""A preemption that only the victims' minimum runtime stops is planned when that protection
lapses, not at the next unrelated capacity change; `why` says so beforehand, and the victim's
events say who preempted it and why."""

from __future__ import annotations

from typing import Any

from broker.core.effects import Publish, Send
from broker.core.inputs import CYCLE, TICK
from broker.core.machine import Machine
from schemas.agent import CheckpointNow, Heartbeat
from schemas.config import BrokerConfig, PreemptionPolicy, QueueConfig, SchedulingConfig
from schemas.job import CheckpointSpec
from tests.core.harness import OD, Sim, run

MIN_RUNTIME = 60.0


def _world() -> Sim:
    w = Sim.empty()
    w.m = Machine(
        BrokerConfig(
            queues=[
                QueueConfig(
                    name="q",
                    preemption=PreemptionPolicy(
                        within_queue="LowerPriority", reclaim_within_cohort="Never"
                    ),
                )
            ],
            scheduling=SchedulingConfig(preemption_min_runtime_s=MIN_RUNTIME),
        ),
        epoch=3,
    )
    return w


def _quiet_step(w: Sim, dt: float) -> list[Any]:
    """Time passes; the agent only heartbeats: no job ends, no capacity changes."""
    w.now += dt
    out = w.send("a", Heartbeat(at=w.now))
    out += w.m.handle(TICK, w.now)
    out += w.m.handle(CYCLE, w.now)
    return out


def _preempting(effects: list[Any]) -> list[Any]:
    return [e.event for e in effects if isinstance(e, Publish) and e.event.kind == "preempting"]


def test_the_preemptor_does_not_wait_for_an_unrelated_event() -> None:
    w = _world()
    w.cluster("a", flavor=OD)
    low = w.submit("low", priority=0, checkpoint=CheckpointSpec(uri="s3://b/low"))
    w.cycle()
    run(w, low, "a", 1)
    admitted_at = w.now
    w.now += 5.0
    high = w.submit("high", priority=100)
    fx = _quiet_step(w, 0.0)
    assert not _preempting(fx)

    why = w.m.views.why(high, w.now)
    assert why is not None
    first = why.reasons[0]
    assert first.code == "preemption-protected", why.reasons
    assert f"will preempt {low}" in first.message
    assert "preemption_min_runtime_s: 60s" in first.message
    assert "lapses in 55s" in first.message
    assert why.waiting_for == "the victims' minimum runtime (preemption_min_runtime_s)"

    seen: list[Any] = []
    while w.now < admitted_at + MIN_RUNTIME + 1.0:
        fx = _quiet_step(w, 1.0)
        if _preempting(fx):
            seen = fx
            break
    assert seen, "the preemption was never planned without another event"
    assert w.now <= admitted_at + MIN_RUNTIME + 1.0  # within one tick of the lapse
    (event,) = _preempting(seen)
    assert event.job_id == low
    assert event.reason.startswith(f"preempted: to accommodate {high} (priority 100")
    asks = [e.command for e in seen if isinstance(e, Send)]
    assert any(isinstance(c, CheckpointNow) and c.job_id == low for c in asks)
    view = w.m.views.job_view(low, w.now)
    assert view is not None and f"preempting: preempted: to accommodate {high}" in (
        view.waiting or ""
    )

    # the checkpoint grace ends: the victim is requeued saying why, the preemptor starts
    started: list[Any] = []
    for _ in range(400):
        fx = _quiet_step(w, 1.0)
        started += [c for c in (e.command for e in fx if isinstance(e, Send)) if c.job_id == high]
        if started:
            break
    assert started, "the preemptor never started"
    view = w.m.views.job_view(low, w.now)
    assert view is not None and view.state == "queued"
    assert (view.reason or "").startswith(f"preempted: to accommodate {high} (priority 100) on a/")
