"""The JSON log line: one object per line, the UTC time to the microsecond, and no value or
event that can make a log call raise."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest
import structlog

from shell.logs import UtcStamp, configure_logging, render_json

Lines = Callable[[], list[dict[str, Any]]]
STAMP = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z$")


@pytest.fixture
def lines(capsys: pytest.CaptureFixture[str]) -> Iterator[Lines]:
    """The process's logs configured as a pod's broker has them (JSON at info, to stderr);
    the session's quiet setup is restored after."""
    configure_logging("info", "json")

    def read() -> list[dict[str, Any]]:
        return [json.loads(line) for line in capsys.readouterr().err.splitlines()]

    yield read
    configure_logging("warning")


def test_a_line_carries_the_event_its_fields_level_and_utc_time(lines: Lines) -> None:
    before = datetime.now(UTC)
    structlog.get_logger("muster.test").info(
        "job dispatched", job_id="j-1", cluster="c-1", attempt=2, step=None
    )
    after = datetime.now(UTC)
    (line,) = lines()
    assert {k: line[k] for k in ("event", "level", "job_id", "cluster", "attempt", "step")} == {
        "event": "job dispatched",
        "level": "info",
        "job_id": "j-1",
        "cluster": "c-1",
        "attempt": 2,
        "step": None,
    }
    assert STAMP.match(line["timestamp"]), line["timestamp"]
    at = datetime.strptime(line["timestamp"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
    assert before.replace(microsecond=0) <= at <= after


def test_below_the_level_nothing_is_written(lines: Lines) -> None:
    structlog.get_logger("muster.test").debug("a command", job_id="j-1")
    assert lines() == []


@pytest.mark.parametrize(
    ("now", "text"),
    [
        # 1,700,000,000 s after the epoch is 2023-11-14 22:13:20 UTC
        ([1_700_000_000.25], "2023-11-14T22:13:20.250000Z"),
        ([1_700_000_000.25, 1_700_000_001.5], "2023-11-14T22:13:21.500000Z"),
        ([1_700_000_001.5, 1_700_000_000.75], "2023-11-14T22:13:20.750000Z"),
        ([1_700_000_000.0], "2023-11-14T22:13:20.000000Z"),
        ([1_700_000_000.5, 1_700_003_600.5], "2023-11-14T23:13:20.500000Z"),
    ],
)
def test_the_stamp_names_the_second_of_each_line(
    monkeypatch: pytest.MonkeyPatch, now: list[float], text: str
) -> None:
    """The second's text is kept between lines: a line in another second (later, or earlier
    after the clock was set back) gets that second's."""
    stamp = UtcStamp()
    event: dict[str, Any] = {}
    for t in now:
        monkeypatch.setattr("shell.logs.time.time", lambda t=t: t)
        event = stamp(None, "info", {})
    assert event["timestamp"] == text


class Job(msgspec.Struct):
    job_id: str
    gpus: int


class Opaque:
    def __repr__(self) -> str:
        return "<opaque 7>"


class Described:
    def __structlog__(self) -> str:
        return "described"


def test_values_json_has_no_type_for_are_written_as_their_repr() -> None:
    line = json.loads(
        render_json(
            None,
            "info",
            {"event": "e", "obj": Opaque(), "own": Described(), "job": Job("j", 8), "ids": ("a",)},
        )
    )
    assert line == {
        "event": "e",
        "obj": "<opaque 7>",
        "own": "described",
        "job": {"job_id": "j", "gpus": 8},
        "ids": ["a"],
    }


def test_keys_json_has_no_type_for_and_events_msgspec_refuses_are_still_one_line() -> None:
    """A key JSON has no type for is written as its repr, an integer past 64 bits whole, and
    an event msgspec refuses (a cycle) keeps its event, level and time, the rest as a repr."""
    tuple_key = render_json(None, "info", {"event": "e", "by": {("a", 1): 2, "b": 3}})
    assert json.loads(tuple_key) == {"event": "e", "by": {"('a', 1)": 2, "b": 3}}
    huge = render_json(None, "info", {"event": "e", "n": 2**70})
    assert json.loads(huge) == {"event": "e", "n": 2**70}
    cycle: dict[str, Any] = {"event": "e"}
    cycle["self"] = cycle
    text = render_json(None, "info", {**cycle, "level": "info", "timestamp": "t"})
    assert "\n" not in text
    line = json.loads(text)
    assert (line["event"], line["level"], line["timestamp"]) == ("e", "info", "t")
    assert line["unencodable"].startswith("{'event': 'e', 'self': {")
