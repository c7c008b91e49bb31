"""The job state table: terminal states, reachability, `move` keeping to the table, causes
persisted as their old strings, and the invariant check that reads records against it."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.core.effects import Send
from broker.core.inputs import CancelJob
from broker.core.invariants import table_problems, violations
from broker.core.records import AttemptRecord, JobRecord, Preempting, record_encoder
from broker.core.states import (
    INITIAL,
    STATES,
    TERMINAL,
    TRANSITIONS,
    BadTransition,
    Cause,
    Event,
    end_event,
    move,
    table_markdown,
)
from schemas.agent import Dispatch, SpotNotice, WorkloadStatus
from schemas.api import TERMINAL_STATES
from schemas.job import CheckpointSpec, JobSpec, PodSet
from tests.core.harness import Sim


def _record(**fields: object) -> JobRecord:
    spec = JobSpec(name="j", gang=[PodSet(name="w", replicas=1, gpu=1)])
    record = JobRecord(job_id="j", spec=spec, queue="q", order=1, submitted_at=0.0)
    return msgspec.structs.replace(record, **fields)


def _attempt(n: int, *, running_at: float | None = None) -> AttemptRecord:
    return AttemptRecord(
        attempt=n,
        cluster="a",
        flavor="od",
        flavor_class="od",
        assignment=[],
        dispatched_at=0.0,
        running_at=running_at,
    )


def test_the_terminal_states_are_the_wires_and_lead_nowhere() -> None:
    assert TERMINAL == TERMINAL_STATES
    assert [key for key in TRANSITIONS if key[0] in TERMINAL] == []
    assert {end_event(s) for s in TERMINAL} == {Event.SUCCEED, Event.FAIL, Event.CANCEL}
    with pytest.raises(BadTransition, match="not a terminal state"):
        end_event("running")


def test_every_state_is_reachable_from_a_submitted_job() -> None:
    seen = {INITIAL}
    frontier = [INITIAL]
    while frontier:
        state = frontier.pop()
        for (src, _), to in TRANSITIONS.items():
            if src == state and to not in seen:
                seen.add(to)
                frontier.append(to)
    assert seen == STATES


@given(st.lists(st.sampled_from(list(Event)), max_size=30))
def test_a_record_moves_only_as_the_table_says(events: list[Event]) -> None:
    record = _record()
    for event in events:
        before = record.state
        want = TRANSITIONS.get((before, event))
        if want is None:
            with pytest.raises(BadTransition, match=f"from {before!r} on {event}"):
                move(record, event)
            assert record.state == before
        else:
            assert move(record, event) == want
            assert record.state == want
            assert before not in TERMINAL  # nothing leaves an ended job


def test_causes_persist_as_their_old_strings() -> None:
    assert {c.value for c in Cause} == {"spot-notice", "spot-return", "deadline", "spot-yield"}
    for cause in Cause:
        old = _record(
            state="preempting",
            preempting=Preempting(cause=cause.value, deadline=1.0, started_at=0.0),
        )
        new = msgspec.structs.replace(
            old, preempting=Preempting(cause=cause, deadline=1.0, started_at=0.0)
        )
        assert record_encoder.encode(new) == record_encoder.encode(old)


def test_the_invariants_read_records_against_the_table() -> None:
    assert table_problems(_record()) == []
    assert table_problems(_record(state="running", attempt=1, attempts=[_attempt(1)])) == [
        "state running but the live attempt never ran"
    ]
    ran = _attempt(1, running_at=1.0)
    assert table_problems(_record(state="running", attempt=1, attempts=[ran])) == []
    assert table_problems(_record(state="admitted", attempt=2, attempts=[_attempt(1)])) == [
        "state admitted but attempt 2 is not the newest (1)"
    ]
    assert table_problems(_record(state="failed")) == ["state failed with finished_at=None"]
    assert table_problems(_record(finished_at=5.0)) == ["state queued with finished_at=5.0"]
    assert table_problems(_record(state="failed", finished_at=5.0)) == []


def test_the_architecture_doc_shows_the_table_as_it_is() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    shown = text.split("<!-- state-table -->\n")[1].split("\n<!-- /state-table -->")[0]
    assert shown == table_markdown()


def test_a_preemption_lives_in_the_record_and_the_index_follows_it() -> None:
    """A job cancelled while it is being preempted leaves no preemption behind anywhere."""
    sim = Sim(clusters=("a", "b"))
    job = sim.submit(checkpoint=CheckpointSpec(uri="s3://x"))
    fx = sim.step(1.0)
    (d,) = [e.command for e in fx if isinstance(e, Send) and isinstance(e.command, Dispatch)]
    cluster = d.assignment[0].nodes[0].partition("-")[0]
    running = WorkloadStatus(
        job_id=job, attempt=1, phase="running", running_replicas=1, total_replicas=1
    )
    sim.send(cluster, running)
    sim.send(cluster, SpotNotice(node=d.assignment[0].nodes[0], deadline=sim.now + 120))
    record = sim.m.jobs[job]
    assert record.state == "preempting" and record.preempting is not None
    assert set(sim.m.lifecycle.preempting_jobs()) == {job}
    rep = record.preempting.replacement
    assert rep is not None and rep.cluster != cluster  # reserved elsewhere at once
    (res,) = sim.m.scheduler.reservations().values()
    assert (res.replaced, res.replacement) == (1, rep.attempt)
    assert violations(sim.m) == []
    # A record that forgot its replacement while the scheduler still reserves it is caught.
    record.preempting.replacement = None
    assert [v for v in violations(sim.m) if "scheduler reserves" in v] == [
        f"job {job}: scheduler reserves attempt {rep.attempt} for 1; the record names None for 1"
    ]
    record.preempting.replacement = rep
    sim.m.handle(CancelJob(job, "not needed"), sim.now)
    assert record.state == "cancelled" and record.preempting is None
    assert set(sim.m.lifecycle.preempting_jobs()) == set()
    assert violations(sim.m) == []
