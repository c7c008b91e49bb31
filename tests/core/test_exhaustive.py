"""Exhaustiveness in the core: every input and every agent event has a branch (mypy proves it
through `assert_never`), and an agent event the broker cannot read refuses its batch loudly
instead of being dropped while the rest of the batch is applied."""

from __future__ import annotations

import msgspec
import pytest

from broker.core.effects import BatchApplied, Effect, refusal, split_reply
from broker.core.inputs import CYCLE, AgentBatch, DispatchAcked, SubmitJob
from broker.core.machine import Machine
from schemas.agent import (
    ClusterSnapshot,
    EventBatch,
    FlavorInfo,
    Heartbeat,
    NodeInfo,
    WorkloadStatus,
)
from schemas.config import BrokerConfig, QueueConfig
from schemas.job import JobSpec, PodSet

T0 = 1_800_000_000.0
FLAVOR = FlavorInfo(name="od", capacity_type="on-demand", gpu_type="A100", price_per_gpu_hour=3.0)


class FutureEvent(msgspec.Struct):
    """An event a newer agent might send that this broker does not know."""

    node: str


def _batch(seq: int, *events: object) -> AgentBatch:
    batch = EventBatch(cluster="a", instance="a-1", seq=seq, events=list(events))  # type: ignore[arg-type]
    return AgentBatch("a", batch)


def _dispatched() -> tuple[Machine, str]:
    m = Machine(BrokerConfig(queues=[QueueConfig(name="q")]), epoch=1)
    node = NodeInfo(name="a-0", flavor="od", gpu=8, cpu_milli=64_000, memory=2**40)
    assert refusal(m.handle(_batch(1, ClusterSnapshot(flavors=[FLAVOR], nodes=[node])), T0)) is None
    spec = JobSpec(name="j", gang=[PodSet(name="w", replicas=1, gpu=8)])
    reply, _ = split_reply(m.handle(SubmitJob(spec, subject_queue="q"), T0))
    assert reply.job_id is not None
    m.handle(CYCLE, T0)
    m.handle(DispatchAcked(reply.job_id, 1, True, ""), T0)
    return m, reply.job_id


def _running(job_id: str) -> WorkloadStatus:
    return WorkloadStatus(
        job_id=job_id, attempt=1, phase="running", running_replicas=1, total_replicas=1
    )


def test_an_unknown_agent_event_refuses_its_batch_and_applies_none_of_it() -> None:
    m, job_id = _dispatched()
    out: list[Effect] = m.handle(_batch(2, _running(job_id), FutureEvent(node="a-0")), T0 + 1)
    error = refusal(out)
    assert error is not None and "FutureEvent" in error and "Upgrade the broker" in error
    assert not any(isinstance(e, BatchApplied) for e in out)
    assert m.jobs[job_id].state == "admitted"  # the running report beside it was not applied
    # The batch's sequence was not taken: the agent's next batch with it is applied in full.
    out = m.handle(_batch(2, _running(job_id), Heartbeat(at=T0 + 2)), T0 + 2)
    assert refusal(out) is None and any(isinstance(e, BatchApplied) for e in out)
    assert m.jobs[job_id].state == "running"


def test_an_input_the_machine_does_not_know_is_an_error_not_a_no_op() -> None:
    m, _ = _dispatched()
    with pytest.raises((AssertionError, TypeError), match="FutureEvent"):
        m.handle(FutureEvent(node="a-0"), T0)  # type: ignore[arg-type]
