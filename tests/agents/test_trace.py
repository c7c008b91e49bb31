"""Bamboo trace parsing and replay onto a fake cluster."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from agents.config import BambooTrace, FakeClusterConfig, FakeFlavor
from agents.fake.model import ClusterModel, ManualClock
from agents.fake.trace import TraceError, load_bamboo, parse_bamboo, removals_per_node_hour
from load.traces import default_traces_dir
from schemas.agent import AgentEvent, NodeGone, NodeUpsert, SpotNotice
from tests.agents.helpers import unique

TRACES = default_traces_dir()
P3 = TRACES / "bamboo-p3.csv"


def test_parse_sorts_and_skips_blank_lines() -> None:
    evs = parse_bamboo("# header\n60000,remove,node1\n\n0,add,node1\n0,add,node2\n")
    assert [(e.time_ms, e.op, e.node) for e in evs] == [
        (0, "add", "node1"),
        (0, "add", "node2"),
        (60000, "remove", "node1"),
    ]


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("1,add", "expected"),
        ("x,add,n", "not a number"),
        ("-5,add,n", "negative"),
        ("5,boot,n", "op must be"),
    ],
)
def test_parse_errors_name_the_line(line: str, needle: str) -> None:
    with pytest.raises(TraceError, match=needle) as info:
        parse_bamboo(f"0,add,a\n{line}\n", "t.csv")
    assert "t.csv:2" in str(info.value)


def test_missing_trace_file_is_clear(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        load_bamboo(tmp_path / "nope.csv")


@pytest.mark.skipif(not P3.exists(), reason="data/traces/bamboo-p3.csv is not in this copy")
def test_real_p3_trace_rate() -> None:
    evs = load_bamboo(P3)
    assert sum(e.op == "add" for e in evs) == 177
    assert sum(e.op == "remove" for e in evs) == 167
    assert 0.5 < removals_per_node_hour(evs) < 0.75  # README: ~0.61


def _live_at_end(path: Path) -> set[str]:
    live: set[str] = set()
    for e in load_bamboo(path):
        if e.op == "add":
            live.add(e.node)
        else:
            live.discard(e.node)
    return live


@pytest.mark.skipif(not P3.exists(), reason="data/traces/bamboo-p3.csv is not in this copy")
def test_replay_p3_onto_the_cluster_model() -> None:
    name = unique("b")
    cfg = FakeClusterConfig(
        flavors=[FakeFlavor(name="spot-v100", capacity_type="spot", nodes=0, gpu_per_node=8)],
        spot_notice_s=10.0,
        trace=BambooTrace(path=str(P3), flavor="spot-v100", speedup=40.0),
    )
    clock = ManualClock()
    c = ClusterModel(name, cfg, clock)
    assert len(c.nodes) == 18  # the trace's adds at t=0 are the initial nodes
    got: list[AgentEvent] = []
    c.emit = got.append
    for _ in range(100_000):  # ~41,000 trace s / 40 = ~1,030 simulated s, in 1 s steps
        if c.next_due() == math.inf:
            break
        clock.t = max(clock.t + 1.0, c.next_due())
        c.advance()
    assert c.trace_remaining() == 0
    assert all(c.node_info(n).spot_deadline is None for n in c.nodes)  # type: ignore[union-attr]
    expected = {f"{name}-spot-v100-{n}" for n in _live_at_end(P3)}
    assert set(c.nodes) == expected
    assert sum(isinstance(e, NodeUpsert) for e in got) == 177 - 18
    assert sum(isinstance(e, SpotNotice) for e in got) == 167
    assert sum(isinstance(e, NodeGone) for e in got) == 167


def test_a_fake_cluster_replays_skypilots_json_counts(tmp_path: Path) -> None:
    """The fake agents read SkyPilot's spot-traces JSON through the same parser: each count
    change is nodes joining or leaving, with the notice ahead of each removal."""
    path = tmp_path / "zone.json"
    path.write_text('{"metadata": {"gap_seconds": 300}, "data": [3, 3, 1, 1, 4, 0]}')
    cfg = FakeClusterConfig(
        flavors=[FakeFlavor(name="spot-v100", capacity_type="spot", nodes=0, gpu_per_node=8)],
        spot_notice_s=10.0,
        trace=BambooTrace(path=str(path), flavor="spot-v100"),
    )
    clock = ManualClock()
    c = ClusterModel(unique("j"), cfg, clock)
    assert len(c.nodes) == 3  # the first tick's count is the starting fleet
    got: list[AgentEvent] = []
    c.emit = got.append
    while c.next_due() != math.inf:
        clock.t = max(clock.t + 1.0, c.next_due())
        c.advance()
    assert c.nodes == []
    assert sum(isinstance(e, NodeUpsert) for e in got) == 3  # 1 -> 4 at 1,200 s
    assert sum(isinstance(e, SpotNotice) for e in got) == 6  # 3 -> 1, then 4 -> 0
    assert sum(isinstance(e, NodeGone) for e in got) == 6
