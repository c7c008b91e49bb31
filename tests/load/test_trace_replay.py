"""Spot traces replayed as they are: a bad row is an error naming its line (never dropped), a
trace loops at its own length (declared, or its last event plus its own median spacing, not a
fixed pad), and further seeds start at points spread over the whole trace."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from load import traces
from load.scenario import Scenario, apply_scenario, load_scenario
from load.sim import SPOT_TRACE, Sim, config_from_args
from load.simconfig import PoolSpec, SimConfig


def write(path: Path, rows: list[str]) -> Path:
    path.write_text("\n".join(rows) + "\n")
    return path


def test_a_bad_row_is_an_error_with_its_line(tmp_path: Path) -> None:
    bad = write(tmp_path / "bad.csv", ["0,add,n1", "1000,add,n2", "12.5x,remove,n1"])
    with pytest.raises(ValueError, match=r"bad\.csv:3: time_ms '12\.5x' is not a number"):
        traces.load_bamboo(bad)


def test_a_fractional_time_is_kept_not_dropped(tmp_path: Path) -> None:
    rows = traces.load_bamboo(write(tmp_path / "ms.csv", ["0,add,n1", "1500.7,remove,n1"]))
    assert rows == [(0, "add", "n1"), (1500, "remove", "n1")]


def test_the_period_is_the_traces_own_length() -> None:
    # Declared: a zone up once in two days loops every two days, not every 630 s.
    assert traces.trace_period_s([0.0, 30.0], declared_s=2 * 86_400.0) == 2 * 86_400.0
    # Not declared: the last event plus the median spacing of the trace's instants.
    assert traces.trace_period_s([0.0, 100.0, 100.0, 200.0, 500.0]) == 600.0
    with pytest.raises(ValueError, match="shorter than its last event"):
        traces.trace_period_s([0.0, 7200.0], declared_s=3600.0)


def test_a_zone_up_once_in_two_days_does_not_flap(tmp_path: Path) -> None:
    write(tmp_path / "zone.csv", ["0,add,n1", "30000,remove,n1"])
    pool = PoolSpec(
        cluster="c",
        flavor="spot",
        capacity_type="spot",
        gpu_type="V100",
        price=1.0,
        nodes=1,
        trace=str(tmp_path / "zone.csv"),
    )
    scenario = Scenario(pools=[], trace_length_h={str(tmp_path / "zone.csv"): 48.0})
    cfg = replace(SimConfig(), jobs=5, drain_s=86_400.0, pools=(pool,))
    cfg = replace(apply_scenario(cfg, scenario), pools=(pool,))
    sim = Sim(cfg, "muster")
    changes = [p for _, _, kind, p in sim.heap if kind == SPOT_TRACE]
    assert len(changes) <= 2, len(changes)  # up, then down once; not a flap every 630 s


def test_further_seeds_start_across_the_whole_trace() -> None:
    args = SimpleNamespace(
        jobs=10,
        offset=48_000,
        compress=3.0,
        max_duration_h=12.0,
        drain_h=24.0,
        seed=1,
        scale=1.0,
        spot="trace",
        poisson_rate=0.6,
        progress=0.0,
        traces_dir="",
        scenario=None,
    )
    fracs = sorted(config_from_args(args, seed).trace_phase_frac for seed in range(1, 5))
    assert fracs[0] == 0.0  # the first run is the trace from its start, as before
    assert fracs[-1] - fracs[0] > 0.5, fracs  # not four neighbouring hours of its beginning
    assert min(b - a for a, b in itertools.pairwise(fracs)) > 0.1, fracs


def write_counts(path: Path, data: list[object], gap: object = 300) -> Path:
    path.write_text(json.dumps({"metadata": {"gap_seconds": gap}, "data": data}))
    return path


def test_skypilot_counts_become_adds_and_removes_of_the_newest(tmp_path: Path) -> None:
    trace = traces.load_trace(write_counts(tmp_path / "zone.json", [2, 2, 0, 3, 1]))
    assert trace.events == [
        (0, "add", "n1"),
        (0, "add", "n2"),
        (600_000, "remove", "n2"),
        (600_000, "remove", "n1"),
        (900_000, "add", "n3"),
        (900_000, "add", "n4"),
        (900_000, "add", "n5"),
        (1_200_000, "remove", "n5"),
        (1_200_000, "remove", "n4"),
    ]
    assert trace.length_ms == 5 * 300_000  # ticks x gap: where the trace loops


@pytest.mark.parametrize(
    ("data", "gap", "needle"),
    [
        ([1, 2, -1], 300, r"data\[2\] = -1 is not a count"),
        ([1, 1.5], 300, r"data\[1\] = 1\.5 is not a count"),
        ([1, "2"], 300, r"data\[1\] = '2' is not a count"),
        ([1, True], 300, r"data\[1\] = True is not a count"),
        ([1], 0, "gap_seconds must be a positive number"),
    ],
)
def test_a_bad_count_is_an_error_naming_the_file_and_entry(
    tmp_path: Path, data: list[object], gap: object, needle: str
) -> None:
    with pytest.raises(ValueError, match=r"bad\.json: .*" + needle):
        traces.load_trace(write_counts(tmp_path / "bad.json", data, gap))


def test_a_file_that_is_not_json_names_its_line(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"metadata": {"gap_seconds": 300},\n "data": [1, 2,,]}')
    with pytest.raises(ValueError, match=r"bad\.json:2: not JSON"):
        traces.load_trace(tmp_path / "bad.json")


SCENARIOS = Path(__file__).resolve().parents[2] / "load" / "scenarios"


@pytest.mark.parametrize("name", ["spot-traces-16node.yaml", "spot-traces-4node.yaml"])
def test_public_trace_worlds_read_the_shipped_json_and_loop_at_its_length(name: str) -> None:
    cfg = apply_scenario(replace(SimConfig(), jobs=5), load_scenario(SCENARIOS / name))
    spot = [p for p in cfg.pools if p.trace is not None]
    assert spot and all(p.trace.endswith(".json") for p in spot if p.trace)
    sim = Sim(cfg, "muster")
    for pool in sim.spot_pools:
        assert pool.trace is not None
        events, length_ms = traces.load_trace(traces.default_traces_dir() / pool.trace)
        assert events and length_ms is not None and length_ms >= 86_400_000  # days long
    changes = [p for _, _, kind, p in sim.heap if kind == SPOT_TRACE]
    assert changes, "the traces drive the spot pools"


def test_a_count_trace_loops_at_its_ticks_not_at_its_last_change(tmp_path: Path) -> None:
    # Up for the first hour of four: the node returns every 4 h, not every 2 h (the last
    # change plus the median gap would say 2 h).
    path = write_counts(tmp_path / "zone.json", [1, 0, 0, 0], gap=3600)
    pool = PoolSpec("c", "spot", "spot", "V100", 1.0, 1, trace=str(path))
    sim = Sim(replace(SimConfig(), jobs=5, drain_s=86_400.0, pools=(pool,)), "muster")
    adds = sorted(
        t - sim.base for t, _, kind, p in sim.heap if kind == SPOT_TRACE and p[2].op == "add"
    )
    assert adds[:3] == [4 * 3600.0, 8 * 3600.0, 12 * 3600.0]
