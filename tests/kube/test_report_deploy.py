"""The shipped deploy/agent/ gives workload pods a way to the checkpoint report endpoint:
a Service in front of the agent's container port, the agent's config pointing pods at it, and
a NetworkPolicy that lets the workload namespace (and nothing else) reach it."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import yaml

from agents.config import convert_agent_config
from agents.kube.backend import KubeBackend
from tests.kube.deploy_tree import all_docs, configmap_data


def _one(kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for _, d in all_docs() if d.get("kind") == kind and d["metadata"]["name"] == name]
    return found


def test_pods_reach_the_agent_through_the_shipped_service_and_policy() -> None:
    agent = convert_agent_config(
        yaml.safe_load(configmap_data("muster-agent-config", "agent.yaml"))
    )
    config = KubeBackend.from_config(agent.cluster, agent.kube or {}).config
    report = config.report
    assert report.enabled
    deployment = _one("Deployment", "muster-agent")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert ports.get("report") == report.listen_port

    # The URL pods get names the Service, in the agent's namespace, on the Service's port.
    url = urlsplit(report.url)
    name, namespace, *_ = (url.hostname or "").split(".")
    service = _one("Service", name)
    assert service["metadata"]["namespace"] == namespace == deployment["metadata"]["namespace"]
    selector = service["spec"]["selector"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert (port["port"], port["targetPort"]) == (url.port, "report")

    # Ingress to the agent: the report port, from the workload namespace only.
    policy = _one("NetworkPolicy", "muster-agent-report")
    assert policy["metadata"]["namespace"] == namespace
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": config.namespace}}}
    ]
    assert rule["ports"] == [{"protocol": "TCP", "port": report.listen_port}]
