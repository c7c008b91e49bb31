"""Autoscaled pools in the simulator: warm pools never ask, pools scaled to zero are asked to
grow (one cluster per gang) and every job still finishes, stockouts are counted and moved
past, and a warm fleet pays for capacity it leaves idle."""

from __future__ import annotations

from typing import Any

import pytest

from load.autoscale import SCENARIO, VARIANTS, app, one, variant
from load.command import run
from load.scenario import apply_scenario, load_scenario
from load.simconfig import SimConfig


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[str, Any]]:
    base = apply_scenario(SimConfig(jobs=120, seed=3, spot="none"), load_scenario(SCENARIO))
    return {name: one((variant(base, name, 0.5), name)) for name in VARIANTS}


def test_every_variant_starts_every_job_without_violations(
    rows: dict[str, dict[str, Any]],
) -> None:
    """No job waits for good, stockouts included (a job still running at the end ran on a
    slow GPU: T4s take 40 h for Philly's capped 12 h of V100 work)."""
    for name, row in rows.items():
        assert row["violations"] == 0, name
        assert row["never_started"] == 0, name
        assert row["completed"] >= rows["warm"]["completed"] - 3 > 100, name


def test_only_pools_scaled_from_zero_grow_and_stockouts_are_moved_past(
    rows: dict[str, dict[str, Any]],
) -> None:
    warm, zero, dry = rows["warm"], rows["zero"], rows["stockouts"]
    assert warm["provision_asks"] == warm["provisioned"] == 0
    assert zero["provision_asks"] > 0 and zero["stockouts"] == 0
    assert zero["provisioned"] >= zero["provision_asks"]  # an ask may be for several nodes
    assert dry["stockouts"] > 0 and dry["provision_asks"] > zero["provision_asks"] // 2
    # waiting for nodes shows in the queue, and idle warm nodes in the fleet's bill
    assert warm["queue_p90_s"] <= zero["queue_p90_s"]
    assert warm["capacity_cost_usd"] > zero["capacity_cost_usd"]


def test_availability_traces_stock_out_the_spot_pools_asks(
    rows: dict[str, dict[str, Any]],
) -> None:
    """The zones of the public traces grant nothing for long stretches: asks there stock out,
    and what does come is never more than was asked for."""
    zero, dry = rows["zero"], rows["trace"]
    assert dry["stockouts"] > 0 and dry["provision_asks"] > 0
    assert dry["provisioned"] > 0
    assert dry["queue_p90_s"] >= zero["queue_p90_s"]


def test_the_command_prints_medians_and_every_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(app, ["--jobs", "40", "--workers", "1"], "muster autoscale") == 0
    out = capsys.readouterr().out
    assert out.startswith("| variant |") and "\n| warm | " in out and "| 1 | stockouts |" in out
    assert "\n| trace | " in out
    assert "fleet cost ($)" in out
