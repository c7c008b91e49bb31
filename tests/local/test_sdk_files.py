"""The SDK's file channel, which the local backend uses instead of NATS."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agents.sdk import (
    Checkpointer,
    SdkConfigError,
    SdkEnv,
    checkpoint_request_line,
    read_checkpoint_request,
)


def test_a_request_line_reads_back_as_the_same_deadline(tmp_path: Path) -> None:
    deadline = 1_767_225_600.123456
    (tmp_path / "annotations").write_text('other="x"\n' + checkpoint_request_line(deadline))
    assert read_checkpoint_request(tmp_path / "annotations") == deadline


@pytest.mark.parametrize("value", ["soon", "0", "600"])
def test_a_bad_poll_interval_is_named(value: str) -> None:
    with pytest.raises(SdkConfigError, match="MUSTER_PODINFO_POLL_S"):
        SdkEnv.from_env({"MUSTER_PODINFO_POLL_S": value})


def test_the_poll_interval_sets_how_fast_a_request_is_seen(tmp_path: Path) -> None:
    env = SdkEnv.from_env({"MUSTER_PODINFO_DIR": str(tmp_path), "MUSTER_PODINFO_POLL_S": "0.05"})
    assert env.podinfo_poll_s == 0.05
    with Checkpointer(env) as ck:
        ck.on_checkpoint_request(sigterm=False)
        (tmp_path / "annotations").write_text(checkpoint_request_line(time.time() + 30))
        assert ck.wait_for_request(5)
