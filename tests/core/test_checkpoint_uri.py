"""Checkpoint locations are compared as paths, not string prefixes: a report whose URI climbs
out of the job's location with `..` (plain or percent-encoded), or reaches it through another
scheme or bucket, is refused, however it is spelled."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.core.effects import Publish
from broker.core.lifecycle import uri_under
from schemas.agent import CheckpointReport
from tests.core.harness import Sim, events, run, running_on_a

LOCATION = "s3://ckpt/team-a/job1"


@pytest.mark.parametrize(
    "uri",
    [
        "s3://ckpt/team-a/job1/../../team-b/victim/step-45",
        "s3://ckpt/team-a/job1/%2e%2e/%2e%2e/team-b/victim/step-45",
        "s3://ckpt/team-a/job1/%2E%2E/%2E%2E/team-b/victim/step-45",
        "s3://ckpt/team-a/job1/%252e%252e/%252e%252e/team-b/victim/step-45",
        "s3://ckpt/team-a/job1/.%2e/.%2e/team-b/victim",
        "s3://ckpt/team-a/job1/..%2f..%2fteam-b/victim",
        "s3://ckpt/team-a/job1/./../job2/step-1",
        "S3://other/team-a/job1/step-1",
        "gs://ckpt/team-a/job1/step-1",
        "s3://ckpt/team-a/job10/step-1",
        "s3://ckpt/team-a/job1/step-1?versionId=../../x",
        "file:///team-a/job1/step-1",
    ],
)
def test_a_uri_outside_the_location_is_not_under_it(uri: str) -> None:
    assert not uri_under(uri, LOCATION)


@pytest.mark.parametrize(
    "uri",
    [
        "s3://ckpt/team-a/job1/step-45",
        "s3://ckpt/team-a/job1//step-45",
        "s3://ckpt//team-a/job1/step-45/",
        "S3://ckpt/team-a/job1/step-45",
        "s3://ckpt/team-a/job1",
        "s3://ckpt/team-a/job1/attempt-2/step-45",
    ],
)
def test_a_uri_inside_the_location_is_under_it(uri: str) -> None:
    assert uri_under(uri, LOCATION)


@given(st.lists(st.sampled_from(["a", "..", ".", "%2e%2e", "%2E.", "", "b"]), max_size=8))
def test_whatever_the_spelling_an_accepted_uri_stays_inside(segments: list[str]) -> None:
    uri = LOCATION + "/" + "/".join(segments)
    if uri_under(uri, LOCATION):
        assert not any(s in ("..", ".", "%2e%2e", "%2E.") for s in segments)


def test_a_traversal_report_is_refused_and_the_next_attempt_does_not_resume_from_it() -> None:
    w, job = running_on_a(LOCATION)
    for forged in (
        "s3://ckpt/team-a/job1/../../team-b/victim/step-45",
        "s3://ckpt/team-a/job1/%2e%2e/%2e%2e/team-b/victim/step-45",
    ):
        fx = w.send("a", CheckpointReport(job_id=job, attempt=1, step=45, uri=forged))
        assert events(fx) == ["checkpoint-refused"]
        (refused,) = [e.event for e in fx if isinstance(e, Publish)]
        assert refused.reason and LOCATION in refused.reason
    assert w.m.jobs[job].latest_checkpoint is None


def test_a_job_without_a_location_accepts_no_checkpoint() -> None:
    w = Sim.empty()
    w.cluster("a")
    job = w.submit()
    w.cycle()
    run(w, job, "a", 1)
    fx = w.send("a", CheckpointReport(job_id=job, attempt=1, step=5, uri="s3://anywhere/5"))
    assert events(fx) == ["checkpoint-refused"]
    (refused,) = [e.event for e in fx if isinstance(e, Publish)]
    assert refused.reason and "no checkpoint.uri" in refused.reason
    assert w.m.jobs[job].latest_checkpoint is None
