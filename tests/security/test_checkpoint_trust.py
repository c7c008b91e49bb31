"""A checkpoint decides where a job resumes, so a forged one makes a job skip its work. The
broker refuses one from another cluster's agent, one that goes backwards, and one beyond the
pace the job declared, each with a `checkpoint-refused` event and nothing recorded."""

from __future__ import annotations

from broker.core.effects import Publish
from broker.core.inputs import Checkpoint
from schemas.agent import CheckpointReport
from schemas.job import CheckpointSpec
from tests.core.harness import Sim, events, run

LOCATION = "s3://ckpt/job"


def _running(pace: float | None = None) -> tuple[Sim, str, str]:
    w = Sim.empty()
    w.cluster("east")
    w.cluster("west")
    ckpt = CheckpointSpec(uri=LOCATION, max_steps_per_s=pace)
    job = w.submit(checkpoint=ckpt)
    w.cycle()
    cluster = w.m.jobs[job].current.cluster  # type: ignore[union-attr]
    run(w, job, cluster, 1)
    return w, job, cluster


def _report(job: str, step: int, attempt: int = 1) -> CheckpointReport:
    return CheckpointReport(job_id=job, attempt=attempt, step=step, uri=f"{LOCATION}/{step}")


def _refusal(fx: list[object]) -> str:
    (refused,) = [e.event for e in fx if isinstance(e, Publish)]
    assert refused.kind == "checkpoint-refused" and refused.reason
    return refused.reason


def test_an_agent_cannot_report_a_checkpoint_for_another_clusters_attempt() -> None:
    w, job, home = _running()
    other = "west" if home == "east" else "east"
    fx = w.send(other, _report(job, 10**9))
    assert other in _refusal(fx) and home in _refusal(fx)
    assert w.m.jobs[job].latest_checkpoint is None
    assert events(w.send(home, _report(job, 10))) == ["checkpointed"]


def test_a_checkpoint_may_not_go_backwards() -> None:
    w, job, _ = _running()
    assert events(w.m.handle(Checkpoint(_report(job, 50)), w.now)) == ["checkpointed"]
    fx = w.m.handle(Checkpoint(_report(job, 20)), w.now)
    assert "behind the latest checkpoint (step 50)" in _refusal(fx)
    latest = w.m.jobs[job].latest_checkpoint
    assert latest is not None and latest.step == 50
    assert events(w.m.handle(Checkpoint(_report(job, 50)), w.now)) == []  # a resend is harmless


def test_a_step_beyond_the_declared_pace_is_refused() -> None:
    w, job, _ = _running(pace=2.0)
    w.now += 10  # at most 20 steps since the attempt started running
    fx = w.m.handle(Checkpoint(_report(job, 10**9)), w.now)
    assert "checkpoint.max_steps_per_s" in _refusal(fx)
    assert w.m.jobs[job].latest_checkpoint is None
    assert events(w.m.handle(Checkpoint(_report(job, 20)), w.now)) == ["checkpointed"]
    assert "beyond what attempt 1 could reach" in _refusal(
        w.m.handle(Checkpoint(_report(job, 21)), w.now)
    )
