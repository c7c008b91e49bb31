"""An ended job is not forgotten while one of its attempts' Cancels is unacknowledged: its
record is what a restored leader sends that Cancel again from. It is forgotten once the Cancel
settles (acknowledged, or given up on with its cluster lost) and its retention has passed;
until then a resubmission of its id is a duplicate, as for any retained ended job, so no
second copy of the id starts beside one a cut-off cluster may still run."""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.core.effects import Effect, Forget, split_reply
from broker.core.inputs import CancelJob, CancelSettled, Restore, SubmitJob
from broker.core.invariants import unsettled_forgets, violations
from broker.core.machine import Machine
from broker.core.records import JobRecord, record_decoder, record_encoder
from broker.sequencer import Sequencer
from schemas.agent import Dispatch, NodeGone, WorkloadStatus
from schemas.config import Limits
from schemas.job import JobSpec, PodSet
from tests.core.harness import OD, Sim, cancels, run, sends

RETENTION_S = 600.0
SCAN_S = 60.0  # how often the machine looks for ended jobs past their retention


def retaining(clusters: tuple[str, ...] = ("a",), **timeouts: float) -> Sim:
    """A Sim whose machine forgets ended jobs `RETENTION_S` after they end."""
    w = Sim((), **timeouts)
    config = msgspec.structs.replace(w.m.config, limits=Limits(ended_retention_s=RETENTION_S))
    w.m = Machine(config)
    for c in clusters:
        w.cluster(c, 1, OD)
    return w


def forgotten(effects: list[Effect]) -> list[str]:
    return [e.job_id for e in effects if isinstance(e, Forget)]


def resubmit(w: Sim, job_id: str) -> tuple[bool, list[Effect]]:
    """The same id submitted again: whether it was answered as a duplicate, and the effects."""
    spec = JobSpec(name="j", job_id=job_id, gang=[PodSet(name="w", gpu=8)])
    reply, effects = split_reply(w.m.handle(SubmitJob(spec, subject_queue="q"), w.now))
    assert reply.accepted, reply.error
    return reply.duplicate, effects


def cancelled_unheard(w: Sim) -> str:
    """A job running on "a" that the user cancels; the Cancel is sent, not yet heard."""
    job = w.submit(job_id="x")
    w.cycle()
    run(w, job, "a", 1)
    fx = w.m.handle(CancelJob(job, "user"), w.now)
    assert [c.attempt for c in cancels(fx)] == [1]
    record = w.m.jobs[job]
    assert record.state == "cancelled" and record.cancels_unsettled
    return job


def test_an_unheard_cancel_keeps_the_job_past_its_retention_and_its_id_a_duplicate() -> None:
    w = retaining()
    job = cancelled_unheard(w)
    for _ in range(int(3 * RETENTION_S / SCAN_S)):  # three retentions of scans
        fx = w.cycle(SCAN_S)
        assert forgotten(fx) == [] and unsettled_forgets(w.m.jobs, fx) == []
    assert job in w.m.jobs
    duplicate, effects = resubmit(w, job)
    assert duplicate and effects == []
    assert sends(w.cycle(SCAN_S), Dispatch) == []

    # A leader restored now still owes the Cancel: the record kept it.
    stored = [record_decoder.decode(record_encoder.encode(r)) for r in w.m.jobs.values()]
    later = Machine(w.m.config, epoch=2)
    assert [(c.job_id, c.attempt) for c in cancels(later.handle(Restore(stored), w.now))] == [
        (job, 1)
    ]

    w.m.handle(CancelSettled(job, 1), w.now)  # the agent acknowledged it
    assert not w.m.jobs[job].cancels_unsettled
    assert forgotten(w.cycle(SCAN_S)) == [job]
    duplicate, _ = resubmit(w, job)
    assert not duplicate  # the id is free again: a new job


def test_a_settled_cancel_does_not_shorten_the_retention() -> None:
    """The Cancel heard at once: the job is forgotten at its retention, not before."""
    w = retaining()
    job = cancelled_unheard(w)
    ended = w.now
    w.m.handle(CancelSettled(job, 1), w.now)
    seen: list[str] = []
    while not seen:
        fx = w.cycle(SCAN_S)
        seen = forgotten(fx)
        assert unsettled_forgets(w.m.jobs, fx) == []
    assert seen == [job] and ended + RETENTION_S < w.now <= ended + RETENTION_S + 2 * SCAN_S


def test_a_cancel_given_up_with_its_lost_cluster_lets_the_job_go() -> None:
    """Cluster "a" goes silent holding the cancelled attempt: the shell asks again until "a"
    is declared lost, then gives the Cancel up (its fence has ended the copy), and the job is
    forgotten at the next look."""
    w = retaining(("a", "b"), lost_after_s=1800.0, fence_lead_s=600.0)
    job = cancelled_unheard(w)
    seq = Sequencer(w.m.config.timeouts)
    del w.seq["a"]  # no more heartbeats from "a"
    track = w.m.agents["a"]
    while seq.cancel_again(track.health) is not None:
        assert forgotten(w.cycle(SCAN_S)) == []
        assert w.now < 1_800_000_000.0 + 1800.0 + 3 * SCAN_S, "a never declared lost"
    assert job in w.m.jobs and w.now > w.m.jobs[job].finished_at + RETENTION_S  # type: ignore[operator]
    w.m.handle(CancelSettled(job, 1), w.now)  # what the shell feeds when it gives up
    assert forgotten(w.cycle(SCAN_S)) == [job]


def test_the_checker_names_a_record_forgotten_with_its_cancel_unheard() -> None:
    w = retaining()
    job = cancelled_unheard(w)
    assert unsettled_forgets(w.m.jobs, [Forget(job)]) == [
        f"job {job} forgotten with the Cancels of attempts [1] unheard"
    ]
    assert unsettled_forgets({}, [Forget(job)]) == []  # a record already gone


# ------------------------------------------------------------------ property

JOBS = ("j0", "j1", "j2")  # submitted first; the ops submit them again
CLUSTERS = ("a", "b")
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.sampled_from(JOBS)),
        st.tuples(st.just("cancel"), st.sampled_from(JOBS)),
        st.tuples(st.just("run"), st.sampled_from(JOBS)),
        st.tuples(st.just("succeed"), st.sampled_from(JOBS)),
        st.tuples(st.just("settle"), st.sampled_from(JOBS), st.integers(1, 4)),
        st.tuples(st.just("lose"), st.sampled_from(CLUSTERS)),
        st.tuples(st.just("back"), st.sampled_from(CLUSTERS)),
        st.tuples(st.just("wait"), st.sampled_from([1.0, SCAN_S, RETENTION_S, 3 * RETENTION_S])),
    ),
    max_size=40,
)


def _apply(w: Sim, op: tuple[object, ...]) -> list[Effect]:
    kind, arg = op[0], op[1]
    record = w.m.jobs.get(str(arg))
    current = record.current if record is not None else None
    if kind == "submit":
        return resubmit(w, str(arg))[1]
    if kind == "cancel" and record is not None:
        return w.m.handle(CancelJob(record.job_id, "user"), w.now)
    if kind in ("run", "succeed") and record is not None and current is not None:
        if kind == "run":
            run(w, record.job_id, current.cluster, current.attempt)
            return []
        done = WorkloadStatus(job_id=record.job_id, attempt=current.attempt, phase="succeeded")
        return w.send(current.cluster, done)
    if kind == "settle" and record is not None:
        return w.m.handle(CancelSettled(record.job_id, int(str(op[2]))), w.now)
    if kind == "lose":
        return w.send(str(arg), NodeGone(node=f"{arg}-0", reason="deleted"))
    if kind == "back":
        w.cluster(str(arg), 1, OD)
        return []
    if kind == "wait":
        return w.cycle(float(str(arg)))
    return []


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_no_record_marking_an_unheard_cancel_is_ever_forgotten(
    ops: list[tuple[object, ...]],
) -> None:
    w = retaining(CLUSTERS)
    for job_id in JOBS:
        resubmit(w, job_id)
    w.cycle(0.0)  # two of them dispatched, one waiting
    for op in ops:
        before: dict[str, JobRecord] = dict(w.m.jobs)
        fx = _apply(w, op) + w.cycle(0.0)
        assert unsettled_forgets(before, fx) == []
        for job_id in forgotten(fx):
            ended = before[job_id].finished_at
            assert ended is not None and ended + RETENTION_S < w.now
            assert job_id not in w.m.jobs
        assert violations(w.m) == []
