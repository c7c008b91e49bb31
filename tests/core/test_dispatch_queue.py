"""A Dispatch names the queue the job is in, however the job named it (not at all, when sent to
a queue's subject, or by an alias): agents place a team's workloads by it."""

from __future__ import annotations

from broker.core.effects import Send, split_reply
from broker.core.inputs import SubmitJob
from schemas.agent import Dispatch
from schemas.job import JobSpec, PodSet
from tests.core.harness import Sim


def dispatched(sim: Sim) -> list[Dispatch]:
    return [
        e.command for e in sim.step(1.0) if isinstance(e, Send) and isinstance(e.command, Dispatch)
    ]


def test_a_job_sent_to_its_queues_subject_is_dispatched_naming_the_queue() -> None:
    sim = Sim()
    sim.submit()  # no `queue` in the spec: the subject's queue takes it
    (cmd,) = dispatched(sim)
    assert cmd.spec.queue == "q"


def test_an_alias_is_dispatched_as_the_queue_it_stands_for() -> None:
    sim = Sim(aliases={"team-a": "q"})
    spec = JobSpec(name="j", queue="team-a", gang=[PodSet(name="w", gpu=8)])
    reply, _ = split_reply(sim.m.handle(SubmitJob(spec), sim.now))
    assert reply.accepted, reply.error
    (cmd,) = dispatched(sim)
    assert cmd.spec.queue == "q"
