"""A Dispatch waits for the Cancel of every earlier attempt that may still run, and a restart
does not forget them: the job record marks a Cancel no agent acknowledged
(`AttemptRecord.cancel_unacked`), the core names every such attempt in `Send.after_cancel_of`,
a new leader sends them again first, and the sequencer holds the Dispatch until all settle."""

from __future__ import annotations

from broker.core.effects import Effect, Persist, Send
from broker.core.inputs import CancelSettled, Restore
from broker.core.invariants import unordered_dispatches
from broker.core.records import JobRecord, record_decoder, record_encoder
from broker.sequencer import Sequencer
from schemas.agent import Dispatch, NodeGone, WorkloadStatus
from tests.core.harness import Sim, cancels, run

TIMEOUTS = {"start_s": 30.0, "dispatch_report_s": 0.0}


def dispatch_send(effects: list[Effect]) -> Send:
    (send,) = [e for e in effects if isinstance(e, Send) and isinstance(e.command, Dispatch)]
    return send


def attempt_record(w: Sim, job: str, attempt: int) -> bool:
    """Whether the record marks the Cancel of `attempt` as unacknowledged."""
    (a,) = [a for a in w.m.jobs[job].attempts if a.attempt == attempt]
    return a.cancel_unacked


def lost_on(w: Sim, job: str, cluster: str) -> list[Effect]:
    """The node of the job's first attempt goes: the attempt is ended, its Cancel sent."""
    fx = w.send(cluster, NodeGone(node=f"{cluster}-0", reason="deleted"))
    assert [c.attempt for c in cancels(fx)] == [1]
    return fx


def test_the_third_dispatch_waits_for_the_first_cancel_across_a_restart() -> None:
    """Attempt 1's Cancel is unheard when the broker restarts; the new leader sends it again,
    holds attempt 2 behind it, gives attempt 2 up at its start timeout (its Cancel heard at
    once), and attempt 3 still waits for attempt 1's Cancel, not only for attempt 2's."""
    old = Sim(("a",), **TIMEOUTS)
    job = old.submit()
    old.cycle()
    run(old, job, "a", 1)
    lost_on(old, job, "a")
    assert attempt_record(old, job, 1)
    # What the old leader persisted, through the store's codec.
    stored = [record_decoder.decode(record_encoder.encode(r)) for r in old.m.jobs.values()]

    w = Sim((), epoch=2, **TIMEOUTS)
    w.now = old.now + 1.0
    seq = Sequencer(w.m.config.timeouts)
    restored = w.m.handle(Restore(stored), w.now)
    (again,) = cancels(restored)
    assert (again.job_id, again.attempt, again.epoch) == (job, 1, 2)
    first = seq.cancel(again)  # "a" stays cut off: this Cancel goes unheard
    # The new leader tracks "a" though it has not spoken: the shell asks again until "a" is
    # heard or declared lost, rather than giving up on a cluster it does not know.
    track = w.m.agents.get("a")
    assert track is not None and seq.cancel_again(track.health) is not None
    w.cluster("b")
    w.cluster("c")
    two = dispatch_send(w.cycle())
    assert two.command.attempt == 2 and two.after_cancel_of == (1,)
    assert not seq.dispatch(two.cluster, two.command, two.after_cancel_of)

    fx = w.cycle(31.0)  # attempt 2 never started: its start timeout gives it up
    (cancel_two,) = cancels(fx)
    assert cancel_two.attempt == 2 and attempt_record(w, job, 2)
    ticket = seq.cancel(cancel_two)
    assert seq.held() == []  # attempt 2's Dispatch, given up while held, never leaves
    assert seq.settled(cancel_two, ticket) == []  # heard at once
    assert w.m.handle(CancelSettled(job, 2), w.now) == [Persist(w.m.jobs[job])]
    assert not attempt_record(w, job, 2) and attempt_record(w, job, 1)

    fx = w.cycle(10.0)  # past the start failure's backoff
    three = dispatch_send(fx)
    assert three.command.attempt == 3 and three.cluster != two.cluster
    assert three.after_cancel_of == (1, 2) and unordered_dispatches(w.m, fx) == []
    assert not seq.dispatch(three.cluster, three.command, three.after_cancel_of)
    # The old order (after the attempt just before only) is what the checker now refuses.
    assert unordered_dispatches(w.m, [Send(three.cluster, three.command, (2,))]) == [
        f"dispatch {job}#3 ordered after [2], not after the Cancels of attempts [1]"
    ]

    # Attempt 1's cluster is heard again and takes the Cancel: attempt 3 leaves, and the
    # record forgets the Cancel.
    released = seq.settled(again, first)
    assert [(h.cluster, h.command.attempt) for h in released] == [(three.cluster, 3)]
    w.m.handle(CancelSettled(job, 1), w.now)
    assert not attempt_record(w, job, 1)


def test_a_record_written_before_the_mark_decodes_and_restores_as_before() -> None:
    """A record of a broker that did not mark unacknowledged Cancels decodes with none; the
    new leader still sends the Cancel of the attempt an unacknowledged dispatch replaced."""
    old = Sim(("a", "b"), **TIMEOUTS)
    job = old.submit()
    old.cycle()
    run(old, job, "a", 1)
    fx = lost_on(old, job, "a")
    fx += old.cycle()
    assert dispatch_send(fx).command.attempt == 2
    record = old.m.jobs[job]
    for a in record.attempts:
        a.cancel_unacked = False  # what the older broker wrote: no such field
    data = record_encoder.encode(record)
    assert b"cancel_unacked" not in data
    stored: JobRecord = record_decoder.decode(data)
    assert not any(a.cancel_unacked for a in stored.attempts)

    w = Sim((), epoch=2, **TIMEOUTS)
    fx = w.m.handle(Restore([stored]), old.now)
    assert [c.attempt for c in cancels(fx)] == [1]
    assert dispatch_send(fx).after_cancel_of == (1,) and attempt_record(w, job, 1)


def test_an_attempt_that_reports_its_end_no_longer_holds_dispatches() -> None:
    """An ended attempt's own terminal status settles its Cancel; a copy the broker gave up
    that reports running again is cancelled and marked anew."""
    w = Sim(("a", "b"), **TIMEOUTS)
    job = w.submit()
    w.cycle()
    run(w, job, "a", 1)
    lost_on(w, job, "a")
    running = WorkloadStatus(job_id=job, attempt=1, phase="running", running_replicas=1)
    w.m.handle(CancelSettled(job, 1), w.now)
    assert not attempt_record(w, job, 1)
    fx = w.send("a", running)
    assert [(c.attempt, c.reason) for c in cancels(fx)] == [
        (1, "stale attempt: not the job's live attempt")
    ]
    assert attempt_record(w, job, 1) and any(isinstance(e, Persist) for e in fx)
    fx = w.send("a", WorkloadStatus(job_id=job, attempt=1, phase="failed"))
    assert not attempt_record(w, job, 1) and not cancels(fx)


def test_a_cancel_settled_twice_or_of_an_unknown_job_changes_nothing() -> None:
    w = Sim(("a",), **TIMEOUTS)
    assert w.m.handle(CancelSettled("nobody", 1), w.now) == []
    job = w.submit()
    w.cycle()
    assert w.m.handle(CancelSettled(job, 1), w.now) == []  # never cancelled
    assert w.m.handle(CancelSettled(job, 7), w.now) == []
