"""deploy/: every YAML parses; the agent's RBAC grants exactly the verbs the kube backend uses
(checked against agents/kube/rbac.py and against the requests the backend really makes); the
configs embedded in ConfigMaps load; NATS accepts nats.conf and enforces accounts.conf."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
import yaml
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from agents.config import convert_agent_config
from agents.kube.backend import KubeBackend
from agents.kube.client import KubeRest
from agents.kube.fence import lease_body, lease_collection
from agents.kube.rbac import (
    AUTOSCALING_CLUSTER_RULES,
    AUTOSCALING_NAMESPACE_RULES,
    CLUSTER_RULES,
    NAMESPACE_RULES,
    Rule,
)
from agents.kube.watchdog import FenceWatchdog, WatchdogConfig
from broker.config import parse_config
from broker.embedded import free_port, free_ports
from kinds.registry import watchdog_rules
from schemas import healthz
from schemas.agent import Dispatch, LogRequest, PodSetAssignment
from schemas.job import JobSpec
from shell.natsio import flush
from tests.kube.conftest import (
    AGENT_TOKEN,
    NODES,
    NS,
    Recorder,
    make_config,
    manifest_dispatch,
    node,
)
from tests.kube.deploy_tree import (
    NATS_BIN,
    PASSWORDS,
    all_docs,
    configmap_data,
    docs,
    nats_accepts,
    needs_nats,
    rbac_rules,
    routes_conf,
)
from tests.kube.elastic import SHRINKS, elastic_dispatch
from tests.kube.fake_apiserver import FakeApiServer, parse_path
from tests.kube.kuberay_model import KubeRay
from tests.kube.manifests import (
    BATCH_JOB_YAML,
    JOBSET_YAML,
    MPIJOB_YAML,
    PYTORCHJOB_YAML,
    TFJOB_YAML,
    VOLCANO_YAML,
)
from tests.kube.rbac_authz import AGENT_USER, WATCHDOG_USER
from tests.kube.validation import validate
from tests.support import DEPLOY, listening, wait_for


def test_every_yaml_parses_and_names_itself() -> None:
    found = all_docs()
    assert len(found) >= 15
    for path, d in found:
        assert isinstance(d, dict), path
        if d.get("kind") == "Kustomization":
            for res in d.get("resources", []):
                assert (path.parent / res).exists(), (path, res)
            for gen in d.get("configMapGenerator", []):
                for f in gen["files"]:
                    assert (path.parent / f).exists(), (path, f)
            continue
        assert d.get("apiVersion") and d.get("kind") and d["metadata"].get("name"), (path, d)


def test_optional_autoscaling_rbac_grants_what_the_pools_module_needs() -> None:
    assert rbac_rules("ClusterRole", "autoscaling") == AUTOSCALING_CLUSTER_RULES
    assert rbac_rules("Role", "autoscaling") == AUTOSCALING_NAMESPACE_RULES


def test_agent_rbac_matches_what_the_backend_needs() -> None:
    assert rbac_rules("ClusterRole", name="muster-agent") == CLUSTER_RULES
    # Granted per workload namespace by a RoleBinding (rbac.yaml, team-namespace.yaml).
    assert rbac_rules("ClusterRole", name="muster-agent-workloads") == NAMESPACE_RULES
    assert rbac_rules("Role") == set()
    bound = [
        d
        for p, d in all_docs()
        if p.name == "rbac.yaml" and d.get("kind") == "RoleBinding" and "agent" in p.parts[-2]
    ]
    agent_cfg = convert_agent_config(
        yaml.safe_load(configmap_data("muster-agent-config", "agent.yaml"))
    )
    ns = (agent_cfg.kube or {})["namespace"]
    assert bound and all(b["metadata"]["namespace"] == ns for b in bound)
    for _, d in all_docs():
        if d.get("kind") in ("RoleBinding", "ClusterRoleBinding") and d["roleRef"][
            "name"
        ].startswith("muster-agent"):
            assert d["subjects"] == [
                {"kind": "ServiceAccount", "name": "muster-agent", "namespace": "muster-system"}
            ]


def test_fence_watchdog_rbac_is_list_and_delete_of_workload_kinds() -> None:
    assert rbac_rules("Role", "fence-watchdog") == watchdog_rules()
    assert rbac_rules("ClusterRole", "fence-watchdog") == set()
    (binding,) = [
        d
        for _, d in all_docs()
        if d.get("kind") == "RoleBinding" and d["roleRef"]["name"] == "muster-fence-watchdog"
    ]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "muster-fence-watchdog", "namespace": "muster-system"}
    ]
    (deployment,) = [
        d for d in _kind("Deployment") if d["metadata"]["name"] == binding["roleRef"]["name"]
    ]
    pod_spec = deployment["spec"]["template"]["spec"]
    assert pod_spec["serviceAccountName"] == "muster-fence-watchdog"
    (container,) = pod_spec["containers"]
    assert container["args"][0] == "fence-watchdog" and "--in-cluster" in container["args"]
    # Deployed with the agent, whose config then fences every kind by the annotation.
    assert "watchdog.yaml" in docs(DEPLOY / "agent" / "kustomization.yaml")[0]["resources"]
    agent_cfg = yaml.safe_load(configmap_data("muster-agent-config", "agent.yaml"))
    assert agent_cfg["kube"]["fence_watchdog"] is True
    ns = agent_cfg["kube"]["namespace"]
    assert f"--namespace={ns}" in container["args"]


async def test_fence_watchdog_requests_are_within_its_rbac(
    apiserver: FakeApiServer, api_client: Any
) -> None:
    # The client plays the watchdog's service account: the stand-in enforces its own Role.
    apiserver.users[AGENT_TOKEN] = apiserver.default_user = WATCHDOG_USER
    watchdog = FenceWatchdog(KubeRest(api_client), WatchdogConfig(namespace=NS))
    await watchdog.sweep()  # no Lease: one read, nothing else
    apiserver.put(lease_collection(NS), lease_body(NS, "agent", 1_000.0, 60))  # long lapsed
    await watchdog.sweep()
    used = set()
    for method, path, query in apiserver.requests:
        route = parse_path(path)
        assert route is not None and route.namespace == NS, path
        group = route.res[0].rsplit("/", 1)[0] if "/" in route.res[0] else ""
        used.add(Rule(group, route.res[1], _verb(method, route.name, query)))
    assert used == {r for r in watchdog_rules() if r.verb in ("get", "list")}


def _verb(method: str, name: str | None, query: dict[str, str]) -> str:
    if method == "GET":
        if name is not None:
            return "get"
        return "watch" if query.get("watch") in ("true", "1") else "list"
    return {"POST": "create", "PATCH": "patch", "DELETE": "delete", "PUT": "update"}[method]


async def test_backend_requests_are_exactly_the_rbac_rules(
    apiserver: FakeApiServer, api_client: Any
) -> None:
    apiserver.put(NODES, node("n1"))
    apiserver.kuberay = KubeRay()  # a RayJob is resized in the RayCluster KubeRay makes
    backend = KubeBackend("c1", make_config(fence_watchdog=True), api_client=api_client)
    await backend.start(Recorder())
    gang = {
        "name": "x",
        "gang": [{"name": "worker", "replicas": 1}],
        "workload": {"image": "i", "command": ["c"]},
    }
    cmds = [
        Dispatch(
            job_id=f"{kind}-job",
            attempt=1,
            epoch=1,
            flavor="a100-spot",
            assignment=[PodSetAssignment(podset="worker", nodes=["n1"])],
            spec=msgspec.convert({**gang, "workload": {**gang["workload"], "kind": kind}}, JobSpec),
        )
        for kind in ("indexed-job", "pytorchjob")
    ]
    pod_manifest = (
        "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: c, image: i}]}"
    )
    texts = [
        PYTORCHJOB_YAML,
        MPIJOB_YAML,
        TFJOB_YAML,
        VOLCANO_YAML,
        JOBSET_YAML,
        BATCH_JOB_YAML,
        pod_manifest,
    ]
    examples = DEPLOY.parent / "examples" / "jobs"
    texts += [
        (examples / f).read_text() for f in ("rayjob.yaml", "raycluster.yaml", "trainjob.yaml")
    ]
    for other in ("XGBoostJob", "PaddleJob", "JAXJob"):
        texts.append(
            TFJOB_YAML.replace("TFJob", other).replace(
                "tfReplicaSpecs",
                {
                    "XGBoostJob": "xgbReplicaSpecs",
                    "PaddleJob": "paddleReplicaSpecs",
                    "JAXJob": "jaxReplicaSpecs",
                }[other],
            )
        )
    cmds += [manifest_dispatch(t, {}, job_id=f"m{i}", attempt=1) for i, t in enumerate(texts)]
    # Fenced: the first dispatch creates the cluster's Lease; renewals patch it (no workload
    # object is ever patched for the fence).
    cmds = [msgspec.structs.replace(c, fence_after_s=20.0) for c in cmds]
    for cmd in cmds:
        await backend.dispatch(cmd)
        await backend.fence(cmd.job_id, cmd.attempt, time.time() + 60)
    # A retried dispatch whose Job exists (409) reads the Job's uid for the Service it owns.
    apiserver.remove(f"/api/v1/namespaces/{NS}/services/indexed-job-job-a1")
    await backend.dispatch(cmds[0])
    assert apiserver.get(f"/api/v1/namespaces/{NS}/services/indexed-job-job-a1") is not None
    # A pod of one of them, so checkpoint_now has something to patch.
    job = apiserver.get(f"/apis/batch/v1/namespaces/{NS}/jobs/indexed-job-job-a1-worker")
    assert job is not None
    tmpl = job["spec"]["template"]
    apiserver.put(
        f"/api/v1/namespaces/{NS}/pods",
        {
            "metadata": {
                "name": "ij-0",
                **{k: tmpl["metadata"][k] for k in ("labels", "annotations")},
            },
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i"}]},
            "status": {"phase": "Running"},
        },
    )
    await Recorder().wait_for(lambda: backend.attempt_pods("indexed-job-job", 1))
    await backend.checkpoint_now("indexed-job-job", 1, 1.0)
    logs = await backend.read_logs(LogRequest(job_id="indexed-job-job", attempt=1))
    assert logs.lines == []
    # A running elastic attempt of each resizable kind takes a smaller replica count (patch).
    for i, (_, manifest, before, after) in enumerate(SHRINKS):
        grown = elastic_dispatch(manifest(), before, job_id=f"e{i}")
        await backend.dispatch(grown)
        await backend.resize(elastic_dispatch(manifest(), after, revision=1, job_id=f"e{i}"))
        cmds.append(grown)
    for cmd in cmds:
        await backend.cancel(cmd.job_id, None, "test")
    await backend.collect_garbage()
    await backend.stop()
    # Every write validated as a real server would, the TrainJob's runtimePatches included.
    assert apiserver.rejected == []
    assert any(m == "POST" and p.endswith("/trainjobs") for m, p, _ in apiserver.requests), (
        "the TrainJob example was not created"
    )

    # Every decision the enforcing stand-in took (requests and admission), none refused.
    assert apiserver.forbidden == []
    used_cluster: set[Rule] = set()
    used_ns: set[Rule] = set()
    for a in apiserver.authorizer.checked:
        assert a.user == AGENT_USER, a
        resource = f"{a.resource}/{a.subresource}" if a.subresource else a.resource
        rule = Rule(a.group, resource, a.verb)
        if not a.namespace:
            used_cluster.add(rule)
        else:
            assert a.namespace == NS, a
            if rule not in CLUSTER_RULES:
                used_ns.add(rule)
    # `get nodes` only follows a node leaving a selected watch (tests/kube/test_nodes.py).
    assert used_cluster == CLUSTER_RULES - {Rule("", "nodes", "get")}
    assert used_ns == NAMESPACE_RULES


def test_embedded_configs_load() -> None:
    loaded = parse_config(configmap_data("muster-broker-config", "broker.yaml"), source="deploy")
    assert {q.name for q in loaded.config.queues} >= {"default"}
    agent = convert_agent_config(
        yaml.safe_load(configmap_data("muster-agent-config", "agent.yaml"))
    )
    assert agent.backend == "kube"
    backend = KubeBackend.from_config(agent.cluster, agent.kube or {})
    assert backend.config.in_cluster and [f.name for f in backend.config.flavors] == [
        "a100-spot",
        "a100-on-demand",
    ]
    # The broker's flavor classes cover the agent's flavors.
    classes = {(f.capacity_type, f.gpu_type) for f in loaded.config.flavors}
    assert {(f.capacity_type, f.gpu_type) for f in backend.config.flavors} <= classes


def test_nats_conf_is_valid(tmp_path: Path) -> None:
    shutil.copy(DEPLOY / "nats" / "nats.conf", tmp_path)
    shutil.copy(DEPLOY / "nats" / "accounts.conf", tmp_path)
    shutil.copy(DEPLOY / "nats" / "leafnodes.conf", tmp_path)
    routes_conf(tmp_path)
    nats_accepts(tmp_path / "nats.conf", {**PASSWORDS, "POD_NAME": "muster-nats-0"})


@needs_nats
async def test_nats_permissions_enforced(tmp_path: Path) -> None:
    """A real nats-server with deploy/nats/accounts.conf on 127.0.0.1."""
    shutil.copy(DEPLOY / "nats" / "accounts.conf", tmp_path)
    port = free_port()
    (tmp_path / "test.conf").write_text(
        f"listen: 127.0.0.1:{port}\n"
        f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
        "include ./accounts.conf\n"
    )
    proc = await asyncio.create_subprocess_exec(
        str(NATS_BIN),
        "-c",
        str(tmp_path / "test.conf"),
        env={**os.environ, **PASSWORDS},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"nats://127.0.0.1:{port}"
    conns: list[Any] = []

    async def connect(user: str) -> Any:
        errors: list[Exception] = []

        async def on_error(e: Exception) -> None:
            errors.append(e)

        nc = await nats.connect(
            url,
            user=user,
            password=PASSWORDS[f"MUSTER_{user.upper().replace('-', '_')}_PASSWORD"],
            inbox_prefix=f"_INBOX_{user}",
            error_cb=on_error,
            allow_reconnect=False,
            connect_timeout=2,
        )
        nc.errors = errors  # type: ignore[attr-defined]
        conns.append(nc)
        return nc

    try:
        await listening(port)
        broker = await connect("broker")
        east = await connect("agent-east")
        client = await connect("team-research")
        seen: list[tuple[str, bytes]] = []

        async def record(msg: Any) -> None:
            seen.append((msg.subject, msg.data))

        await broker.subscribe("muster.>", cb=record)
        await flush(broker)
        await east.publish("muster.agent.east.events", b"ok")
        await east.publish("muster.checkpoint_request.job-1", b"no: requests go to pods")
        await east.publish("muster.agent.west.events", b"spoof")
        await east.publish("muster.submit.default", b"nope")
        await client.publish("muster.submit.default", b"{}")
        await client.publish("muster.agent.east.cmd", b"nope")
        # Last, from each publisher, a message it may send. NATS keeps one publisher's order,
        # so once both have arrived, a refused message that got through would have too.
        await east.publish("muster.agent.east.events", b"end")
        await client.publish("muster.submit.default", b"end")
        for c in (east, client):
            await flush(c)
        await wait_for(lambda: [d for _, d in seen].count(b"end") == 2, what="both end markers")
        assert sorted(s for s, d in seen if d != b"end") == [
            "muster.agent.east.events",
            "muster.submit.default",
        ]
        # Commands: the broker asks, the agent answers (allow_responses), nobody else hears.
        west_sub_seen: list[str] = []

        async def answer(msg: Any) -> None:
            await msg.respond(b"ack")

        async def on_west(msg: Any) -> None:
            west_sub_seen.append(msg.subject)

        await east.subscribe("muster.agent.east.cmd", cb=answer)
        await east.subscribe("muster.agent.west.cmd", cb=on_west)  # not allowed: never delivers
        await flush(east)
        reply = await broker.request("muster.agent.east.cmd", b"dispatch", timeout=5)
        assert reply.data == b"ack"
        with pytest.raises((NatsTimeout, NoRespondersError)):
            await broker.request("muster.agent.west.cmd", b"dispatch", timeout=0.3)
        assert not west_sub_seen

        # Logs: a team may not ask an agent itself; the broker forwards its request (after the
        # ownership check) with the team's reply subject, and the agent streams chunks there.
        asked: list[bytes] = []

        async def stream(msg: Any) -> None:
            asked.append(msg.data)
            for part in (b"chunk-0", b"chunk-1", b"eof"):
                await east.publish(msg.reply, part)

        await east.subscribe("muster.agent.east.logs", cb=stream)
        await flush(east)
        inbox = client.new_inbox()
        chunks = await client.subscribe(inbox)
        await client.publish("muster.agent.east.logs", b"direct", reply=inbox)
        await flush(client)
        await broker.publish("muster.agent.east.logs", b"forwarded", reply=inbox)
        got = [(await chunks.next_msg(timeout=5)).data for _ in range(3)]
        assert got == [b"chunk-0", b"chunk-1", b"eof"]
        assert asked == [b"forwarded"]
        # The broker can use JetStream (submit stream, KV buckets) under its permissions.
        js = broker.jetstream()
        await js.add_stream(name="MUSTER_SUBMIT", subjects=["muster.submit.*"])
        kv = await js.create_key_value(bucket="MUSTER_JOBS")
        await kv.put("job-1", b"x")
        assert (await kv.get("job-1")).value == b"x"
    finally:
        for c in conns:
            await c.close()
        proc.terminate()
        await asyncio.wait_for(proc.wait(), timeout=10)


def _kind(kind: str) -> list[dict[str, Any]]:
    return [d for _, d in all_docs() if d.get("kind") == kind]


def test_every_kubernetes_object_validates_against_the_api_schema() -> None:
    for path, d in all_docs():
        if d.get("kind") == "Kustomization":
            continue
        assert validate(d) == [], path


def test_deployments_probe_the_health_endpoint_they_serve() -> None:
    deployments = _kind("Deployment")
    assert {d["metadata"]["name"] for d in deployments} >= {
        "muster-agent",
        "muster-broker-a",
        "muster-broker-b",
    }
    for d in deployments:
        (c,) = d["spec"]["template"]["spec"]["containers"]
        if not c["image"].startswith("muster:"):
            continue  # a NATS leaf node: probed on its own monitoring port
        env = {e["name"]: e.get("value") for e in c["env"]}
        port = env[healthz.ENV_PORT]
        for probe, path in (("livenessProbe", "/livez"), ("readinessProbe", "/readyz")):
            cmd = c[probe]["exec"]["command"]
            assert cmd[:3] == ["python", "-m", "schemas.healthz"], d["metadata"]["name"]
            assert cmd[cmd.index("--port") + 1] == port and cmd[cmd.index("--path") + 1] == path


def test_agent_priority_class_is_muster_own() -> None:
    (agent,) = [d for d in _kind("Deployment") if d["metadata"]["name"] == "muster-agent"]
    name = agent["spec"]["template"]["spec"]["priorityClassName"]
    assert not name.startswith("system-")
    assert name in {pc["metadata"]["name"] for pc in _kind("PriorityClass")}
    kustomization = docs(DEPLOY / "agent" / "kustomization.yaml")[0]
    assert "priorityclass.yaml" in kustomization["resources"]


def test_network_policy_limits_routes_to_the_nats_pods() -> None:
    policies = [p for p in _kind("NetworkPolicy") if p["metadata"]["namespace"] == "muster-system"]
    deny = [p for p in policies if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")]
    assert deny, "a default-deny ingress policy"
    (nats_policy,) = [p for p in policies if p["metadata"]["name"] == "muster-nats"]
    for rule in nats_policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule["ports"]}
        if 6222 in ports:
            assert rule["from"] == [{"podSelector": nats_policy["spec"]["podSelector"]}]
    assert (
        "networkpolicy.yaml"
        in docs(DEPLOY / "control-plane" / "kustomization.yaml")[0]["resources"]
    )


def test_workload_namespace_enforces_pod_security_baseline() -> None:
    (ns,) = [n for n in _kind("Namespace") if n["metadata"]["name"] == "muster-workloads"]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "baseline"


def test_the_fabric_namespace_lets_ipc_lock_in_and_still_warns_at_baseline() -> None:
    """Pod Security has no level between baseline (which refuses IPC_LOCK) and privileged: the
    optional fabric namespace enforces privileged, warns and audits at baseline, is bound to
    the agent, and is not applied unless asked for."""
    (ns,) = [n for n in _kind("Namespace") if n["metadata"]["name"] == "muster-fabric"]
    labels = ns["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert labels["pod-security.kubernetes.io/warn"] == "baseline"
    assert labels["pod-security.kubernetes.io/audit"] == "baseline"
    (rb,) = [b for b in _kind("RoleBinding") if b["metadata"]["namespace"] == "muster-fabric"]
    assert rb["roleRef"]["name"] == "muster-agent-workloads"
    kustomization = docs(DEPLOY / "agent" / "kustomization.yaml")[0]
    assert not any("fabric" in r for r in kustomization["resources"])


@needs_nats
async def test_nats_routes_need_the_route_credentials(tmp_path: Path) -> None:
    """Two real nats-servers on 127.0.0.1 with route authorization as in routes.conf: the
    right password forms the route; a peer with another is refused (and no route forms)."""

    def conf(d: Path, ports: list[int], peer: int, password: str) -> Path:
        client, http, cluster = ports
        d.mkdir()
        (d / "s.conf").write_text(
            f"server_name: {d.name}\nlisten: 127.0.0.1:{client}\nhttp: 127.0.0.1:{http}\n"
            f"cluster {{\n name: muster\n listen: 127.0.0.1:{cluster}\n"
            f'  authorization {{ user: route, password: "{password}", timeout: 2 }}\n'
            f"  routes: [nats://route:{password}@127.0.0.1:{peer}]\n}}\n"
        )
        return d / "s.conf"

    def routes(http: int) -> int:
        import json
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{http}/routez", timeout=2) as r:
            return int(json.load(r)["num_routes"])

    async def run(tag: str, password_b: str) -> tuple[int, str]:
        ports = free_ports(6)  # distinct: found together
        http_a, cl_a, cl_b = ports[1], ports[2], ports[5]
        a = conf(tmp_path / f"a-{tag}", ports[:3], cl_b, "right")
        b = conf(tmp_path / f"b-{tag}", ports[3:], cl_a, password_b)
        pa = await asyncio.create_subprocess_exec(
            str(NATS_BIN), "-c", str(a), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        pb = await asyncio.create_subprocess_exec(
            str(NATS_BIN), "-c", str(b), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        lines: list[str] = []

        async def read_log() -> None:
            # One reader drains A's log for the whole run: no line is lost to a timed-out read.
            assert pa.stderr is not None
            async for raw in pa.stderr:
                lines.append(raw.decode(errors="replace"))

        reader = asyncio.create_task(read_log())
        try:

            async def settled() -> bool:
                if any("Authentication Failure" in line for line in lines):
                    return True
                try:
                    return await asyncio.to_thread(routes, http_a) > 0  # route pooling: >= 1
                except OSError:
                    return False

            # Either outcome comes in seconds; the bound is for a broken run.
            await wait_for(settled, 60, what="a route or a refused one", interval=0.05)
            return await asyncio.to_thread(routes, http_a), "".join(lines)
        finally:
            for p in (pa, pb):
                p.terminate()
                await p.wait()
            await reader

    count, _ = await run("ok", "right")
    assert count > 0
    count, log = await run("bad", "wrong")
    assert count == 0 and "Authentication Failure" in log, log[-2000:]
