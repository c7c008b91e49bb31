"""An autoscaled pool driven by an availability trace (SkyPilot's count per tick): an ask gets
at most what the trace grants at that moment, nothing while it grants none, the trace loops
and starts at the pool's phase; a pool without a trace gets every node it asks for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from load.scenario import apply_scenario, load_scenario
from load.sim import Sim
from load.sim.world import NODE_UP
from load.simconfig import AutoscaleSpec, PoolSpec, SimConfig
from schemas.agent import Provision

HOUR = 3600.0


def sim(tmp_path: Path, *, trace: bool = True, phase_s: float = 0.0) -> Sim:
    path = tmp_path / "zone.json"
    # granted per hour: none, 3, none, 5 (then again from the start)
    path.write_text(json.dumps({"metadata": {"gap_seconds": HOUR}, "data": [0, 3, 0, 5]}))
    scale = AutoscaleSpec(
        max_nodes=16,
        ready_s=60.0,
        spread=0.0,
        trace=str(path) if trace else None,
        trace_phase_s=phase_s,
    )
    pool = PoolSpec("c1", "v100-spot", "spot", "V100", 0.92, 0, autoscale=scale)
    return Sim(SimConfig(jobs=5, seed=1, spot="none", pools=(pool,)))


def ask(s: Sim, at_h: float, nodes: int = 4) -> int:
    """Nodes the provider brings for an ask `at_h` hours in (each ask a new job's)."""
    before = coming(s)
    agent = s.clusters["c1"]
    cmd = Provision(job_id=f"j{len(s.heap)}-{at_h}", epoch=1, flavor="v100-spot", nodes=nodes)
    s.provision(agent, cmd, s.base + at_h * HOUR)
    return coming(s) - before


def coming(s: Sim) -> int:
    """Nodes on their way up (the loop's heap holds (t, seq, kind, payload))."""
    return sum(1 for e in s.heap if e[2] == NODE_UP)


def test_an_ask_gets_at_most_what_the_trace_grants_and_none_while_it_grants_none(
    tmp_path: Path,
) -> None:
    s = sim(tmp_path)
    assert ask(s, 0.5) == 0 and s.stockouts == 1
    assert ask(s, 1.5) == 3 and s.stockouts == 1
    assert ask(s, 1.6, nodes=2) == 2
    assert ask(s, 2.5) == 0 and s.stockouts == 2
    assert ask(s, 3.5) == 4
    assert ask(s, 4.5) == 0 and s.stockouts == 3  # looped: the first hour again
    assert ask(s, 5.5) == 3
    assert s.provision_asks == 7


def test_the_trace_starts_at_the_pools_phase(tmp_path: Path) -> None:
    s = sim(tmp_path, phase_s=HOUR)
    assert ask(s, 0.5) == 3
    assert ask(s, 1.5) == 0 and s.stockouts == 1


def test_without_a_trace_every_ask_gets_its_nodes(tmp_path: Path) -> None:
    s = sim(tmp_path, trace=False)
    assert [ask(s, h) for h in (0.5, 1.5, 2.5)] == [4, 4, 4] and s.stockouts == 0


def test_a_scenario_names_the_trace_and_its_phase_in_hours(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(
        "pools:\n"
        "  - {cluster: c1, flavor: v100-spot, capacity: spot, gpu: V100, price: 0.92, nodes: 0,\n"
        "     autoscale: {max_nodes: 8, trace: zones/a.json, phase_h: 2}}\n"
    )
    (pool,) = apply_scenario(SimConfig(), load_scenario(path)).pools
    assert pool.autoscale is not None
    assert (pool.autoscale.trace, pool.autoscale.trace_phase_s) == ("zones/a.json", 2 * HOUR)


def test_a_trace_beside_autoscale_is_refused_with_where_it_goes(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(
        "pools:\n"
        "  - {cluster: c1, flavor: v100-spot, capacity: spot, gpu: V100, price: 0.92, nodes: 0,\n"
        "     trace: zones/a.json, autoscale: {max_nodes: 8}}\n"
    )
    with pytest.raises(ValueError, match="under its autoscale:"):
        load_scenario(path)
