"""The SDK reads the broker's checkpoint-interval advice from MUSTER_CHECKPOINT_INTERVAL_S."""

from __future__ import annotations

import pytest

from agents.sdk import Checkpointer, SdkConfigError, SdkEnv


def test_advised_interval_comes_from_the_env() -> None:
    ck = Checkpointer(SdkEnv.from_env({"MUSTER_CHECKPOINT_INTERVAL_S": "1234.5"}))
    assert ck.advised_interval_s() == 1234.5
    assert ck.advised_interval_s(600.0) == 1234.5


def test_no_advice_keeps_the_workloads_own_interval() -> None:
    ck = Checkpointer(SdkEnv.from_env({}))
    assert ck.advised_interval_s() is None
    assert ck.advised_interval_s(600.0) == 600.0


@pytest.mark.parametrize("bad", ["soon", "0", "-5"])
def test_bad_advice_is_refused_with_the_variable_named(bad: str) -> None:
    with pytest.raises(SdkConfigError, match="MUSTER_CHECKPOINT_INTERVAL_S"):
        SdkEnv.from_env({"MUSTER_CHECKPOINT_INTERVAL_S": bad})
