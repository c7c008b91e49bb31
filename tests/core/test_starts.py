"""Starts that can finish (broker/core/starts.py): a resumed attempt gets its restore time on
top of the start timeout, start failures in a row are capped with a typed reason, and the pool
that failed a start is not where the job tries next."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from broker.core.records import AttemptRecord, JobRecord
from broker.core.starts import START_FAILURES, start_limit_s
from schemas.agent import CheckpointRef, CheckpointReport, WorkloadStatus
from schemas.config import Timeouts
from schemas.job import CheckpointSpec, JobSpec, PodSet, RestartPolicy
from tests.core.harness import Sim, cancels


def test_a_resumed_attempt_gets_its_restore_time_on_top_of_the_start_timeout() -> None:
    s = Sim(start_s=300, image_pull_s=30)
    job = s.submit(checkpoint=CheckpointSpec(uri="s3://c", cost_s=240))
    s.step(0)
    s.send(
        "a",
        WorkloadStatus(
            job_id=job, attempt=1, phase="running", running_replicas=1, total_replicas=1
        ),
    )
    s.send("a", CheckpointReport(job_id=job, attempt=1, step=100, uri="s3://c/100"))
    s.send("a", WorkloadStatus(job_id=job, attempt=1, phase="evicted", reason="node drained"))
    s.step(1)
    s.step(1)  # attempt 2 (the lost pool is the only one: widened after a cycle), from step 100
    second = s.m.jobs[job].current
    assert second is not None and second.attempt == 2 and second.resume_from is not None
    # 300 s base + 30 s image pull + 240 s restore: the old fixed 300 s would kill it here,
    # while it reads its checkpoint back, and again on every retry.
    assert not cancels(s.step(301)) and not cancels(s.step(268))
    (cancel,) = cancels(s.step(2.0))
    assert cancel.attempt == 2 and cancel.reason == "start timeout"
    assert "within 570s" in (s.m.jobs[job].reason or "")


def test_a_first_attempt_gets_no_restore_time() -> None:
    s = Sim(start_s=300)
    job = s.submit(checkpoint=CheckpointSpec(uri="s3://c", cost_s=240))
    s.step(0)
    (cancel,) = cancels(s.step(301))
    assert cancel.attempt == 1 and s.m.jobs[job].state == "queued"


def test_the_pool_that_failed_a_start_is_not_tried_next() -> None:
    s = Sim(("a", "b"), start_s=60)
    job = s.submit(restart=RestartPolicy(backoff_s=1))
    s.step(0)
    first = s.m.jobs[job].current
    assert first is not None
    s.step(61)
    s.step(2)
    second = s.m.jobs[job].current
    assert second is not None and second.attempt == 2
    assert second.cluster != first.cluster


def test_start_failures_in_a_row_are_capped_with_a_typed_reason() -> None:
    s = Sim(start_s=60)
    job = s.submit(restart=RestartPolicy(backoff_s=1, max_backoff_s=1, max_start_failures=2))
    s.step(0)
    for _ in range(20):
        s.step(61)
        if s.m.jobs[job].state == "failed":
            break
    rec = s.m.jobs[job]
    assert rec.state == "failed" and rec.attempt == 3, (rec.state, rec.attempt)
    assert (rec.reason or "").startswith(f"{START_FAILURES}: the gang failed to start 3 times")
    assert "restart.max_start_failures=2" in (rec.reason or "")


@given(
    base=st.floats(min_value=1.0, max_value=3600.0),
    pull=st.floats(min_value=0.0, max_value=600.0),
    cost=st.floats(min_value=0.0, max_value=3600.0) | st.none(),
    restore=st.floats(min_value=0.0, max_value=3600.0) | st.none(),
)
def test_a_resumed_attempt_never_gets_less_time_than_a_fresh_one(
    base: float, pull: float, cost: float | None, restore: float | None
) -> None:
    spec = JobSpec(
        name="j",
        gang=[PodSet(name="w", replicas=1, gpu=1)],
        checkpoint=CheckpointSpec(uri="s3://c", cost_s=cost, restore_s=restore),
    )
    record = JobRecord(job_id="j", spec=spec, queue="q", order=1, submitted_at=0.0)
    fresh = AttemptRecord(
        attempt=1, cluster="a", flavor="od", flavor_class="od", assignment=[], dispatched_at=0.0
    )
    resumed = msgspec.structs.replace(fresh, resume_from=CheckpointRef(step=1, uri="s3://c/1"))
    timeouts = Timeouts(start_s=base, image_pull_s=pull)
    assert start_limit_s(record, fresh, timeouts) == base + pull
    expected = restore if restore is not None else (cost or 0.0)
    assert start_limit_s(record, resumed, timeouts) == base + pull + expected


def test_a_short_start_timeout_dispatched_later_still_lapses_on_time() -> None:
    # Ticks skip the scan of starting attempts until the earliest timeout can lapse: a job
    # dispatched after a scan, with a shorter timeout than the others, must move that time up.
    s = Sim(("a", "b"), start_s=300, image_pull_s=0)
    slow = s.submit()
    s.step(0)
    s.step(1)  # a scan: the only starting attempt lapses at 300 s
    quick = s.submit(start_timeout_s=10)
    s.step(1)  # dispatched at 2 s
    assert s.m.jobs[quick].current is not None
    assert not cancels(s.step(9.5))
    (cancel,) = cancels(s.step(1))  # 12.5 s: more than 10 s since its dispatch
    assert cancel.job_id == quick and cancel.reason == "start timeout"
    assert s.m.jobs[slow].current is not None
    # That scan left the slow job starting: its own timeout, at 300 s, is still watched.
    assert not any(c.job_id == slow for c in cancels(s.step(280)))
    assert slow in [c.job_id for c in cancels(s.step(10)) if c.reason == "start timeout"]
