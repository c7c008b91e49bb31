"""Agent and fleet config loading: valid files, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.config import (
    AgentConfigError,
    FakeClusterConfig,
    load_agent_config,
    load_fleet_config,
    make_fleet_configs,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def write(tmp_path: Path, text: str, name: str = "agent.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_load_fake_agent(tmp_path: Path) -> None:
    cfg = load_agent_config(
        write(
            tmp_path,
            "cluster: east-1\nbackend: fake\nheartbeat_s: '0.5'\nfake:\n"
            "  time_scale: 10\n  flavors:\n"
            "    - {name: spot-a100, capacity_type: spot, nodes: 3}\n",
        )
    )
    assert cfg.cluster == "east-1" and cfg.heartbeat_s == 0.5
    assert cfg.fake is not None and cfg.fake.time_scale == 10
    assert cfg.fake.flavors[0].nodes == 3 and cfg.fake.flavors[0].gpu_per_node == 8
    assert cfg.subject_prefix == "muster" and cfg.kube is None


def test_kube_section_is_passed_through(tmp_path: Path) -> None:
    cfg = load_agent_config(
        write(tmp_path, "cluster: k\nbackend: kube\nkube: {namespace: jobs, anything: [1, 2]}\n")
    )
    assert cfg.kube == {"namespace": "jobs", "anything": [1, 2]}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (
            "cluster: a\nbackend: fake\nfake: {flavors: [{name: x, nodes: -1}]}\n",
            "flavors[0].nodes",
        ),
        ("cluster: a\nbackend: fake\nheartbeat: 1\nfake: {}\n", "heartbeat"),
        ("cluster: a\nbackend: fake\n", "fake: required"),
        ("cluster: a.b\nbackend: fake\nfake: {}\n", "config: cluster: Expected"),
        (
            "cluster: a\nbackend: slurm\nfake: {}\n",
            "backend: Invalid enum value 'slurm'; valid values: fake, kube",
        ),
        ("cluster: a\nbackend: fake\nfake: {time_scale: 0}\n", "config: fake.time_scale: Expected"),
        ("cluster: a\nbackend: fake\nfake: {flavors: [{name: x, cpu: lots}]}\n", "cpu"),
        (
            "cluster: a\nbackend: fake\nfake: {trace: {path: t.csv, flavor: nope}}\n",
            "trace.flavor",
        ),
        ("cluster: [\n", "not valid YAML"),
        ("- 1\n- 2\n", "Expected `object`"),
    ],
)
def test_errors_name_the_field(tmp_path: Path, text: str, needle: str) -> None:
    p = write(tmp_path, text)
    with pytest.raises(AgentConfigError) as info:
        load_agent_config(p)
    assert needle in str(info.value)
    assert str(p) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(AgentConfigError, match="cannot read"):
        load_agent_config(tmp_path / "none.yaml")


def test_relative_trace_path_is_relative_to_the_file(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    (tmp_path / "traces").mkdir()
    p = write(
        tmp_path / "conf",
        "cluster: a\nbackend: fake\nfake:\n  flavors: [{name: s, capacity_type: spot}]\n"
        "  trace: {path: ../traces/p3.csv, flavor: s}\n",
    )
    with pytest.raises(AgentConfigError) as info:
        load_agent_config(p)  # checked before the agent starts, with the path it looked at
    assert str(info.value) == (
        f"{p}: cluster a: fake.trace.path: no file at {(tmp_path / 'traces' / 'p3.csv')} (a "
        "relative path is relative to the config file; the Bamboo traces ship in the "
        "repository's data/traces/)"
    )
    (tmp_path / "traces" / "p3.csv").write_text("0,add,n1\n")
    cfg = load_agent_config(p)
    assert cfg.fake is not None and cfg.fake.trace is not None
    assert cfg.fake.trace.path == str((tmp_path / "traces" / "p3.csv").resolve())


def test_fleet_config(tmp_path: Path) -> None:
    fleet = load_fleet_config(
        write(
            tmp_path,
            "clusters:\n  - {cluster: a, backend: fake, fake: {}}\n"
            "  - {cluster: b, backend: fake, fake: {}}\n",
        )
    )
    assert [c.cluster for c in fleet.clusters] == ["a", "b"]
    single = load_fleet_config(write(tmp_path, "cluster: a\nbackend: fake\nfake: {}\n", "s.yaml"))
    assert [c.cluster for c in single.clusters] == ["a"]
    with pytest.raises(AgentConfigError, match="duplicate cluster names"):
        load_fleet_config(
            write(
                tmp_path,
                "clusters:\n  - {cluster: a, backend: fake, fake: {}}\n"
                + "  - {cluster: a, backend: fake, fake: {}}\n",
                "d.yaml",
            )
        )


def test_examples_validate() -> None:
    cfg = load_agent_config(EXAMPLES / "agent-fake.yaml")
    assert cfg.fake is not None and len(cfg.fake.flavors) == 2
    fleet = load_fleet_config(EXAMPLES / "fleet-fake.yaml")
    assert len(fleet.clusters) == 3
    grown = load_fleet_config(EXAMPLES / "fleet-autoscale.yaml")
    assert [len(c.pools) for c in grown.clusters] == [1, 1]


def test_make_fleet_configs() -> None:
    cfgs = make_fleet_configs(3, FakeClusterConfig(seed=10), prefix="load")
    assert [c.cluster for c in cfgs] == ["load-0", "load-1", "load-2"]
    assert [c.fake.seed for c in cfgs if c.fake] == [10, 11, 12]
    with pytest.raises(ValueError):
        make_fleet_configs(0, FakeClusterConfig())


POOLED = (
    "cluster: east\nbackend: fake\nfake:\n  flavors:\n"
    "    - {name: spot-a, capacity_type: spot, nodes: 0,"
    " autoscale: {delay_s: 90, stockout_p: 0.1}}\n"
    "pools:\n"
    "  - {flavor: spot-a, max_nodes: 4, gpu_per_node: 8, cpu: '96', memory: 768Gi,"
    " labels: {karpenter.sh/nodepool: spot-a}, taints: [{key: nvidia.com/gpu}],"
    " ready_s: 240, window_s: 600}\n"
)


def test_pools_are_declared_in_the_agent_config(tmp_path: Path) -> None:
    cfg = load_agent_config(write(tmp_path, POOLED))
    assert cfg.fake is not None and cfg.fake.flavors[0].autoscale is not None
    assert cfg.fake.flavors[0].autoscale.delay_s == 90
    got = cfg.pools[0].provision()
    assert (got.max_nodes, got.node_gpu, got.ready_s, got.window_s) == (4, 8, 240, 600)
    assert got.node_cpu_milli == 96_000 and got.node_memory == 768 * 2**30
    assert got.labels == {"karpenter.sh/nodepool": "spot-a"}
    assert got.taints[0].key == "nvidia.com/gpu" and got.taints[0].effect == "NoSchedule"


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (("flavor: spot-a, max", "flavor: nope, max"), "['nope'] are not flavors of this cluster"),
        (("ready_s: 240", "ready_s: 900"), "window_s (600) is shorter than ready_s (900)"),
        (("max_nodes: 4", "max_nodes: -1"), "pools[0].max_nodes"),
        (("max_nodes: 4", "max_nodes: 0"), "give max_nodes or max_gpus (the pool's limit)"),
        (("memory: 768Gi,", "memory: lots,"), "pools: flavor 'spot-a': memory"),
    ],
)
def test_pool_errors_say_what_to_fix(tmp_path: Path, edit: tuple[str, str], needle: str) -> None:
    with pytest.raises(AgentConfigError) as info:
        load_agent_config(write(tmp_path, POOLED.replace(*edit)))
    assert needle in str(info.value)


def test_backends_that_cannot_grow_pools_refuse_them(tmp_path: Path) -> None:
    text = (
        "cluster: k\nbackend: local\nlocal: {}\npools: [{flavor: a, max_nodes: 2, gpu_per_node: 8}]"
    )
    with pytest.raises(AgentConfigError) as info:
        load_agent_config(write(tmp_path, text))
    assert "the local backend has no autoscaler to grow a pool" in str(info.value)


def test_a_kube_agent_declares_pools_of_its_own_flavors(tmp_path: Path) -> None:
    pools = "pools: [{flavor: a, max_nodes: 2, gpu_per_node: 8}]"
    text = f"cluster: k\nbackend: kube\nkube: {{flavors: [{{name: a}}]}}\n{pools}"
    assert load_agent_config(write(tmp_path, text)).pools[0].flavor == "a"
    with pytest.raises(AgentConfigError) as info:
        load_agent_config(write(tmp_path, text.replace("{name: a}", "{name: b}")))
    assert "['a'] are not flavors of this cluster (['b'])" in str(info.value)
