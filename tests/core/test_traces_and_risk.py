"""Trace loaders (the real files in data/traces) and the risk formulas."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from broker.core.risk import NO_CHECKPOINT_LOSS_H, expected_cost_per_hour, loss_hours
from load.traces import (
    default_traces_dir,
    gang_demands,
    gang_shape,
    load_bamboo,
    load_philly,
    philly_gang_sizes,
)

TRACES = default_traces_dir()


def test_gang_shape_mapping() -> None:
    assert gang_shape(1) == (1, 1)
    assert gang_shape(8) == (1, 8)
    assert gang_shape(12) == (2, 8)
    assert gang_shape(128) == (16, 8)
    (d,) = gang_demands(4)
    assert (d.replicas, d.gpu, d.cpu_milli) == (1, 4, 32_000)


def test_loaders_on_small_files(tmp_path: Path) -> None:
    philly = tmp_path / "philly.csv"
    philly.write_text(
        "timestamp,duration,num_gpus,gpu_time,cluster\n"
        "2017-10-09 07:01:55,66.0,1,66.0,11cb48\n"
        "2017-10-01 00:00:00,10.0,16,160.0,6214e9\n"
        "2017-10-02 00:00:00,10.0,0,0.0,6214e9\n"
    )
    jobs = load_philly(philly)
    assert [j.num_gpus for j in jobs] == [16, 0, 1]
    assert jobs[0].arrival == 1506816000.0  # 2017-10-01T00:00:00Z
    assert philly_gang_sizes(philly) == [16, 1]
    bamboo = tmp_path / "b.csv"
    bamboo.write_text("0,add,node1\n60000,remove,node1\n")
    assert load_bamboo(bamboo) == [(0, "add", "node1"), (60000, "remove", "node1")]


@pytest.mark.skipif(
    not (TRACES / "philly.csv").exists(), reason="data/traces/philly.csv is not in this copy"
)
def test_real_traces_have_their_documented_shape() -> None:
    jobs = load_philly(TRACES / "philly.csv")
    assert len(jobs) == 82_247
    assert all(a.arrival <= b.arrival for a, b in itertools.pairwise(jobs))
    ones = sum(1 for j in jobs if j.num_gpus == 1) / len(jobs)
    assert 0.9 < ones < 0.95
    p3 = load_bamboo(TRACES / "bamboo-p3.csv")
    assert sum(1 for _, op, _ in p3 if op == "remove") == 167


def test_loss_and_cost_formulas() -> None:
    assert loss_hours(600.0, 0.5) == pytest.approx(600 / 2 / 3600)
    assert loss_hours(None, 0.0) == NO_CHECKPOINT_LOSS_H
    assert loss_hours(None, 2.0) == pytest.approx(0.5)  # memoryless: 1 / rate
    assert expected_cost_per_hour(2.0, 4, 0.0, 1, None, 1.0) == 8.0
    cost = expected_cost_per_hour(1.0, 8, 0.1, 2, 3600.0, 1.0)
    assert math.isclose(cost, 8.0 * (1 + 0.2 * 0.5))
