"""The lifecycle machine under a virtual clock: budgets, timeouts, fencing, sequence tracking
and widening, plus a hypothesis property over random event sequences."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.core.effects import Effect, Persist, Publish, Send, refusal
from broker.core.inputs import (
    CYCLE,
    AgentBatch,
    CancelJob,
    CancelSettled,
    DispatchAcked,
    Restore,
)
from broker.core.invariants import unordered_dispatches, violations
from schemas.agent import (
    Cancel,
    CheckpointReport,
    ClusterSnapshot,
    Dispatch,
    EventBatch,
    GpuHealth,
    Heartbeat,
    NodeGone,
    NodeUpsert,
    Resync,
    SpotNotice,
    WorkloadStatus,
)
from schemas.job import CheckpointSpec, Deadline, RestartPolicy, SpotPolicy
from tests.core.harness import OD, SPOT, Sim, events, node, run, sends


def test_dispatch_is_persisted_before_it_is_sent() -> None:
    w = Sim.empty()
    w.cluster("a")
    job = w.submit()
    effects = w.cycle()
    kinds = [type(e).__name__ if not isinstance(e, Send) else "Send" for e in effects]
    assert kinds.index("Persist") < kinds.index("Send")
    (dispatch,) = sends(effects, Dispatch)
    assert (dispatch.job_id, dispatch.attempt, dispatch.epoch) == (job, 1, 3)


def test_error_budget_then_clear_failure() -> None:
    w = Sim.empty()
    w.cluster("a")
    job = w.submit(restart=RestartPolicy(max_restarts_on_error=1, backoff_s=10))
    w.cycle()
    run(w, job, "a", 1)
    fx = w.send("a", WorkloadStatus(job_id=job, attempt=1, phase="failed", exit_codes=[3]))
    assert "requeued" in events(fx)
    assert not sends(w.cycle(5), Dispatch)  # backing off
    assert w.m.views.why(job, w.now).reasons[0].code == "backoff"  # type: ignore[union-attr]
    (d,) = sends(w.cycle(6), Dispatch)
    assert d.attempt == 2
    run(w, job, "a", 2)
    fx = w.send("a", WorkloadStatus(job_id=job, attempt=2, phase="failed", exit_codes=[3]))
    assert events(fx)[-1] == "failed"
    view = w.m.views.job_view(job, w.now)
    assert view is not None and view.state == "failed"
    assert "max_restarts_on_error=1" in (view.reason or "")


def test_non_retriable_exit_code_fails_at_once() -> None:
    w = Sim.empty()
    w.cluster("a")
    job = w.submit(restart=RestartPolicy(retriable_exit_codes=[137]))
    w.cycle()
    run(w, job, "a", 1)
    w.send("a", WorkloadStatus(job_id=job, attempt=1, phase="failed", exit_codes=[2]))
    view = w.m.views.job_view(job, w.now)
    assert view is not None and view.state == "failed" and "not in" in (view.reason or "")


def test_preemption_budget_is_separate_and_enforced() -> None:
    w = Sim.empty()
    w.cluster("a", count=2)
    job = w.submit(restart=RestartPolicy(max_preemptions=1, max_restarts_on_error=0))
    (d,) = sends(w.cycle(), Dispatch)
    run(w, job, "a", 1)
    w.send("a", NodeGone(node=d.assignment[0].nodes[0]))
    (d2,) = sends(w.cycle() + w.cycle(), Dispatch)  # avoided pool, then widened
    run(w, job, "a", 2)
    w.send("a", NodeGone(node=d2.assignment[0].nodes[0]))
    view = w.m.views.job_view(job, w.now)
    assert view is not None and view.state == "failed"
    assert "max_preemptions=1" in (view.reason or "") and view.accounting.errors == 0


def test_start_timeout_requeues_with_exponential_backoff() -> None:
    w = Sim.empty(start_s=30, dispatch_report_s=0)
    for c in ("a", "b", "c"):  # each failed start keeps the next try off its pool
        w.cluster(c)
    job = w.submit(restart=RestartPolicy(backoff_s=4, max_backoff_s=100))
    w.cycle()
    w.m.handle(DispatchAcked(job, 1, True, ""), w.now)
    fx = w.cycle(31)
    (cancel,) = sends(fx, Cancel)
    assert (cancel.job_id, cancel.attempt) == (job, 1)
    assert "requeued" in events(fx)
    assert not sends(w.cycle(3), Dispatch) and sends(w.cycle(2), Dispatch)  # 4 s backoff
    w.m.handle(DispatchAcked(job, 2, True, ""), w.now)
    w.cycle(31)
    assert not sends(w.cycle(7), Dispatch) and sends(w.cycle(2), Dispatch)  # then 8 s
    clusters = [a.cluster for a in w.m.jobs[job].attempts]
    assert len(set(clusters)) == 3, clusters


def test_sequence_gap_drops_deltas_until_a_snapshot() -> None:
    w = Sim.empty()
    w.cluster("a", count=1)
    job = w.submit()
    w.cycle()
    fx = w.send("a", Heartbeat(), seq=5)
    assert sends(fx, Resync)
    # A delta after the gap is ignored: the job is not seen as running.
    w.send(
        "a",
        WorkloadStatus(
            job_id=job, attempt=1, phase="running", running_replicas=1, total_replicas=1
        ),
    )
    assert w.m.jobs[job].state == "admitted"
    w.send(
        "a",
        ClusterSnapshot(
            flavors=[SPOT],
            nodes=[node("a", 0)],
            workloads=[
                WorkloadStatus(
                    job_id=job, attempt=1, phase="running", running_replicas=1, total_replicas=1
                )
            ],
        ),
    )
    assert w.m.jobs[job].state == "running"


def test_foreign_cluster_claim_is_rejected() -> None:
    w = Sim.empty()
    batch = EventBatch(
        cluster="b",
        instance="x",
        seq=1,
        events=[ClusterSnapshot(flavors=[SPOT], nodes=[node("b", 0)])],
    )
    out = w.m.handle(AgentBatch("a", batch), w.now)
    error = refusal(out)
    assert error and "claims cluster 'b'" in error
    assert not w.m.agents and not w.m.scheduler.known_clusters()


def test_lost_pool_is_avoided_then_widened_when_nothing_else_fits() -> None:
    w = Sim.empty()
    w.cluster("a", count=2)
    job = w.submit(checkpoint=CheckpointSpec(uri="s3://x"))  # type: ignore[arg-type]
    (d,) = sends(w.cycle(), Dispatch)
    run(w, job, "a", 1)
    w.send("a", CheckpointReport(job_id=job, attempt=1, step=30, uri="s3://x/30"))
    w.send("a", GpuHealth(node=d.assignment[0].nodes[0], healthy=0, xid=48))
    assert not sends(w.cycle(), Dispatch)  # only the lost pool fits: avoided this cycle
    assert any(r.code == "pool-avoided" for r in w.m.reasons[job])
    (d2,) = sends(w.cycle(), Dispatch)  # widened
    assert d2.attempt == 2 and d2.resume_from is not None and d2.resume_from.step == 30
    assert d2.assignment[0].nodes != d.assignment[0].nodes


def running_on_spot() -> tuple[Sim, str, Dispatch, str, str]:
    """A checkpointing spot job running on one of two clusters: (sim, job, its Dispatch,
    its cluster, the other)."""
    w = Sim.empty()
    w.cluster("a")
    w.cluster("b")
    job = w.submit(checkpoint=CheckpointSpec(uri="s3://x"), capacity="spot")  # type: ignore[arg-type]
    (d,) = sends(w.cycle(), Dispatch)
    first = "a" if d.assignment[0].nodes[0].startswith("a") else "b"
    run(w, job, first, 1)
    return w, job, d, first, "b" if first == "a" else "a"


def test_spot_notice_reserves_then_dispatches_on_checkpoint() -> None:
    w, job, d, first, other = running_on_spot()
    fx = w.send(first, SpotNotice(node=d.assignment[0].nodes[0], deadline=w.now + 120))
    assert "preempting" in events(fx) and not sends(fx, Dispatch)
    record = w.m.jobs[job]
    assert record.preempting is not None and record.preempting.replacement is not None
    assert record.preempting.replacement.cluster == other  # reserved at once
    fx = w.send(first, CheckpointReport(job_id=job, attempt=1, step=77, uri="s3://x/77"))
    (cancel,) = sends(fx, Cancel)
    (d2,) = sends(fx, Dispatch)
    assert cancel.attempt == 1 and d2.attempt == 2
    assert d2.resume_from is not None and d2.resume_from.step == 77
    assert [type(e).__name__ for e in fx].index("Persist") < [type(e).__name__ for e in fx].index(
        "Send"
    )
    # The replacement waits for the Cancel of attempt 1, and the checker knows the rule.
    (send,) = [e for e in fx if isinstance(e, Send) and isinstance(e.command, Dispatch)]
    assert send.after_cancel_of == (1,) and unordered_dispatches(w.m, fx) == []
    unordered = [msgspec.structs.replace(send, after_cancel_of=())]
    assert unordered_dispatches(w.m, unordered) == [
        f"dispatch {job}#2 ordered after [], not after the Cancels of attempts [1]"
    ]


def test_an_ending_in_the_answer_to_a_cancel_stops_the_move_it_held() -> None:
    """The job succeeded just before its node's spot notice; the batch that says so has not
    come. The agent's answer to the Cancel of that attempt carries the ending: the job ends
    succeeded and the Cancel of the replacement goes out (the shell's sequencer then drops
    the replacement's Dispatch it held), so the job does not run to completion twice."""
    w, job, d, first, other = running_on_spot()
    w.send(first, SpotNotice(node=d.assignment[0].nodes[0], deadline=w.now + 120))
    fx = w.send(first, CheckpointReport(job_id=job, attempt=1, step=77, uri="s3://x/77"))
    (d2,) = sends(fx, Dispatch)
    assert d2.attempt == 2
    done = WorkloadStatus(job_id=job, attempt=1, phase="succeeded")
    # An ending that is not this Cancel's (another attempt, another cluster) is not taken.
    for cluster, ended in [
        (other, done),
        (first, WorkloadStatus(job_id=job, attempt=2, phase="succeeded")),
    ]:
        fx = w.m.handle(CancelSettled(job, 1, cluster, ended), w.now)
        assert not sends(fx, Cancel) and w.m.jobs[job].state == "admitted"
    fx = w.m.handle(CancelSettled(job, 1, first, done), w.now)
    (cancel,) = sends(fx, Cancel)
    assert (cancel.attempt, cancel.reason) == (2, "an earlier attempt succeeded")
    assert [s.cluster for s in fx if isinstance(s, Send)] == [other]
    assert not sends(fx, Dispatch) and "succeeded" in events(fx)
    assert w.m.jobs[job].state == "succeeded" and violations(w.m) == []
    # The batch that carried the success, when it comes, changes nothing more.
    assert not [e for e in w.send(first, done) if isinstance(e, Send | Publish)]


OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "submit",
                "cycle",
                "ack",
                "run",
                "ckpt",
                "spot",
                "gone",
                "fail",
                "succeed",
                "cancel",
                "stale",
                "tick",
            ]
        ),
        st.integers(0, 5),
        st.integers(0, 3),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_random_sequences_keep_the_invariants(ops: list[tuple[str, int, int]]) -> None:
    w = Sim.empty(start_s=50, checkpoint_grace_s=5)
    for c in ("a", "b"):
        w.cluster(c, count=2, flavor=SPOT if c == "a" else OD)
    jobs: list[str] = []
    dispatched: dict[tuple[str, int], str] = {}
    persisted_then_sent = True
    for op, i, k in ops:
        job = jobs[i % len(jobs)] if jobs else None
        rec = w.m.jobs.get(job) if job else None
        cur = rec.current if rec else None
        fx: list[Effect] = []
        if op == "submit":
            jobs.append(
                w.submit(
                    f"j{len(jobs)}", gpu=[1, 4, 8, 8][k], checkpoint=CheckpointSpec(uri="s3://c")
                )
            )  # type: ignore[arg-type]
        elif op == "cycle":
            fx = w.cycle(1.0)
        elif op == "tick":
            fx = w.cycle(30.0)
        elif cur is not None and job is not None:
            cl = cur.cluster
            n = cur.assignment[0].nodes[0]
            if op == "ack":
                fx = w.m.handle(DispatchAcked(job, cur.attempt, k != 0, "x"), w.now)
            elif op == "run":
                fx = w.send(
                    cl,
                    WorkloadStatus(
                        job_id=job,
                        attempt=cur.attempt,
                        phase="running",
                        running_replicas=1,
                        total_replicas=1,
                    ),
                )
            elif op == "ckpt":
                fx = w.send(
                    cl,
                    CheckpointReport(
                        job_id=job, attempt=cur.attempt, step=10 * (k + 1), uri="s3://c/x"
                    ),
                )
            elif op == "spot":
                fx = w.send(cl, SpotNotice(node=n, deadline=w.now + 10))
            elif op == "gone":
                fx = w.send(cl, NodeGone(node=n))
            elif op == "fail":
                fx = w.send(
                    cl,
                    WorkloadStatus(job_id=job, attempt=cur.attempt, phase="failed", exit_codes=[1]),
                )
            elif op == "succeed":
                fx = w.send(cl, WorkloadStatus(job_id=job, attempt=cur.attempt, phase="succeeded"))
            elif op == "cancel":
                fx = w.m.handle(CancelJob(job, "test"), w.now)
            elif op == "stale":
                fx = w.send(
                    cl, WorkloadStatus(job_id=job, attempt=cur.attempt + 5, phase="running")
                )
                assert any(c.attempt == cur.attempt + 5 for c in sends(fx, Cancel))
        assert violations(w.m) == [], op
        assert unordered_dispatches(w.m, fx) == [], op
        persisted: set[str] = set()
        for e in fx:
            if isinstance(e, Persist):
                persisted.add(e.record.job_id)
            if isinstance(e, Send) and isinstance(e.command, Dispatch):
                key = (e.command.job_id, e.command.attempt)
                assert key not in dispatched, "an attempt was dispatched twice"
                dispatched[key] = e.cluster
                persisted_then_sent &= e.command.job_id in persisted
        for j in jobs:
            r = w.m.jobs[j]
            live = [a for a in r.attempts if a.ended_at is None]
            assert len(live) <= 1, "two live attempts"
            if r.state in ("succeeded", "failed", "cancelled", "queued"):
                assert not live
            if r.state in ("admitted", "running", "preempting"):
                assert len(live) == 1 and live[0].attempt == r.attempt
            nums = [a.attempt for a in r.attempts]
            assert nums == sorted(set(nums))
    assert persisted_then_sent


@pytest.mark.parametrize("restored", [True, False])
def test_backlog_deeper_than_lookahead_drains_without_further_input(restored: bool) -> None:
    """Parked jobs (all of a queue after a restore, or ones tried before any capacity came)
    are reconsidered by their queue's `lookahead` heads; a deeper backlog must still drain
    once capacity appears, with no other input than heartbeats."""
    before = Sim.empty()
    jobs = [before.submit(f"j{i}", gpu=1) for i in range(600)]
    if restored:
        w = Sim.empty()
        w.m.handle(Restore(list(before.m.jobs.values())), w.now)
    else:
        w = before
        assert not sends(w.cycle(), Dispatch)  # no cluster yet: every job is parked
    w.cluster("a", count=100)  # 800 GPUs: room for every job
    dispatched: list[str] = []
    for _ in range(10):
        dispatched += [d.job_id for d in sends(w.cycle(0.01), Dispatch)]
    assert sorted(dispatched) == sorted(jobs)


def test_restored_backlog_waits_for_an_agent_before_its_first_cycle() -> None:
    """A restored backlog wants no cycle until an agent has reported (with no capacity known
    it could admit nothing, and it held a restarted broker's first answer); the first report
    asks for one and it dispatches; a job submitted meanwhile still gets its cycle."""
    before = Sim.empty()
    jobs = [before.submit(f"j{i}", gpu=8) for i in range(3)]
    w = Sim.empty()
    w.m.handle(Restore(list(before.m.jobs.values())), w.now)
    assert not w.m.wants_cycle
    w.cluster("a", count=1)
    assert w.m.wants_cycle
    (d,) = sends(w.m.handle(CYCLE, w.now), Dispatch)
    assert d.job_id == jobs[0]
    fresh = Sim.empty()
    fresh.m.handle(Restore(list(before.m.jobs.values())), fresh.now)
    fresh.submit("late", gpu=8)
    assert fresh.m.wants_cycle


def test_in_place_restarts_are_told_once_and_not_repeated_by_snapshots() -> None:
    w = Sim.empty()
    w.cluster("a")
    job = w.submit()
    w.cycle()
    run(w, job, "a", 1)
    note = "j-1-a1-w-0 restarted 2 times (exit 137 OOMKilled)"
    fx = w.send(
        "a",
        WorkloadStatus(
            job_id=job,
            attempt=1,
            phase="running",
            running_replicas=1,
            total_replicas=1,
            exit_codes=[137],
            reason=note,
        ),
    )
    (event,) = [e.event for e in fx if isinstance(e, Publish)]
    assert (event.kind, event.reason, event.state, event.attempt) == (
        "restarted",
        note,
        "running",
        1,
    )
    assert not [e for e in fx if isinstance(e, (Persist, Send))]  # nothing else changes
    # A resync snapshot carries the same status: no second event, and the job keeps running.
    snap = ClusterSnapshot(
        flavors=[SPOT],
        nodes=[node("a", 0)],
        workloads=[
            WorkloadStatus(
                job_id=job, attempt=1, phase="running", running_replicas=1, total_replicas=1,
                exit_codes=[137], reason=note,
            )
        ],
    )  # fmt: skip
    assert "restarted" not in events(w.send("a", snap))
    view = w.m.views.job_view(job, w.now)
    assert view is not None and view.state == "running"


def test_a_stale_heartbeat_stops_placements_there_and_shows_in_the_view() -> None:
    w = Sim.empty()
    w.cluster("a")
    w.send("a", Heartbeat(at=w.now, stale_s=75.0))
    job = w.submit()
    assert not sends(w.m.handle(CYCLE, w.now), Dispatch)
    (view,) = w.m.views.cluster_views(w.now)
    assert view.health == "healthy" and view.stale_s == 75.0
    w.send("a", Heartbeat(at=w.now))  # the watches recovered
    (dispatch,) = sends(w.m.handle(CYCLE, w.now), Dispatch)
    assert dispatch.job_id == job and w.m.views.cluster_views(w.now)[0].stale_s == 0.0


def test_an_uncordon_withdraws_the_notice_but_the_move_it_started_completes() -> None:
    w = Sim.empty()
    w.cluster("a")
    w.cluster("b")
    job = w.submit(checkpoint=CheckpointSpec(uri="s3://x"), capacity="spot")  # type: ignore[arg-type]
    (d,) = sends(w.cycle(), Dispatch)
    name = d.assignment[0].nodes[0]
    first = name.split("-")[0]
    run(w, job, first, 1)
    # A cordon is a notice: the agent reports it both ways.
    cordoned = msgspec.structs.replace(
        node(first, 0), spot_deadline=w.now + 120, no_new_pods=True, note="cordoned"
    )
    fx = w.send(first, NodeUpsert(node=cordoned), SpotNotice(node=name, deadline=w.now + 120))
    assert "preempting" in events(fx)
    # Uncordoned before the checkpoint: the move carries on.
    w.send(first, NodeUpsert(node=node(first, 0)))
    assert w.m.jobs[job].preempting is not None
    fx = w.send(first, CheckpointReport(job_id=job, attempt=1, step=5, uri="s3://x/5"))
    (cancel,) = sends(fx, Cancel)
    (d2,) = sends(fx, Dispatch)
    assert cancel.attempt == 1 and d2.assignment[0].nodes[0] != name
    # Once attempt 1 has ended, the node takes placements again.
    w.send(
        first,
        WorkloadStatus(
            job_id=job, attempt=1, phase="cancelled", running_replicas=0, total_replicas=1
        ),
    )
    other = w.submit("k")
    (d3,) = sends(w.cycle(), Dispatch)
    assert d3.job_id == other and d3.assignment[0].nodes[0] == name


def submit_due(w: Sim, fallback_after_wait_s: float) -> str:
    """An hour to do 30 minutes of work, checkpointed, spot first."""
    return w.submit(
        "due",
        capacity="spot-then-on-demand",
        checkpoint=CheckpointSpec(uri="s3://b/ck", interval_s=600, cost_s=30),
        spot=SpotPolicy(
            fallback_after_wait_s=fallback_after_wait_s, fallback_after_preemptions=100
        ),
        deadline=Deadline(within_s=3600, runtime_s=1800, total_steps=1800),
    )


def test_a_queued_job_whose_deadline_slack_ran_out_asks_for_on_demand_at_once() -> None:
    """The switch renews the request a parked job keeps between cycles (it asked for spot
    first), and leaves `spot_exhausted` alone: spot was never short, the deadline was."""
    w = Sim.empty()
    w.send(
        "a",
        ClusterSnapshot(flavors=[SPOT, OD], nodes=[node("a", 0, "spot"), node("a", 1, "od")]),
    )
    busy = w.submit("busy", capacity="spot")
    w.cycle()
    run(w, busy, "a", 1)
    # An hour to do 30 minutes of work: 28 minutes of slack, minus a move (2 min).
    job = submit_due(w, fallback_after_wait_s=86_400)
    for _ in range(2):
        assert not sends(w.cycle(600), Dispatch)  # waits for the busy spot node
    (d,) = sends(w.cycle(400), Dispatch)  # 1600 s in: slack down to 80 s
    record = w.m.jobs[job]
    assert (d.job_id, d.flavor) == (job, "od")
    assert record.deadline_on_demand and not record.spot_exhausted


def test_a_job_its_deadline_put_on_on_demand_is_not_later_marked_spot_exhausted() -> None:
    """Still queued after the switch (on-demand is full too): the spot-fallback timer, which
    would run out later, leaves the job alone."""
    w = Sim.empty()
    w.send(
        "a",
        ClusterSnapshot(flavors=[SPOT, OD], nodes=[node("a", 0, "spot"), node("a", 1, "od")]),
    )
    for name, capacity in (("busy-spot", "spot"), ("busy-od", "on-demand")):
        busy = w.submit(name, capacity=capacity)
        w.cycle()
        run(w, busy, "a", 1)
    job = submit_due(w, fallback_after_wait_s=2000)
    record = w.m.jobs[job]
    for _ in range(4):  # 2400 s: past the switch (~1600 s) and the spot timer (2000 s)
        assert not sends(w.cycle(600), Dispatch)
    assert record.state == "queued" and record.deadline_on_demand
    assert not record.spot_exhausted


def test_capacity_change_is_read_from_the_inventory_version() -> None:
    """A parked job is looked at again when the inventory changed (a node joined), and not
    for news that changes nothing there (a node the broker never knew is gone)."""
    w = Sim.empty()
    w.cluster("c1", 1)
    first, parked = w.submit("a"), w.submit("b")
    (d,) = sends(w.cycle(), Dispatch)
    assert d.job_id == first
    w.cycle()
    assert not w.m.wants_cycle
    w.send("c1", NodeGone(node="c1-never-seen"))
    assert not w.m.wants_cycle
    w.send("c1", NodeUpsert(node=node("c1", 1)))
    assert w.m.wants_cycle
    (d,) = sends(w.m.handle(CYCLE, w.now), Dispatch)
    assert (d.job_id, d.assignment[0].nodes) == (parked, ["c1-1"])
