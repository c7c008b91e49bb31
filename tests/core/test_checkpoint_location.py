"""A checkpoint report is recorded only when its URI is under the job's checkpoint location,
so one job cannot make another resume from a checkpoint it forged."""

from __future__ import annotations

from broker.core.effects import Publish
from broker.core.lifecycle import uri_under
from schemas.agent import CheckpointReport
from schemas.job import CheckpointSpec
from tests.core.harness import Sim, events, run


def test_uri_under_respects_path_segments() -> None:
    assert uri_under("s3://ckpt/job-1/step-5", "s3://ckpt/job-1")
    assert uri_under("s3://ckpt/job-1/step-5", "s3://ckpt/job-1/")
    assert uri_under("s3://ckpt/job-1", "s3://ckpt/job-1")
    assert not uri_under("s3://ckpt/job-10/step-5", "s3://ckpt/job-1")
    assert not uri_under("s3://other/job-1/step-5", "s3://ckpt/job-1")


def test_a_checkpoint_outside_the_location_is_refused_with_a_reason() -> None:
    w = Sim.empty()
    w.cluster("a")
    job = w.submit(checkpoint=CheckpointSpec(uri="s3://ckpt/mine"))  # type: ignore[arg-type]
    w.cycle()
    run(w, job, "a", 1)
    forged = CheckpointReport(job_id=job, attempt=1, step=99, uri="s3://ckpt/mine-too/99")
    fx = w.send("a", forged)
    assert events(fx) == ["checkpoint-refused"]
    (refused,) = [e.event for e in fx if isinstance(e, Publish)]
    assert refused.reason and "s3://ckpt/mine" in refused.reason and refused.step == 99
    assert w.m.jobs[job].latest_checkpoint is None
    fx = w.send("a", CheckpointReport(job_id=job, attempt=1, step=10, uri="s3://ckpt/mine/10"))
    assert events(fx) == ["checkpointed"]
    latest = w.m.jobs[job].latest_checkpoint
    assert latest is not None and latest.step == 10
