"""Fence windows in minutes, set apart from failure detection: a cluster silent for ten
minutes loses nothing (it only stops getting placements), one silent past `lost_after_s` has
its jobs requeued as an infrastructure loss that names the cluster and the silence."""

from __future__ import annotations

from broker.core.inputs import CYCLE, TICK
from schemas.agent import Dispatch, Heartbeat, SpotNotice
from schemas.config import Timeouts
from schemas.job import CheckpointSpec, RestartPolicy
from tests.core.harness import T0, Sim, events, run, sends

DEFAULTS = Timeouts()


def test_dispatches_grant_the_window_between_detection_and_redispatch() -> None:
    w = Sim.empty()
    w.cluster("a")
    w.submit()
    (dispatch,) = sends(w.cycle(), Dispatch)
    assert dispatch.fence_after_s == DEFAULTS.lost_after_s - DEFAULTS.fence_lead_s == 900.0
    assert DEFAULTS.unreachable_after_s < 60 < 600 < dispatch.fence_after_s


def test_ten_silent_minutes_cost_nothing() -> None:
    w = Sim.empty()
    w.cluster("a")
    w.cluster("b")
    job = w.submit()
    w.cycle()
    cluster = w.m.jobs[job].current.cluster  # type: ignore[union-attr]
    other = "b" if cluster == "a" else "a"
    run(w, job, cluster, 1)
    for _ in range(60):  # ten minutes, only the other agent speaks
        w.now += 10
        w.send(other, Heartbeat(at=w.now))
        fx = w.m.handle(TICK, w.now)
        assert "requeued" not in events(fx) and not sends(fx, Dispatch)
    assert w.m.agents[cluster].health == "unreachable"
    record = w.m.jobs[job]
    assert record.state == "running" and record.attempt == 1
    w.send(cluster, Heartbeat(at=w.now))  # back: healthy again, nothing happened
    assert w.m.agents[cluster].health == "healthy"


def test_a_fence_kill_is_an_infrastructure_loss_that_names_the_cluster() -> None:
    w = Sim.empty()
    w.cluster("a")
    w.cluster("b")
    job = w.submit(restart=RestartPolicy(max_restarts_on_error=0))
    w.cycle()
    cluster = w.m.jobs[job].current.cluster  # type: ignore[union-attr]
    other = "b" if cluster == "a" else "a"
    run(w, job, cluster, 1)
    requeued = None
    while requeued is None and w.now < 1e10:
        w.now += 30
        w.send(other, Heartbeat(at=w.now))
        fx = w.m.handle(TICK, w.now)
        if "requeued" in events(fx):
            requeued = w.now
    assert requeued is not None
    record = w.m.jobs[job]
    assert record.state == "queued" and record.errors == 0 and record.preemptions == 1
    assert record.reason is not None and record.reason.startswith(
        f"fenced: cluster {cluster} unreachable for "
    )
    seconds = int(record.reason.split(" for ")[1].split(" s")[0])
    assert DEFAULTS.lost_after_s <= seconds <= DEFAULTS.lost_after_s + 30


def test_a_replacement_waits_while_the_old_copy_runs_on_a_silent_cluster() -> None:
    """A preemption whose grace runs out while the old attempt's cluster is silent: a Cancel
    would not be heard and the old copy runs until its fence lapses, minutes later. The
    replacement starts once the cluster speaks again, or once it is declared lost."""
    w = Sim.empty()
    w.cluster("a")
    w.cluster("b")
    job = w.submit(checkpoint=CheckpointSpec(uri="s3://x"), capacity="spot")  # type: ignore[arg-type]
    w.cycle()
    current = w.m.jobs[job].current
    assert current is not None
    first, node = current.cluster, current.assignment[0].nodes[0]
    other = {"a": "b", "b": "a"}[first]
    run(w, job, first, 1)
    fx = w.send(first, SpotNotice(node=node, deadline=w.now + 120))
    assert "preempting" in events(fx)
    dispatched: list[Dispatch] = []
    while w.now < T0 + DEFAULTS.lost_after_s + 60:  # the agent of `first` is silent
        w.now += 10
        w.send(other, Heartbeat(at=w.now))
        fx = w.m.handle(TICK, w.now) + w.m.handle(CYCLE, w.now)
        dispatched += sends(fx, Dispatch)
        if dispatched:
            break
    (replacement,) = dispatched
    assert replacement.attempt == 2
    # not before the silent cluster was given up on: its fence had lapsed by then
    assert w.now - T0 >= DEFAULTS.lost_after_s
