"""Trace loaders (the real files in data/traces) and the risk formulas."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core.risk import (
    MAX_EXPONENT,
    NO_CHECKPOINT_LOSS_H,
    checkpoint_survival,
    expected_cost_per_hour,
    loss_hours,
    redo_factor,
)
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
    assert math.isclose(cost, 8.0 * math.expm1(0.2) / 0.2)  # 2 nodes x 0.1/h x 1 h segments
    assert expected_cost_per_hour(1.0, 8, 2.0, 1, None, 1.0) == 16.0  # loses 1 / rate per reclaim


@settings(max_examples=200, deadline=None)
@given(
    rate=st.floats(1e-4, 5.0),
    nodes=st.integers(1, 64),
    interval_s=st.sampled_from([300.0, 600.0, 1800.0, 3600.0, 7200.0]),
)
def test_redo_grows_with_the_chance_a_gang_misses_its_checkpoint(
    rate: float, nodes: int, interval_s: float
) -> None:
    """Per-node survival to the power of the nodes; first order the old half-interval loss,
    above it once a gang often misses its checkpoint."""
    alone = checkpoint_survival(interval_s, rate)
    assert math.isclose(checkpoint_survival(interval_s, rate * nodes), alone**nodes, rel_tol=1e-9)
    redo = redo_factor(interval_s, rate * nodes)
    linear = 1.0 + rate * nodes * loss_hours(interval_s, rate * nodes)
    assert redo >= linear * (1.0 - 1e-12)
    x = rate * nodes * interval_s / 3600.0
    fewer = redo_factor(interval_s, rate * (nodes - 1))
    assert redo > fewer or nodes == 1 or (x >= MAX_EXPONENT and redo == fewer)
    if x < 1e-3:
        assert math.isclose(redo, linear, rel_tol=1e-6)


def test_a_gang_that_rarely_reaches_a_checkpoint_costs_more_than_linear() -> None:
    # 4 nodes, 0.6 reclaims per node-hour, 45 min segments: survives 16.5 % of segments
    assert math.isclose(checkpoint_survival(2700.0, 2.4), math.exp(-1.8))
    assert math.isclose(redo_factor(2700.0, 2.4), math.expm1(1.8) / 1.8)  # 2.81, linear 1.9
    assert redo_factor(2700.0, 0.0) == 1.0
