"""Every object the agent writes, for every kind x example job x flavor x placement, is one a
real API server accepts (tests/kube/validation.py: the OpenAPI schema of the pinned Kubernetes
version, the vendored CRDs, and the semantic rules), and the adapters agree with the broker on
podset names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from agents.kube.config import FlavorConfig, Toleration, build_workload
from broker.manifests import load_job_document
from kinds import ADAPTERS, OWNED_RESOURCES, adapter_of
from kinds.base import KindError
from kinds.pods import PodPolicy, check_safety
from schemas.agent import Dispatch, PodSetAssignment
from schemas.job import JobSpec
from tests.kube.validation import crd_schemas, validate

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples" / "jobs").glob("*.yaml"))
FIXTURES = sorted((ROOT / "tests" / "cli" / "fixtures").glob("*.yaml"))
NS = "muster-workloads"

SPOT = FlavorConfig(
    name="a100-spot",
    capacity_type="spot",
    node_labels={"kubernetes.azure.com/scalesetpriority": "spot", "pool": "a100"},
    tolerations=[
        Toleration(
            key="kubernetes.azure.com/scalesetpriority",
            operator="Equal",
            value="spot",
            effect="NoSchedule",
        ),
        Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule"),
    ],
)
ON_DEMAND = FlavorConfig(
    name="a100-od",
    capacity_type="on-demand",
    node_labels={"pool": "a100-od"},
    termination_grace_period_s=300,
)


def _job_files() -> list[Path]:
    out = list(EXAMPLES)
    for path in FIXTURES:
        docs = list(yaml.safe_load_all(path.read_text()))
        try:
            if len(docs) == 1:
                adapter_of(docs[0])
                out.append(path)
        except KindError:
            continue  # queues, quotas and pod groups are not jobs
    return out


def _spec(path: Path) -> JobSpec:
    return load_job_document(path.read_text(), source=path.name)


def _placement(spec: JobSpec, how: str) -> list[PodSetAssignment]:
    """single: the whole gang on one node; multi: every replica on its own node; packed:
    two replicas per node."""
    out = []
    n = 0
    for ps in spec.gang:
        nodes = []
        for _ in range(ps.replicas):
            if how == "single":
                nodes.append("node-0")
            elif how == "multi":
                nodes.append(f"node-{n}")
            else:
                nodes.append(f"node-{n // 2}")
            n += 1
        out.append(PodSetAssignment(podset=ps.name, nodes=nodes))
    return out


def _dispatches(path: Path, how: str) -> list[Dispatch]:
    spec = _spec(path)
    specs = [spec]
    if spec.workload.kind != "manifest":
        # a Muster JobSpec: both Muster-built kinds
        specs = [
            msgspec.structs.replace(
                spec, workload=msgspec.structs.replace(spec.workload, kind=kind)
            )
            for kind in ("indexed-job", "pytorchjob")
        ]
    return [
        Dispatch(
            job_id="Job_Id-with.odd-chars-",
            attempt=3,
            epoch=1,
            flavor="f",
            assignment=_placement(s, how),
            spec=s,
        )
        for s in specs
    ]


@pytest.mark.parametrize("flavor", [SPOT, ON_DEMAND], ids=["spot", "on-demand"])
@pytest.mark.parametrize("how", ["single", "multi", "packed"])
@pytest.mark.parametrize("path", _job_files(), ids=lambda p: p.name)
def test_every_generated_object_validates(path: Path, how: str, flavor: FlavorConfig) -> None:
    for cmd in _dispatches(path, how):
        plan = build_workload(cmd, flavor, NS)
        assert plan.objects
        for obj in plan.objects:
            assert validate(obj.body) == [], (obj.resource.kind, obj.name)
            templates = adapter_of(obj.body).patch_templates(obj.body) if _is_job(obj.body) else []
            for t in templates:
                if t.replicas == 0:
                    continue
                spec = t.template["spec"]
                tolerations = spec.get("tolerations") or []
                for tol in flavor.tolerations:
                    assert tol.to_k8s() in tolerations
                ann = t.template["metadata"]["annotations"]
                assert ann["karpenter.sh/do-not-disrupt"] == "true"
                assert ann["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
                labels = t.template["metadata"]["labels"]
                assert not [k for k in labels if k.startswith("kueue.x-k8s.io/")]
                grace = spec.get("terminationGracePeriodSeconds")
                assert grace == (120 if flavor is SPOT else 300)
        top = plan.objects[-1].body
        assert not [k for k in top["metadata"]["labels"] if k.startswith("kueue.x-k8s.io/")]


def _is_job(body: dict[str, Any]) -> bool:
    try:
        adapter_of(body)
    except KindError:
        return False
    return body.get("kind") != "Service"


@pytest.mark.parametrize("path", _job_files(), ids=lambda p: p.name)
def test_broker_and_agent_name_the_same_podsets(path: Path) -> None:
    spec = _spec(path)
    if spec.workload.kind != "manifest":
        return
    (cmd,) = _dispatches(path, "multi")
    plan = build_workload(cmd, SPOT, NS)
    with_pods = [p.name for p in spec.gang]
    assert set(with_pods) <= set(plan.podsets)
    # every pod template is pinned to the nodes of its podset (and of podsets of its shape)
    by_podset = {a.podset: set(a.nodes) for a in cmd.assignment}
    gang_nodes = {n for a in cmd.assignment for n in a.nodes}
    body = plan.objects[-1].body
    for t in adapter_of(body).patch_templates(body):
        if t.replicas == 0:
            continue
        terms = t.template["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"]
        pinned = {f["values"][0] for term in terms for f in term["matchFields"]}
        assert by_podset[t.podset] <= pinned <= gang_nodes


def test_every_custom_kind_has_a_vendored_crd() -> None:
    served = set(crd_schemas())
    for r in OWNED_RESOURCES:
        if "/" in r.api_version and r.group not in ("batch",):
            assert (r.api_version, r.kind) in served, r


def test_every_adapter_documents_itself() -> None:
    for a in ADAPTERS:
        assert a.podsets_doc and a.retries_doc and a.verdict_doc, a.resource


@pytest.mark.parametrize(
    ("patch", "problem"),
    [
        ({"hostNetwork": True}, "hostNetwork"),
        ({"hostPID": True}, "hostPID"),
        ({"serviceAccountName": "cluster-admin-sa"}, "serviceAccountName"),
        ({"volumes": [{"name": "h", "hostPath": {"path": "/"}}]}, "hostPath"),
        (
            {"containers": [{"name": "c", "image": "i", "securityContext": {"privileged": True}}]},
            "privileged",
        ),
    ],
)
def test_unsafe_workloads_are_refused_with_the_field(patch: dict[str, Any], problem: str) -> None:
    manifest = yaml.safe_load((ROOT / "examples" / "jobs" / "indexed-job.yaml").read_text())
    manifest["spec"]["template"]["spec"].update(patch)
    with pytest.raises(KindError, match=problem):
        check_safety(manifest, PodPolicy())
    allowed = PodPolicy(service_accounts=frozenset({"default", "cluster-admin-sa"}))
    if problem == "serviceAccountName":
        check_safety(manifest, allowed)


def _with_capabilities(*add: str) -> dict[str, Any]:
    manifest = yaml.safe_load((ROOT / "examples" / "jobs" / "indexed-job.yaml").read_text())
    spec = manifest["spec"]["template"]["spec"]
    spec["containers"][0]["securityContext"] = {"capabilities": {"add": list(add)}}
    return manifest


def test_ipc_lock_for_efa_and_rdma_is_allowed_and_other_capabilities_are_refused() -> None:
    check_safety(_with_capabilities("IPC_LOCK", "NET_BIND_SERVICE"), PodPolicy())
    check_safety(_with_capabilities("CAP_IPC_LOCK"), PodPolicy())
    for cap in ("SYS_ADMIN", "NET_ADMIN", "SYS_RESOURCE", "ALL"):
        with pytest.raises(KindError, match=f"capabilities.add: {cap} not allowed"):
            check_safety(_with_capabilities("IPC_LOCK", cap), PodPolicy())


def test_the_kinds_page_shows_the_adapters_table() -> None:
    from kinds.registry import markdown_table

    assert markdown_table() in (ROOT / "docs" / "kinds.md").read_text()


def test_the_broker_refuses_unsafe_or_unschedulable_manifests_at_submission() -> None:
    from broker.manifests import ManifestError, jobspec_from_manifest

    manifest = yaml.safe_load((ROOT / "examples" / "jobs" / "jobset.yaml").read_text())
    pod_spec = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod_spec["hostNetwork"] = True
    with pytest.raises(ManifestError, match=r"template\.spec\.hostNetwork"):
        jobspec_from_manifest(manifest)
    del pod_spec["hostNetwork"]
    pod_spec["serviceAccountName"] = (
        "trainer"  # the broker config decides (workload_service_accounts)
    )
    assert jobspec_from_manifest(manifest).total_replicas == 2
    pod_spec["containers"][0]["resources"]["limits"] = {"google.com/tpu": 4}
    with pytest.raises(
        ManifestError, match=r"google\.com/tpu is not a resource any cluster offers"
    ):
        jobspec_from_manifest(manifest)


def test_the_vendored_core_schema_is_cut_from_the_pinned_kubernetes() -> None:
    """kinds/crds/core-v1.33.json is what kinds.schema.core_subset cuts from the installed
    kubernetes-validate schema of the same Kubernetes version the stand-in server uses."""
    from importlib import resources

    from kinds.schema import CORE_SCHEMA, KUBE_VERSION, core_subset
    from tests.kube.validation import KUBE_VERSION as SERVER_VERSION

    assert KUBE_VERSION == SERVER_VERSION
    root = resources.files("kubernetes_validate") / "kubernetes-json-schema"
    source = root / f"v{KUBE_VERSION}.0-local-strict" / "_definitions.json"
    expected = core_subset(json.loads(source.read_text())["$defs"])
    assert json.loads(CORE_SCHEMA.read_text()) == expected


def test_the_broker_finds_the_served_schema_of_every_custom_kind() -> None:
    from kinds.schema import crd_schema

    for adapter in ADAPTERS:
        r = adapter.resource
        if r.group in ("", "batch"):
            continue
        assert crd_schema(r.api_version, r.kind, r.plural) == crd_schemas()[(r.api_version, r.kind)]


@pytest.mark.parametrize("path", [p for p in FIXTURES if "pytorchjob" in p.name])
def test_what_the_broker_refuses_for_a_typo_a_real_server_refuses(path: Path) -> None:
    """The broker's strict check and the stand-in API server's agree on a misspelt field."""
    manifest = yaml.safe_load(path.read_text())
    for spec in manifest["spec"]["pytorchReplicaSpecs"].values():
        spec["replica"] = spec.pop("replicas", 1)
    assert any("replica" in c for c in validate(manifest))
    with pytest.raises(ValueError, match=r"\.replica: unknown field; did you mean 'replicas'"):
        load_job_document(json.dumps(manifest))
