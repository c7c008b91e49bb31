"""deploy/ as a platform team installs it: `kubectl kustomize` of the single-cluster install,
the agent, and the control and GPU-cluster overlays; every rendered object passes the strict
schema validation; the overlays run the image they name; the NATS configs they ship are the
ones `muster nats-config` generates, and nats-server accepts them with real certificates."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trustme
import yaml

from broker.natsconfig import load_broker_config, render, render_leafnode
from broker.natsconfig import render_leafnode_listener as listener
from tests.kube.deploy_tree import PASSWORDS, nats_accepts, routes_conf
from tests.kube.validation import validate
from tests.support import DEPLOY

TARGETS = ["", "agent", "overlays/control", "overlays/gpu-cluster"]
OVERLAY_IMAGE = "registry.example.com/muster:0.1.0"
KUBECTL = shutil.which("kubectl")

needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl not on PATH")


def kustomize(target: str) -> list[dict[str, Any]]:
    assert KUBECTL is not None
    out = subprocess.run(
        [KUBECTL, "kustomize", str(DEPLOY / target)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, f"kubectl kustomize deploy/{target}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def configmap(objs: list[dict[str, Any]], name: str) -> dict[str, str]:
    (found,) = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name]
    return dict(found["data"])


def containers(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        c
        for o in objs
        if o["kind"] in ("Deployment", "StatefulSet")
        for c in o["spec"]["template"]["spec"]["containers"]
    ]


def tls_files(ca: trustme.CA, where: Path, *names: str) -> None:
    where.mkdir(parents=True)
    cert = ca.issue_cert(*names)
    cert.cert_chain_pems[0].write_to_path(str(where / "tls.crt"))
    cert.private_key_pem.write_to_path(str(where / "tls.key"))
    ca.cert_pem.write_to_path(str(where / "ca.crt"))


@needs_kubectl
@pytest.mark.parametrize("target", TARGETS)
def test_every_install_renders_objects_the_api_server_accepts(target: str) -> None:
    objs = kustomize(target)
    assert objs
    for obj in objs:
        assert validate(obj) == [], (target, obj["kind"], obj["metadata"]["name"])
        if obj["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass"):
            assert obj["metadata"].get("namespace"), (target, obj["kind"], obj["metadata"])


@needs_kubectl
@pytest.mark.parametrize("target", ["overlays/control", "overlays/gpu-cluster"])
def test_overlays_run_the_image_they_name(target: str) -> None:
    images = {c["image"] for c in containers(kustomize(target)) if "muster" in c["image"]}
    assert images == {OVERLAY_IMAGE}


@needs_kubectl
def test_control_overlay_serves_mtls_leafnodes_with_generated_users(tmp_path: Path) -> None:
    objs = kustomize("overlays/control")
    data = configmap(objs, "muster-nats-config")
    assert listener() in data["leafnodes.conf"]
    broker = load_broker_config(DEPLOY / "broker" / "configmap.yaml")
    clusters = ["east", "west"]
    assert data["accounts.conf"] == render(broker.config, clusters, broker.aliases, clusters), (
        "deploy/overlays/control/accounts.conf is stale: regenerate it (deploy/README.md)"
    )
    (nats,) = [o for o in objs if o["kind"] == "StatefulSet"]
    spec = nats["spec"]["template"]["spec"]
    assert {"name": "leafnodes", "containerPort": 7422} in spec["containers"][0]["ports"]
    mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts["/etc/nats/tls"]]["secret"]["secretName"] == "muster-nats-tls"
    (service,) = [o for o in objs if o["metadata"]["name"] == "muster-nats-leafnodes"]
    assert service["spec"]["type"] == "LoadBalancer"
    assert [p["port"] for p in service["spec"]["ports"]] == [7422]  # no plain-text port
    (policy,) = [
        o for o in objs if o["metadata"]["name"] == "muster-nats" and o["kind"] == "NetworkPolicy"
    ]
    assert {"protocol": "TCP", "port": 7422} in [
        p for rule in policy["spec"]["ingress"] for p in rule.get("ports", [])
    ]
    # nats-server takes the rendered files, with real certificates where the Secret goes.
    tls = tmp_path / "tls"
    tls_files(trustme.CA(), tls, "nats.control.example.com")
    for name, text in data.items():
        (tmp_path / name).write_text(text.replace("/etc/nats/tls", str(tls)))
    routes_conf(tmp_path)
    nats_accepts(tmp_path / "nats.conf", {**PASSWORDS, "POD_NAME": "muster-nats-0"})


@needs_kubectl
def test_gpu_overlay_points_its_agent_at_a_leaf_node_with_mtls_out(tmp_path: Path) -> None:
    objs = kustomize("overlays/gpu-cluster")
    conf = configmap(objs, "muster-leaf-config")["nats.conf"]
    hubs = re.findall(r'"(tls://[^"]+)"', conf)
    assert hubs, "the leaf node's nats.conf names no tls:// control cluster URL"
    assert conf == render_leafnode("east", hubs), (
        "deploy/overlays/gpu-cluster/nats.conf is stale: regenerate it (deploy/README.md)"
    )
    (agent,) = [
        o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "muster-agent"
    ]
    args = agent["spec"]["template"]["spec"]["containers"][0]["args"]
    (url,) = [a for a in args if a.startswith("--nats=")]
    # The Service clients reach NATS through (the agent's report Service serves pods).
    (leaf_service,) = [
        o
        for o in objs
        if o["kind"] == "Service" and any(p["port"] == 4222 for p in o["spec"]["ports"])
    ]
    namespace = leaf_service["metadata"]["namespace"]
    name = leaf_service["metadata"]["name"]
    assert url == f"--nats=nats://{name}.{namespace}.svc:4222"
    (leaf,) = [
        o for o in objs if o["metadata"]["name"] == "muster-leaf" and o["kind"] == "Deployment"
    ]
    volumes = {v["name"]: v for v in leaf["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "muster-leaf-tls"
    tls = tmp_path / "tls"
    tls_files(trustme.CA(), tls, "muster-leaf-east")
    (tmp_path / "nats.conf").write_text(conf.replace("/etc/nats/tls", str(tls)))
    nats_accepts(tmp_path / "nats.conf", {"POD_NAME": "muster-leaf-0"})


def test_the_image_build_copies_every_package_the_wheel_holds() -> None:
    """`docker build -f deploy/Dockerfile .` installs the project from what it copies: a
    package missing there builds an image whose `muster` fails at import."""
    import tomllib

    root = DEPLOY.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in patterns}
    copied = {
        line.split()[1].rstrip("/")
        for line in (DEPLOY / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ")
    }
    assert packages <= copied, f"deploy/Dockerfile does not copy {sorted(packages - copied)}"
    assert "pyproject.toml" in copied
    for package in packages:
        assert (root / package / "__init__.py").exists(), package
