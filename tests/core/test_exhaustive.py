"""Exhaustiveness in the core: every input and every agent event has a branch (mypy proves it
through `assert_never`), and an agent event the broker cannot read refuses its batch loudly
instead of being dropped while the rest of the batch is applied."""

from __future__ import annotations

import msgspec
import pytest

from broker.core.effects import BatchApplied, refusal
from schemas.agent import Heartbeat, WorkloadStatus
from tests.core.harness import Sim


class FutureEvent(msgspec.Struct):
    """An event a newer agent might send that this broker does not know."""

    node: str


def _running(job_id: str) -> WorkloadStatus:
    return WorkloadStatus(
        job_id=job_id, attempt=1, phase="running", running_replicas=1, total_replicas=1
    )


def test_an_unknown_agent_event_refuses_its_batch_and_applies_none_of_it() -> None:
    s = Sim()
    job_id = s.submit()
    s.step(0)
    assert s.m.jobs[job_id].state == "admitted"
    out = s.m.handle(s.batch("a", _running(job_id), FutureEvent(node="a-0")), s.now)
    error = refusal(out)
    assert error is not None and "FutureEvent" in error and "Upgrade the broker" in error
    assert not any(isinstance(e, BatchApplied) for e in out)
    assert s.m.jobs[job_id].state == "admitted"  # the running report beside it was not applied
    # The batch's sequence was not taken: the agent's next batch with it is applied in full.
    s.seq["a"] -= 1
    out = s.m.handle(s.batch("a", _running(job_id), Heartbeat(at=s.now)), s.now)
    assert refusal(out) is None and any(isinstance(e, BatchApplied) for e in out)
    assert s.m.jobs[job_id].state == "running"


def test_an_input_the_machine_does_not_know_is_an_error_not_a_no_op() -> None:
    s = Sim()
    with pytest.raises((AssertionError, TypeError), match="FutureEvent"):
        s.m.handle(FutureEvent(node="a-0"), s.now)  # type: ignore[arg-type]
