"""Which record writes the core defers (`Persist(deferred=True)`): the attempt found running,
nothing else; and a leader that died before writing it leaves records the next one handles:
the attempt's start timeout held until its cluster's snapshot says it runs, never a second
copy or a healthy attempt cancelled (and, with the ack lost too, as after a crash before it
was written, the dispatch sent again as the same attempt)."""

from __future__ import annotations

from broker.core.effects import Effect, Persist, Send
from broker.core.inputs import TICK, DispatchAcked, Restore
from broker.core.records import JobRecord, record_decoder, record_encoder
from schemas.agent import ClusterSnapshot, Dispatch, WorkloadStatus
from tests.core.harness import OD, Sim, cancels, events, node, sends

TIMEOUTS = {"start_s": 30.0, "dispatch_report_s": 0.0}


def persists(effects: list[Effect]) -> list[Persist]:
    return [e for e in effects if isinstance(e, Persist)]


def running(job_id: str, attempt: int) -> WorkloadStatus:
    return WorkloadStatus(
        job_id=job_id, attempt=attempt, phase="running", running_replicas=1, total_replicas=1
    )


def as_stored(record: JobRecord) -> JobRecord:
    """The record through the store's codec, as a new leader reads it back."""
    return record_decoder.decode(record_encoder.encode(record))


def test_only_the_ack_and_the_running_report_are_deferred() -> None:
    w = Sim(("a",), **TIMEOUTS)
    job = w.submit()
    dispatched = w.cycle()
    assert [p.deferred for p in persists(dispatched)] == [False]  # persist, then send
    acked = w.m.handle(DispatchAcked(job, 1, True, ""), w.now)
    assert [p.deferred for p in persists(acked)] == [False]  # a restore without it resends
    ran = w.send("a", running(job, 1))
    assert [p.deferred for p in persists(ran)] == [True]
    ended = w.send("a", WorkloadStatus(job_id=job, attempt=1, phase="succeeded"))
    assert [p.deferred for p in persists(ended)] == [False]


def restarted(late_s: float, *, ack_written: bool) -> tuple[Sim, str, list[Effect]]:
    """The attempt ran, then the leader died with its running write (and, unless
    `ack_written`, its ack's) unwritten. The next leader restores `late_s` after it."""
    old = Sim(("a",), **TIMEOUTS)
    job = old.submit()
    old.cycle()
    stored = as_stored(old.m.jobs[job])  # the dispatch's write, urgent
    old.m.handle(DispatchAcked(job, 1, True, ""), old.now)
    if ack_written:
        stored = as_stored(old.m.jobs[job])
    old.send("a", running(job, 1))
    assert old.m.jobs[job].state == "running"

    w = Sim((), epoch=2, **TIMEOUTS)
    w.now = old.now + late_s
    restored = w.m.handle(Restore([stored]), w.now)
    return w, job, restored


def test_a_lost_ack_sends_the_same_attempt_again() -> None:
    _, job, restored = restarted(1.0, ack_written=False)
    (again,) = sends(restored, Dispatch)
    assert (again.job_id, again.attempt, again.epoch) == (job, 1, 2)
    assert cancels(restored) == []


def test_a_lost_running_write_kills_nothing_before_the_snapshot() -> None:
    """Restored past the attempt's start timeout (30 s): it may run, so the timeout waits
    for its cluster's snapshot, which says it runs; the job is running again, one attempt."""
    w, job, restored = restarted(45.0, ack_written=True)
    assert restored == []  # acknowledged: nothing to send again
    for dt in (1.0, 5.0, 30.0):  # ticks before the agent's snapshot
        w.now += dt
        fx = w.m.handle(TICK, w.now)
        assert cancels(fx) == [] and [e for e in fx if isinstance(e, Send)] == []
    assert w.m.jobs[job].state == "admitted"
    snap = ClusterSnapshot(flavors=[OD], nodes=[node("a", 0, OD.name)], workloads=[running(job, 1)])
    fx = w.send("a", snap)
    record = w.m.jobs[job]
    assert record.state == "running" and [a.attempt for a in record.attempts] == [1]
    assert record.attempts[0].live and cancels(fx) == [] and "running" in events(fx)
    assert w.m.lifecycle.live_on("a") == {job}


def test_a_restored_attempt_that_never_ran_still_times_out_after_the_snapshot() -> None:
    """The snapshot does not list it running (created only): its start timeout applies."""
    w, job, _ = restarted(45.0, ack_written=True)
    created = WorkloadStatus(job_id=job, attempt=1, phase="created")
    w.send("a", ClusterSnapshot(flavors=[OD], nodes=[node("a", 0, OD.name)], workloads=[created]))
    w.now += 1.0
    fx = w.m.handle(TICK, w.now)
    assert [c.attempt for c in cancels(fx)] == [1]
    assert not w.m.jobs[job].attempts[0].live
