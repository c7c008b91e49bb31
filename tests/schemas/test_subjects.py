"""Subject, stream and bucket names derived from one prefix."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.subjects import DEFAULT_SUBJECTS, Subjects

TOKEN = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_-]{0,62}\Z")
PREFIX = st.from_regex(r"\A[A-Za-z0-9_-]{1,8}(\.[A-Za-z0-9_-]{1,8}){0,2}\Z")


def test_default_subjects() -> None:
    s = DEFAULT_SUBJECTS
    assert s.submit("ml") == "muster.submit.ml"
    assert s.submit_all == "muster.submit.*"
    assert s.api("get") == "muster.api.get"
    assert s.api_all == "muster.api.*"
    assert s.job_events("j-1") == "muster.events.job.j-1"
    assert s.job_events_all == "muster.events.job.*"
    assert s.agent_events("aws-east") == "muster.agent.aws-east.events"
    assert s.agent_events_all == "muster.agent.*.events"
    assert s.agent_cmd("aws-east") == "muster.agent.aws-east.cmd"
    assert s.checkpoint("j") == "muster.checkpoint.j"
    assert (s.submit_stream, s.jobs_bucket, s.leader_bucket) == (
        "MUSTER_SUBMIT",
        "MUSTER_JOBS",
        "MUSTER_LEADER",
    )


def test_dotted_prefix_makes_valid_stream_names() -> None:
    s = Subjects(prefix="prod.eu.muster")
    assert s.submit("ml") == "prod.eu.muster.submit.ml"
    assert s.submit_stream == "PROD_EU_MUSTER_SUBMIT"
    assert "." not in s.jobs_bucket


@settings(max_examples=100, deadline=None)
@given(prefix=PREFIX, token=TOKEN)
def test_parsers_invert_builders(prefix: str, token: str) -> None:
    s = Subjects(prefix=prefix)
    assert s.cluster_of_agent_subject(s.agent_events(token)) == token
    assert s.queue_of_submit_subject(s.submit(token)) == token


@pytest.mark.parametrize(
    "subject",
    [
        "muster.agent.events",
        "muster.agent..events",
        "muster.agent.a.b.events",
        "muster.agent.a.cmd",
        "other.agent.a.events",
        "muster.agentx.a.events",
    ],
)
def test_not_an_agent_subject(subject: str) -> None:
    assert DEFAULT_SUBJECTS.cluster_of_agent_subject(subject) is None


@pytest.mark.parametrize(
    "subject", ["muster.submit.", "muster.submit.a.b", "muster.api.x", "muster.submitx.a"]
)
def test_not_a_submit_subject(subject: str) -> None:
    assert DEFAULT_SUBJECTS.queue_of_submit_subject(subject) is None


@pytest.mark.parametrize("prefix", ["", "a..b", ".a", "a.", "a b", "a*", "a>"])
def test_prefix_is_validated_when_decoded(prefix: str) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"prefix": prefix}, Subjects)
