"""Every attempt checkpoints under its own prefix: the Dispatch names it, a resume names the
attempt and step it resumes from, and no attempt's report is accepted under another's."""

from __future__ import annotations

from broker.core.inputs import TICK
from schemas.agent import CheckpointReport, Dispatch, WorkloadStatus
from schemas.job import CheckpointSpec
from tests.core.harness import Sim, events, run, running_on_a, sends

LOCATION = "s3://ckpt/team-a/job1"


def test_each_attempt_writes_below_its_own_prefix_and_resumes_by_attempt_and_step() -> None:
    w = Sim.empty()
    w.cluster("a")
    w.cluster("b")
    job = w.submit(checkpoint=CheckpointSpec(uri=LOCATION + "/"))  # type: ignore[arg-type]
    (first,) = sends(w.cycle(), Dispatch)
    assert first.checkpoint_uri == f"{LOCATION}/attempt-1" and first.resume_from is None
    c = w.m.jobs[job].current.cluster  # type: ignore[union-attr]
    run(w, job, c, 1)
    uri = f"{LOCATION}/attempt-1/step-40"
    assert events(w.send(c, CheckpointReport(job_id=job, attempt=1, step=40, uri=uri))) == [
        "checkpointed"
    ]
    w.send(
        c,
        WorkloadStatus(job_id=job, attempt=1, phase="evicted", reason="node drained"),
    )
    (second,) = sends(w.cycle(), Dispatch)
    assert second.attempt == 2 and second.checkpoint_uri == f"{LOCATION}/attempt-2"
    assert second.resume_from is not None
    assert (second.resume_from.attempt, second.resume_from.step) == (1, 40)
    assert second.resume_from.uri == uri


def test_a_report_under_another_attempts_prefix_is_refused() -> None:
    w, job = running_on_a(LOCATION)
    for uri in (f"{LOCATION}/attempt-2/step-9", f"{LOCATION}//attempt-7/x/step-9"):
        fx = w.send("a", CheckpointReport(job_id=job, attempt=1, step=9, uri=uri))
        assert events(fx) == ["checkpoint-refused"], uri
    assert w.m.jobs[job].latest_checkpoint is None
    w.m.handle(TICK, w.now)
    fx = w.send(
        "a", CheckpointReport(job_id=job, attempt=1, step=9, uri=f"{LOCATION}/attempt-1/s9")
    )
    assert events(fx) == ["checkpointed"]
