"""The pure workload builders: env, placement, labels and tolerations for every kind, using
the PyTorchJob / MPIJob / TFJob / Volcano Job YAML of the seed documents as inputs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agents.kube.config import build_workload
from kinds.base import (
    ANN_JOB,
    ANN_LEADER,
    ANN_TOTAL,
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_PODSET,
    LABEL_SPREAD,
    SERVICE,
)
from kinds.base import KindError as ManifestError
from kinds.batch import BATCH_JOB
from kinds.plan import child_name, workload_name
from kinds.pods import label_value
from schemas.agent import CheckpointRef
from tests.kube.conftest import dispatch, make_config, manifest_dispatch
from tests.kube.manifests import (
    BATCH_JOB_YAML,
    FLAVOR,
    JOBSET_YAML,
    MPIJOB_YAML,
    NS,
    PYTORCHJOB_YAML,
    TFJOB_YAML,
    VOLCANO_YAML,
    templates_of,
)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def assert_muster_pod(template: dict[str, Any], job_id: str, attempt: int, podset: str) -> None:
    labels = template["metadata"]["labels"]
    assert labels[LABEL_JOB] == label_value(job_id)
    assert labels[LABEL_ATTEMPT] == str(attempt)
    assert labels[LABEL_PODSET] == podset
    assert template["metadata"]["annotations"][ANN_JOB] == job_id
    spec = template["spec"]
    assert spec["nodeSelector"]["pool"] == "a100"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    for c in spec["containers"] + spec.get("initContainers", []):
        env = env_of(c)
        assert env["MUSTER_JOB_ID"] == job_id
        assert env["MUSTER_ATTEMPT"] == str(attempt)
        assert "MUSTER_CHECKPOINT_URI" in env and "MUSTER_RESUME_FROM" in env


def node_fields(template: dict[str, Any]) -> list[list[str]]:
    """The nodes each user term is pinned to: terms are one per (user term, node), each with
    exactly one `metadata.name` value (the API server allows no more)."""
    terms = template["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    groups: dict[str, list[str]] = {}
    for t in terms:
        pins = [f for f in t["matchFields"] if f["key"] == "metadata.name"]
        assert len(pins) == 1 and len(pins[0]["values"]) == 1
        rest = {**t, "matchFields": [f for f in t["matchFields"] if f not in pins]}
        groups.setdefault(json.dumps(rest, sort_keys=True), []).extend(pins[0]["values"])
    return [sorted(v) for v in groups.values()]


def test_names_are_dns_safe() -> None:
    assert workload_name("job-1", 2) == "job-1-a2"
    odd = workload_name("Job_With_CAPS-", 3)
    assert odd.endswith("-a3") and odd[0].isalpha() and odd == odd.lower() and len(odd) <= 40
    assert workload_name("7" * 63, 1)[0] == "j"
    assert len(child_name("x" * 40, "y" * 63)) <= 52
    assert label_value("abc-") != "abc-" and label_value("abc") == "abc"


def test_indexed_job_env_placement_labels() -> None:
    spec = {
        "name": "ddp",
        "job_id": "job-1",
        "checkpoint": {"uri": "s3://bucket/job-1"},
        "gang": [
            {"name": "master", "replicas": 1, "gpu": 8},
            {"name": "worker", "replicas": 3, "gpu": 8},
        ],
        "workload": {"image": "trainer:1", "command": ["torchrun", "train.py"], "port": 23456},
    }
    cmd = dispatch(
        spec,
        {"master": ["n0"], "worker": ["n1", "n2", "n3"]},
        resume_from=CheckpointRef(step=400, uri="s3://bucket/job-1/step-400"),
    )
    plan = build_workload(cmd, FLAVOR, NS)
    kinds = [o.resource for o in plan.objects]
    assert kinds == [BATCH_JOB, SERVICE, BATCH_JOB]
    assert plan.total_replicas == 4
    svc = plan.objects[1].body
    assert svc["spec"]["clusterIP"] == "None" and svc["metadata"]["name"] == "job-1-a2"
    master, worker = plan.objects[0].body, plan.objects[2].body
    assert plan.objects[1].owner == master["metadata"]["name"]  # created after its owner
    assert master["spec"]["completionMode"] == "Indexed"
    assert (worker["spec"]["completions"], worker["spec"]["parallelism"]) == (3, 3)
    assert worker["spec"]["backoffLimit"] == 0
    assert master["metadata"]["annotations"][ANN_TOTAL] == "4"
    mt = master["spec"]["template"]
    wt = worker["spec"]["template"]
    assert_muster_pod(mt, "job-1", 2, "master")
    assert_muster_pod(wt, "job-1", 2, "worker")
    assert mt["spec"]["subdomain"] == "job-1-a2"
    menv = env_of(mt["spec"]["containers"][0])
    wenv = env_of(wt["spec"]["containers"][0])
    assert menv["WORLD_SIZE"] == "4" and wenv["WORLD_SIZE"] == "4"
    assert menv["MASTER_ADDR"] == "job-1-a2-master-0.job-1-a2" == wenv["MASTER_ADDR"]
    assert menv["MASTER_PORT"] == "23456" and menv["LOCAL_RANK"] == "0"
    assert menv["RANK"] == {
        "fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        }
    }
    assert menv["MUSTER_RESUME_FROM"] == "s3://bucket/job-1/step-400"
    assert menv["MUSTER_RESUME_STEP"] == "400"
    assert menv["MUSTER_CHECKPOINT_URI"] == "s3://bucket/job-1"
    # Workers: RANK = offset + index through a shell wrapper around the user's command.
    assert wenv["MUSTER_RANK_OFFSET"] == "1" and "RANK" not in wenv
    wc = wt["spec"]["containers"][0]
    assert wc["command"][:2] == ["/bin/sh", "-c"] and wc["args"] == ["torchrun", "train.py"]
    assert wc["resources"]["limits"]["nvidia.com/gpu"] == "8"
    # Placement: master and workers ask for the same resources, so they are one class pinned
    # to the class's nodes, one pod per node (all distinct): exactly the broker's 4 nodes.
    assert node_fields(mt) == [["n0", "n1", "n2", "n3"]] == node_fields(wt)
    for t in (mt, wt):
        anti = t["spec"]["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
        assert anti[0]["labelSelector"]["matchLabels"][LABEL_SPREAD] == "master"
        assert t["metadata"]["labels"][LABEL_SPREAD] == "master"


def test_indexed_job_shared_nodes_have_no_anti_affinity() -> None:
    spec = {
        "name": "small",
        "gang": [{"name": "worker", "replicas": 2, "gpu": 4}],
        "workload": {"image": "t:1"},
    }
    plan = build_workload(dispatch(spec, {"worker": ["n1", "n1"]}), FLAVOR, NS)
    wt = plan.objects[0].body["spec"]["template"]
    assert node_fields(wt) == [["n1"]]
    assert "podAntiAffinity" not in wt["spec"]["affinity"]


def test_indexed_job_errors() -> None:
    no_cmd = {
        "name": "x",
        "gang": [{"name": "a", "replicas": 1}, {"name": "b", "replicas": 1}],
        "workload": {"image": "t:1"},
    }
    with pytest.raises(ManifestError, match=r"workload\.command"):
        build_workload(dispatch(no_cmd, {"a": ["n1"], "b": ["n2"]}), FLAVOR, NS)
    no_image = {"name": "x", "gang": [{"name": "a"}]}
    with pytest.raises(ManifestError, match=r"workload\.image"):
        build_workload(dispatch(no_image, {"a": ["n1"]}), FLAVOR, NS)
    wrong_count = {"name": "x", "gang": [{"name": "a", "replicas": 2}], "workload": {"image": "t"}}
    with pytest.raises(ManifestError, match="assignment"):
        build_workload(dispatch(wrong_count, {"a": ["n1"]}), FLAVOR, NS)


def test_pytorchjob_from_gang() -> None:
    spec = {
        "name": "pt",
        "job_id": "pt-7",
        "gang": [{"name": "worker", "replicas": 3, "gpu": 8}],
        "workload": {"kind": "pytorchjob", "image": "trainer:1", "command": ["python", "t.py"]},
    }
    plan = build_workload(dispatch(spec, {"worker": ["n1", "n2", "n3"]}), FLAVOR, NS)
    (obj,) = plan.objects
    body = obj.body
    assert body["kind"] == "PyTorchJob" and body["apiVersion"] == "kubeflow.org/v1"
    assert body["metadata"]["namespace"] == NS
    assert body["spec"]["runPolicy"]["backoffLimit"] == 0
    rs = body["spec"]["pytorchReplicaSpecs"]
    assert rs["Master"]["replicas"] == 1 and rs["Worker"]["replicas"] == 2
    mt, wt = rs["Master"]["template"], rs["Worker"]["template"]
    assert mt["spec"]["containers"][0]["name"] == "pytorch"
    assert_muster_pod(mt, "pt-7", 2, "worker")
    assert_muster_pod(wt, "pt-7", 2, "worker")
    assert mt["metadata"]["annotations"][ANN_LEADER] == "true"
    assert wt["metadata"]["annotations"][ANN_LEADER] == "false"
    # Both roles of the one podset are pinned to all its nodes, and spread over them together
    # (an anti-affinity matching the Master too), so no Worker waits for the Master's node.
    assert node_fields(mt) == [["n1", "n2", "n3"]] == node_fields(wt)
    for t in (mt, wt):
        (anti,) = t["spec"]["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert anti["labelSelector"]["matchLabels"][LABEL_SPREAD] == "worker"
    with pytest.raises(ManifestError, match="pytorchjob"):
        bad = {**spec, "gang": [{"name": "a", "replicas": 2}, {"name": "b", "replicas": 2}]}
        build_workload(dispatch(bad, {"a": ["n1", "n2"], "b": ["n3", "n4"]}), FLAVOR, NS)


def test_manifest_pytorchjob_patched_keeps_user_fields() -> None:
    cmd = manifest_dispatch(PYTORCHJOB_YAML, {"master": ["n1"], "worker": ["n2", "n3"]})
    plan = build_workload(cmd, FLAVOR, NS)
    body = plan.objects[0].body
    assert plan.total_replicas == 3
    assert body["metadata"]["name"] == "m-1-a5" and body["metadata"]["namespace"] == NS
    assert body["metadata"]["annotations"]["muster.dev/original-name"] == "pytorch-ddp-mnist"
    assert body["spec"]["runPolicy"]["backoffLimit"] == 0
    mt, wt = templates_of(body)
    assert_muster_pod(mt, "m-1", 5, "master")
    assert_muster_pod(wt, "m-1", 5, "worker")
    assert mt["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    assert mt["metadata"]["annotations"][ANN_LEADER] == "true"
    menv = env_of(mt["spec"]["containers"][0])
    assert menv["NCCL_DEBUG"] == "INFO"  # the user's env stays
    assert mt["spec"]["containers"][0]["command"][0] == "torchrun"
    # The user's zone requirement still holds, ANDed with the assigned nodes.
    term = wt["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ][0]
    assert term["matchExpressions"][0]["key"] == "topology.kubernetes.io/zone"
    assert node_fields(wt) == [["n1", "n2", "n3"]] == node_fields(mt)  # one class, same shape
    # The original manifest in the command is not mutated.
    assert (
        "nodeSelector"
        not in cmd.spec.workload.manifest["spec"]["pytorchReplicaSpecs"]["Master"][  # type: ignore[index]
            "template"
        ]["spec"]
    )


def test_manifest_mpijob() -> None:
    plan = build_workload(
        manifest_dispatch(MPIJOB_YAML, {"launcher": ["n0"], "worker": ["n1", "n2", "n3", "n4"]}),
        FLAVOR,
        NS,
    )
    body = plan.objects[0].body
    assert plan.objects[0].resource.plural == "mpijobs"
    assert plan.total_replicas == 5
    lt, wt = templates_of(body)
    assert_muster_pod(lt, "m-1", 5, "launcher")
    assert_muster_pod(wt, "m-1", 5, "worker")
    assert lt["metadata"]["annotations"][ANN_LEADER] == "true"
    assert node_fields(wt) == [["n1", "n2", "n3", "n4"]]


def test_manifest_tfjob_and_volcano_and_jobset_and_batch_job() -> None:
    tf = build_workload(
        manifest_dispatch(TFJOB_YAML, {"ps": ["c1", "c2"], "worker": ["n1", "n2", "n3", "n4"]}),
        FLAVOR,
        NS,
    )
    assert tf.objects[0].resource.plural == "tfjobs" and tf.total_replicas == 6
    ps_t, _ = templates_of(tf.objects[0].body)
    assert_muster_pod(ps_t, "m-1", 5, "ps")
    assert node_fields(ps_t) == [["c1", "c2"]]

    vc = build_workload(
        manifest_dispatch(VOLCANO_YAML, {"master": ["n0"], "worker": ["n1", "n2", "n3", "n4"]}),
        FLAVOR,
        NS,
    )
    body = vc.objects[0].body
    assert vc.objects[0].resource.api_version == "batch.volcano.sh/v1alpha1"
    # Volcano's webhook turns maxRetry 0 into 3: retries are off through AbortJob policies.
    assert "maxRetry" not in body["spec"] and body["spec"]["queue"] == "ml-research-queue"
    aborts = [
        {"event": "PodFailed", "action": "AbortJob"},
        {"event": "PodEvicted", "action": "AbortJob"},
    ]
    assert body["spec"]["policies"] == aborts
    assert all(task["policies"] == aborts for task in body["spec"]["tasks"])
    _, wt = templates_of(body)
    assert_muster_pod(wt, "m-1", 5, "worker")
    assert wt["spec"]["restartPolicy"] == "Never"

    js = build_workload(
        manifest_dispatch(JOBSET_YAML, {"workers": ["a", "b", "c", "d"]}), FLAVOR, NS
    )
    assert (
        js.total_replicas == 4 and js.objects[0].body["spec"]["failurePolicy"]["maxRestarts"] == 0
    )
    (t,) = templates_of(js.objects[0].body)
    assert_muster_pod(t, "m-1", 5, "workers")

    bj = build_workload(manifest_dispatch(BATCH_JOB_YAML, {"solo": ["n9"]}), FLAVOR, NS)
    assert bj.objects[0].body["spec"]["backoffLimit"] == 0
    (t,) = templates_of(bj.objects[0].body)
    assert_muster_pod(t, "m-1", 5, "worker")
    assert node_fields(t) == [["n9"]]  # the only podset maps to the only template

    pod_yaml = "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: c}]}"
    pp = build_workload(manifest_dispatch(pod_yaml, {"pod": ["n5"]}), FLAVOR, NS)
    body = pp.objects[0].body
    assert pp.objects[0].resource.plural == "pods" and pp.total_replicas == 1
    assert (
        body["metadata"]["name"] == "m-1-a5" and body["metadata"]["labels"][LABEL_PODSET] == "pod"
    )
    assert_muster_pod(body, "m-1", 5, "pod")
    assert node_fields(body) == [["n5"]]


def test_manifest_unmatched_podsets_use_all_nodes_and_bad_manifests_fail() -> None:
    cmd = manifest_dispatch(MPIJOB_YAML, {"a": ["n1"], "b": ["n2", "n3", "n4", "n5"]})
    plan = build_workload(cmd, FLAVOR, NS)
    for t in templates_of(plan.objects[0].body):
        assert node_fields(t) == [["n1", "n2", "n3", "n4", "n5"]]
        assert "podAntiAffinity" not in t["spec"]["affinity"]
    with pytest.raises(ManifestError, match="not a job kind Muster can run"):
        build_workload(
            manifest_dispatch("apiVersion: apps/v1\nkind: Deployment\nspec: {}", {}), FLAVOR, NS
        )
    with pytest.raises(ManifestError, match="replicas"):
        bad = VOLCANO_YAML.replace("replicas: 4", "replicas: lots")
        build_workload(manifest_dispatch(bad, {}), FLAVOR, NS)
    with pytest.raises(ManifestError, match="pytorchReplicaSpecs"):
        build_workload(
            manifest_dispatch("apiVersion: kubeflow.org/v1\nkind: PyTorchJob\nspec: {}", {}),
            FLAVOR,
            NS,
        )


JOBSET_PYTORCH_YAML = """
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata: {name: pytorch}
spec:
  replicatedJobs:
  - name: workers
    template:
      spec:
        parallelism: 2
        completions: 2
        template:
          spec:
            containers:
            - name: pytorch
              image: pytorch/pytorch
              env:
              - {name: MASTER_ADDR, value: pytorch-workers-0-0.pytorch}
              - {name: PEERS, value: "pytorch-workers-0-1.pytorch:29500,pytorch-workers-0-0"}
              - {name: OTHER, value: pytorch-evaluator-0-0.pytorch my-pytorch-workers-0-0}
              command: [torchrun, --rdzv-endpoint=pytorch-workers-0-0.pytorch:29500]
"""


def test_a_renamed_jobset_keeps_the_hostnames_its_author_wrote_resolvable() -> None:
    """The JobSet is created as `<job>-a<attempt>`; a hard-coded MASTER_ADDR from its upstream
    sample must name the renamed pods, or the workers never find their master."""
    plan = build_workload(
        manifest_dispatch(JOBSET_PYTORCH_YAML, {"workers": ["a", "b"]}), FLAVOR, NS
    )
    body = plan.objects[0].body
    new = body["metadata"]["name"]
    assert new != "pytorch"
    (t,) = templates_of(body)
    env = {e["name"]: e["value"] for e in t["spec"]["containers"][0]["env"] if "value" in e}
    assert env["MASTER_ADDR"] == f"{new}-workers-0-0.{new}"
    assert env["PEERS"] == f"{new}-workers-0-1.{new}:29500,{new}-workers-0-0"
    # not a pod of this JobSet, or not its name: left alone
    assert env["OTHER"] == "pytorch-evaluator-0-0.pytorch my-pytorch-workers-0-0"
    assert t["spec"]["containers"][0]["command"][1] == (
        f"--rdzv-endpoint={new}-workers-0-0.{new}:29500"
    )
    # an explicit subdomain is kept: only the pod-name prefix follows the rename
    explicit = JOBSET_PYTORCH_YAML.replace(
        "spec:\n  replicatedJobs:", "spec:\n  network: {subdomain: svc}\n  replicatedJobs:"
    ).replace("pytorch-workers-0-0.pytorch}", "pytorch-workers-0-0.svc}")
    body = (
        build_workload(manifest_dispatch(explicit, {"workers": ["a", "b"]}), FLAVOR, NS)
        .objects[0]
        .body
    )
    (t,) = templates_of(body)
    env = {e["name"]: e["value"] for e in t["spec"]["containers"][0]["env"] if "value" in e}
    assert env["MASTER_ADDR"] == f"{new}-workers-0-0.svc"


def test_a_renamed_volcano_job_keeps_its_svc_hostnames() -> None:
    """Volcano's svc plugin names pods `<job>-<task>-<index>.<job>`."""
    text = """
apiVersion: batch.volcano.sh/v1alpha1
kind: Job
metadata: {name: ddp}
spec:
  minAvailable: 2
  plugins: {svc: [], env: []}
  tasks:
  - name: master
    replicas: 1
    template:
      spec:
        containers:
        - name: c
          image: i
          env: [{name: MASTER_ADDR, value: ddp-master-0.ddp}]
  - name: worker
    replicas: 1
    template:
      spec:
        containers:
        - name: c
          image: i
          env: [{name: MASTER_ADDR, value: ddp-master-0.ddp}]
"""
    plan = build_workload(manifest_dispatch(text, {"master": ["a"], "worker": ["b"]}), FLAVOR, NS)
    body = plan.objects[0].body
    new = body["metadata"]["name"]
    for task in body["spec"]["tasks"]:
        env = task["template"]["spec"]["containers"][0]["env"]
        (master,) = [e["value"] for e in env if e["name"] == "MASTER_ADDR"]
        assert master == f"{new}-master-0.{new}"


def test_the_authors_lifecycle_settings_are_honoured() -> None:
    """A RayJob's `ttlSecondsAfterFinished: 10` stays 10 (not the agent's 3600), and the
    author's retry count becomes the job's restart budget: Muster turns the kind's own
    retries off and restarts the whole gang that many times instead of its default 3."""
    from pathlib import Path

    import yaml

    from broker.manifests import jobspec_from_manifest

    root = Path(__file__).resolve().parents[2]
    ray = yaml.safe_load((root / "examples" / "jobs" / "rayjob.yaml").read_text())
    ray["spec"]["ttlSecondsAfterFinished"] = 10
    ray["spec"]["backoffLimit"] = 0
    plan = build_workload(
        manifest_dispatch(json.dumps(ray), {"head": ["a"], "gpu-workers": ["b", "c"]}),
        FLAVOR,
        NS,
        config=make_config(),  # the agent's ttl_seconds_after_finished: 3600
    )
    body = plan.objects[0].body
    assert body["spec"]["ttlSecondsAfterFinished"] == 10
    assert body["spec"]["backoffLimit"] == 0  # the kind's retries stay off
    assert jobspec_from_manifest(ray).restart.max_restarts_on_error == 0

    volcano = yaml.safe_load((root / "tests" / "cli" / "fixtures" / "volcano-job.yaml").read_text())
    volcano["spec"]["maxRetry"] = 5
    assert jobspec_from_manifest(volcano).restart.max_restarts_on_error == 5
    jobset = yaml.safe_load(JOBSET_PYTORCH_YAML)
    jobset["spec"]["failurePolicy"] = {"maxRestarts": 3}
    assert jobspec_from_manifest(jobset).restart.max_restarts_on_error == 3
    # nothing said: Muster's default budget
    del volcano["spec"]["maxRetry"]
    assert jobspec_from_manifest(volcano).restart.max_restarts_on_error == 3


def test_one_pod_of_a_pod_group_on_its_own_is_refused() -> None:
    """Kueue admits a pod group when all `pod-group-total-count` pods exist: one of them sent
    alone must not run as a gang of one."""
    from pathlib import Path

    import yaml

    from broker.intake import parse_submission
    from broker.manifests import ManifestError, load_job_documents
    from schemas.codec import DecodeError

    docs = list(
        yaml.safe_load_all((Path(__file__).parent / "fixtures" / "pod-group.yaml").read_text())
    )
    pod = next(d for d in docs if d and d.get("kind") == "Pod")
    with pytest.raises(
        ManifestError, match=r"pod-group-total-count says \d+ pods but the file holds 1"
    ):
        load_job_documents(yaml.safe_dump(pod), source="pod.yaml")
    with pytest.raises(DecodeError, match=r"says \d+ pods but the file holds 1"):
        parse_submission(json.dumps(pod).encode(), 1 << 20, None)


def test_a_muster_built_pod_asks_for_its_fabric_resources() -> None:
    spec = {
        "name": "efa",
        "job_id": "job-1",
        "gang": [
            {
                "name": "worker",
                "replicas": 2,
                "gpu": 8,
                "extended": {"vpc.amazonaws.com/efa": 32, "hugepages-2Mi": 2**30},
            }
        ],
        "workload": {"image": "trainer:1"},
    }
    plan = build_workload(dispatch(spec, {"worker": ["n0", "n1"]}), FLAVOR, NS)
    (job,) = [o.body for o in plan.objects if o.resource == BATCH_JOB]
    resources = job["spec"]["template"]["spec"]["containers"][0]["resources"]
    fabric = {"vpc.amazonaws.com/efa": "32", "hugepages-2Mi": "1073741824"}
    assert resources["limits"] == {"nvidia.com/gpu": "8", **fabric}
    assert resources["requests"].items() >= fabric.items()
