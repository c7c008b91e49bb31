"""The simulator's topology: pools a scenario declares topology for report each node's zone and
block, the core keeps multi-node gangs within one zone there, and the report says how many
placements stayed within one zone and one block."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from load.report import format_table, summarize
from load.scenario import apply_scenario, load_scenario
from load.sim import Sim
from load.simconfig import SimConfig

from .small_sim import SMALL

SCENARIO = Path(__file__).resolve().parents[2] / "load" / "scenarios" / "topology.yaml"


def config(*, topology: bool) -> SimConfig:
    cfg = apply_scenario(replace(SMALL, jobs=1000), load_scenario(SCENARIO))
    if topology:
        return cfg
    return replace(cfg, pools=tuple(replace(p, topology=False) for p in cfg.pools))


def test_declared_topology_keeps_multi_node_gangs_in_one_zone_and_the_report_says_so() -> None:
    sim = Sim(config(topology=True), "muster")
    res = sim.run()
    s = summarize(res)
    assert res.violations == []
    assert s["multi_node_placements"] >= 5
    assert s["multi_node_one_zone"] == 1.0
    assert s["multi_node_in_blocks"] == s["multi_node_placements"]  # every pool has blocks
    assert 0.5 <= s["multi_node_one_block"] <= 1.0
    # The nodes report where the simulator put them: zone, block of 4 slots, host.
    info = sim.clusters["us-east"].model.view().nodes
    spot = {n.name: n.topology for n in info if n.flavor == "v100-spot"}
    assert spot and all(len(t) == 3 and t[2] == name for name, t in spot.items())
    assert {t[0] for t in spot.values()} == {"z0", "z1"}
    row = next(
        line
        for line in format_table([{"policy": "muster", "summary": s}]).splitlines()
        if "kept within one zone" in line
    )
    assert row.split()[-1] == "100%"

    blind = summarize(Sim(config(topology=False), "muster").run())
    assert blind["violations"] == 0
    # Without topology the same fleet's gangs straddle zones and blocks.
    assert blind["multi_node_one_zone"] < 1.0
    assert blind["multi_node_one_block"] < s["multi_node_one_block"]


def test_an_autoscaled_pool_declares_no_topology(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "pools: [{cluster: a, flavor: b, capacity: on-demand, gpu: T4, price: 1, nodes: 0, "
        "autoscale: {max_nodes: 4}, topology: {block_nodes: 2}}]"
    )
    with pytest.raises(ValueError, match="declare topology on fixed pools only"):
        load_scenario(bad)
