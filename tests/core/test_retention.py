"""Ended jobs are forgotten once `limits.ended_retention_s` has passed since they ended: their
records are deleted (a `Forget` effect) and their ids may be submitted again. Unfinished jobs
are never forgotten, and with no retention nothing is."""

from __future__ import annotations

from broker.core.effects import Forget, split_reply
from broker.core.inputs import TICK, CancelJob, SubmitJob
from broker.core.machine import Machine
from schemas.config import BrokerConfig, Limits, QueueConfig
from schemas.job import JobSpec, PodSet

T0 = 1_800_000_000.0


def machine(retention_s: float) -> Machine:
    return Machine(
        BrokerConfig(queues=[QueueConfig(name="q")], limits=Limits(ended_retention_s=retention_s))
    )


def submit(m: Machine, job_id: str, now: float) -> bool:
    spec = JobSpec(name="j", job_id=job_id, gang=[PodSet(name="w", gpu=1)])
    reply, _ = split_reply(m.handle(SubmitJob(spec, subject_queue="q"), now))
    assert reply.accepted, reply.error
    return reply.duplicate


def forgotten(m: Machine, now: float) -> list[str]:
    return [e.job_id for e in m.handle(TICK, now) if isinstance(e, Forget)]


def test_an_ended_job_is_forgotten_after_its_retention_and_its_id_is_free_again() -> None:
    m = machine(retention_s=3600.0)
    submit(m, "done", T0)
    submit(m, "waiting", T0)
    assert m.handle(CancelJob("done", "test"), T0 + 10)
    assert forgotten(m, T0 + 20) == []
    assert submit(m, "done", T0 + 30)  # within the retention: a duplicate, not run again
    assert forgotten(m, T0 + 3600 + 5) == []  # not yet an hour since it ended
    assert forgotten(m, T0 + 3600 + 11 + 60) == ["done"]
    assert "done" not in m.jobs and "waiting" in m.jobs
    assert not submit(m, "done", T0 + 3700)  # a new job now


def test_without_retention_nothing_is_forgotten() -> None:
    m = machine(retention_s=0.0)
    submit(m, "done", T0)
    m.handle(CancelJob("done", "test"), T0)
    assert forgotten(m, T0 + 10 * 365 * 86_400) == []
    assert "done" in m.jobs
