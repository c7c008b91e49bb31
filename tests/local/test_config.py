"""The `local` section of an agent config: flavors as slot groups, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.config import AgentConfigError, convert_agent_config, load_agent_config
from agents.fleet import build_backend
from agents.local.backend import LocalBackend

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent-local.yaml"


async def test_the_example_config_declares_slot_groups_as_nodes() -> None:
    cfg = load_agent_config(EXAMPLE)
    assert cfg.local is not None
    assert Path(cfg.local.workdir).is_absolute()  # resolved beside the file
    backend = build_backend(cfg)
    assert isinstance(backend, LocalBackend)
    snap = await backend.snapshot()
    assert [(f.name, f.capacity_type) for f in snap.flavors] == [
        ("spot-slots", "spot"),
        ("on-demand-slots", "on-demand"),
    ]
    assert [(n.name, n.flavor, n.gpu, n.cpu_milli) for n in snap.nodes] == [
        ("laptop-spot-slots-0", "spot-slots", 2, 4000),
        ("laptop-spot-slots-1", "spot-slots", 2, 4000),
        ("laptop-on-demand-slots-0", "on-demand-slots", 1, 2000),
    ]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"cluster": "x", "backend": "local"}, "local: required when backend is 'local'"),
        (
            {
                "cluster": "x",
                "backend": "local",
                "local": {"flavors": [{"name": "a", "nodes": [{"cpu": "lots"}]}]},
            },
            "nodes[0]: cpu",
        ),
        (
            {
                "cluster": "x",
                "backend": "local",
                "local": {"flavors": [{"name": "a"}, {"name": "a"}]},
            },
            "duplicate flavor names ['a']",
        ),
        (
            {
                "cluster": "x",
                "backend": "local",
                "local": {"flavors": [{"name": "a", "grace_s": -1}]},
            },
            "grace_s",
        ),
    ],
)
def test_bad_local_configs_name_the_field(raw: dict[str, object], message: str) -> None:
    with pytest.raises(AgentConfigError) as err:
        convert_agent_config(raw)
    assert message in str(err.value)
