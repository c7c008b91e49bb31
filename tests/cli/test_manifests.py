"""Manifest -> JobSpec derivation, against the seed documents' YAML."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
import yaml

from broker.manifests import (
    JobDocumentError,
    ManifestError,
    capacity_type_from_labels,
    dns_label,
    gpu_type_from_labels,
    is_manifest,
    jobspec_from_manifest,
    load_job_document,
    normalize_gpu_type,
)
from schemas.codec import decode_jobspec, encode_json
from schemas.job import JobSpec

from .conftest import fixture, fixture_text


def gang(spec: JobSpec) -> list[tuple[str, int, int, str, str]]:
    return [(p.name, p.replicas, p.gpu, str(p.cpu), str(p.memory)) for p in spec.gang]


# -- the seed examples -------------------------------------------------------------------


def test_pytorchjob_master_and_workers() -> None:
    manifest = fixture("pytorchjob-ddp-mnist.yaml")
    spec = jobspec_from_manifest(manifest)
    assert spec.name == "pytorch-ddp-mnist"
    assert gang(spec) == [("master", 1, 2, "8", "32Gi"), ("worker", 2, 2, "8", "32Gi")]
    assert spec.total_gpus == 6
    assert spec.queue is None
    assert spec.workload.kind == "manifest"
    assert spec.workload.manifest == fixture("pytorchjob-ddp-mnist.yaml")
    assert spec.labels["muster.dev/namespace"] == "ml-training"
    assert spec.labels["muster.dev/source-kind"] == "kubeflow.org/PyTorchJob"


def test_derived_spec_is_valid_on_the_wire() -> None:
    """What the CLI sends must pass the broker's own decoder unchanged."""
    for name in ("pytorchjob-ddp-mnist.yaml", "mpijob-horovod.yaml", "jobset-llm.yaml"):
        spec = jobspec_from_manifest(fixture(name), queue="ml")
        assert decode_jobspec(encode_json(spec)) == spec


def test_mpijob_launcher_and_workers() -> None:
    spec = jobspec_from_manifest(fixture("mpijob-horovod.yaml"))
    assert gang(spec) == [("launcher", 1, 0, "2", "4Gi"), ("worker", 4, 2, "8", "32Gi")]


def test_mpijob_slots_per_worker_is_not_a_gpu_count() -> None:
    """slotsPerWorker is the number of MPI processes per worker in the hostfile; GPUs come from
    resource requests and limits only, so a CPU-only MPIJob reserves no GPU."""
    manifest = fixture("mpijob-horovod.yaml")
    worker = manifest["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    del worker["resources"]["limits"]["nvidia.com/gpu"]
    manifest["spec"]["slotsPerWorker"] = 4
    spec = jobspec_from_manifest(manifest)
    assert gang(spec) == [("launcher", 1, 0, "2", "4Gi"), ("worker", 4, 0, "8", "32Gi")]
    spec = jobspec_from_manifest(fixture("mpijob-horovod.yaml"))
    assert spec.gang[1].gpu == 2


def test_tfjob_parameter_servers_and_workers() -> None:
    spec = jobspec_from_manifest(fixture("tfjob-ps.yaml"))
    assert gang(spec) == [("ps", 2, 0, "4", "16Gi"), ("worker", 4, 1, "8", "32Gi")]


def test_tfjob_chief_and_evaluator_are_ordered() -> None:
    manifest = fixture("tfjob-ps.yaml")
    specs = manifest["spec"]["tfReplicaSpecs"]
    specs["Evaluator"] = json.loads(json.dumps(specs["PS"])) | {"replicas": 1}
    specs["Chief"] = json.loads(json.dumps(specs["Worker"])) | {"replicas": 1}
    spec = jobspec_from_manifest(manifest)
    assert [p.name for p in spec.gang] == ["chief", "ps", "worker", "evaluator"]


def test_volcano_job_tasks_and_queue() -> None:
    spec = jobspec_from_manifest(fixture("volcano-job.yaml"))
    assert spec.name == "pytorch-ddp-training"
    assert spec.queue == "ml-research-queue"
    # the seed's tasks ask for GPUs only; cpu and memory count as 0, as kube-scheduler does
    assert gang(spec) == [("master", 1, 1, "0", "0"), ("worker", 4, 1, "0", "0")]
    assert "muster.dev/min-available" not in spec.labels  # minAvailable 5 == all 5 pods


def test_volcano_min_available_below_total_makes_the_workers_elastic() -> None:
    manifest = fixture("volcano-job.yaml")
    manifest["spec"]["minAvailable"] = 3
    spec = jobspec_from_manifest(manifest)
    master, worker = spec.gang
    assert (master.min_replicas, master.max_replicas) == (None, None)  # the master stays whole
    # 3 pods must run: the master and 2 of the 4 workers
    assert (worker.replicas, worker.min_replicas, worker.max_replicas) == (4, 2, 4)
    assert spec.labels["muster.dev/min-available"] == "3"


def test_a_volcano_tasks_own_min_available_makes_it_elastic() -> None:
    manifest = fixture("volcano-job.yaml")
    manifest["spec"]["tasks"][1]["minAvailable"] = 1  # the worker task
    master, worker = jobspec_from_manifest(manifest).gang
    assert (master.max_replicas, worker.min_replicas, worker.max_replicas) == (None, 1, 4)


def test_volcano_min_available_without_one_scalable_task_is_recorded_not_used() -> None:
    manifest = fixture("volcano-job.yaml")
    manifest["spec"]["minAvailable"] = 3
    for task in manifest["spec"]["tasks"]:
        task["name"] = "m" + task["name"]  # no task is the worker
    spec = jobspec_from_manifest(manifest)
    assert all(p.max_replicas is None and p.min_replicas is None for p in spec.gang)
    assert spec.labels["muster.dev/min-available"] == "3"


def test_volcano_min_available_above_total_is_an_error() -> None:
    manifest = fixture("volcano-job.yaml")
    manifest["spec"]["minAvailable"] = 9
    with pytest.raises(ManifestError, match="minAvailable is 9 but the job has only 5 pods"):
        jobspec_from_manifest(manifest)


def test_kueue_queue_label_and_argument_override() -> None:
    manifest = fixture("pytorchjob-kueue-label.yaml")
    assert jobspec_from_manifest(manifest).queue == "ml-research-queue"
    assert jobspec_from_manifest(manifest, queue="urgent").queue == "urgent"


def test_elastic_pytorchjob_on_spot_nodes() -> None:
    spec = jobspec_from_manifest(fixture("pytorchjob-elastic-spot.yaml"))
    assert gang(spec) == [("worker", 4, 1, "0", "0")]
    # elasticPolicy minReplicas 2, maxReplicas 8: the workers shrink and grow in between
    (worker,) = spec.gang
    assert (worker.min_replicas, worker.max_replicas, worker.elastic) == (2, 8, True)
    assert spec.capacity == "spot"  # from nodeSelector cloud.google.com/gke-provisioning: spot


@pytest.mark.parametrize(
    ("drop", "bounds"), [(("minReplicas", "maxReplicas"), (4, 4)), (("maxReplicas",), (2, 2))]
)
def test_elastic_policy_defaults_as_the_training_operator(
    drop: tuple[str, ...], bounds: tuple[int, int]
) -> None:
    """One bound left out is the other; both left out, the Worker's replicas."""
    manifest = fixture("pytorchjob-elastic-spot.yaml")
    manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = bounds[0]
    for key in drop:
        del manifest["spec"]["elasticPolicy"][key]
    (worker,) = jobspec_from_manifest(manifest).gang
    assert (worker.min_replicas, worker.max_replicas) == bounds


def test_elastic_policy_with_only_a_maximum_above_the_replicas_is_refused() -> None:
    manifest = fixture("pytorchjob-elastic-spot.yaml")
    del manifest["spec"]["elasticPolicy"]["minReplicas"]  # minReplicas becomes 8 > replicas 4
    with pytest.raises(ManifestError, match="minReplicas 8, Worker replicas 4 and maxReplicas 8"):
        jobspec_from_manifest(manifest)


@pytest.mark.parametrize(("low", "high"), [(5, 8), (2, 3), (0, 8)])
def test_elastic_policy_out_of_order_is_refused(low: int, high: int) -> None:
    manifest = fixture("pytorchjob-elastic-spot.yaml")
    manifest["spec"]["elasticPolicy"].update(minReplicas=low, maxReplicas=high)
    with pytest.raises(ManifestError, match="1 <= minReplicas <= replicas <= maxReplicas"):
        jobspec_from_manifest(manifest)


def test_elastic_policy_without_workers_is_refused() -> None:
    manifest = fixture("pytorchjob-elastic-spot.yaml")
    specs = manifest["spec"]["pytorchReplicaSpecs"]
    specs["Master"] = specs.pop("Worker")
    with pytest.raises(ManifestError, match="has none; add a Worker replica type"):
        jobspec_from_manifest(manifest)


def test_kueue_elastic_batch_job() -> None:
    manifest = fixture("batch-job-indexed.yaml")
    annotations = manifest["metadata"].setdefault("annotations", {})
    annotations["kueue.x-k8s.io/elastic-job"] = "true"
    (worker,) = jobspec_from_manifest(manifest).gang
    assert (worker.replicas, worker.min_replicas, worker.max_replicas) == (4, 1, 4)
    annotations["kueue.x-k8s.io/job-min-parallelism"] = "3"
    (worker,) = jobspec_from_manifest(manifest).gang
    assert (worker.min_replicas, worker.max_replicas) == (3, 4)


def test_koordinator_queue_and_priority_annotations() -> None:
    spec = jobspec_from_manifest(fixture("pytorchjob-koord.yaml"))
    assert spec.queue == "pytorch-team-a"
    assert spec.priority == 10
    assert gang(spec) == [("master", 1, 1, "4", "8Gi"), ("worker", 1, 1, "4", "8Gi")]


def test_master_only_pytorchjob_with_requests() -> None:
    spec = jobspec_from_manifest(fixture("pytorchjob-priority-class.yaml"))
    assert gang(spec) == [("master", 1, 2, "8", "16Gi")]  # GPUs from requests when no limits


def test_jobset_replicated_jobs_times_parallelism() -> None:
    spec = jobspec_from_manifest(fixture("jobset-llm.yaml"))
    assert spec.queue == "ml-research-queue"
    # two containers summed: 16 + 0.25 cpu, 128Gi + 256Mi
    assert gang(spec) == [("driver", 1, 0, "500m", "1Gi"), ("workers", 8, 8, "16250m", "131328Mi")]
    assert spec.gpu_types == ["h100-80gb"]


def test_batch_job_parallelism_and_init_containers() -> None:
    spec = jobspec_from_manifest(fixture("batch-job-indexed.yaml"))
    assert spec.name == "sweep-run-42"  # Sweep_Run.42 sanitised to a DNS label
    # min(parallelism 4, completions 8) pods; the init container's 8 cpu is the pod's peak
    assert gang(spec) == [("worker", 4, 1, "8", "8Gi")]


def test_sidecar_init_containers_add_to_the_pod() -> None:
    manifest = fixture("batch-job-indexed.yaml")
    init = manifest["spec"]["template"]["spec"]["initContainers"][0]
    init["restartPolicy"] = "Always"
    init["resources"]["requests"]["cpu"] = "1"
    spec = jobspec_from_manifest(manifest)
    assert gang(spec) == [("worker", 4, 1, "3", "10Gi")]


def test_pod() -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "one"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"amd.com/gpu": 2}}}]},
    }
    assert gang(jobspec_from_manifest(pod)) == [("pod", 1, 2, "0", "0")]


# -- JobSpec fields from annotations and defaults ---------------------------------------


def test_muster_annotations() -> None:
    manifest = fixture("pytorchjob-ddp-mnist.yaml")
    manifest["metadata"]["annotations"] = {
        "muster.io/capacity": "spot-then-on-demand",
        "muster.io/priority": "7",
        "muster.io/gpu-types": "nvidia-tesla-a100, H100",
        "muster.io/checkpoint-uri": "s3://ckpt/mnist",
        "muster.io/job-id": "mnist-001",
    }
    spec = jobspec_from_manifest(manifest)
    assert spec.capacity == "spot-then-on-demand"
    assert spec.priority == 7
    assert spec.gpu_types == ["a100", "h100"]
    assert spec.checkpoint is not None and spec.checkpoint.uri == "s3://ckpt/mnist"
    assert spec.job_id == "mnist-001"


def test_defaults_fill_what_the_manifest_does_not_say() -> None:
    defaults = {"capacity": "spot", "priority": 3, "checkpoint": {"uri": "s3://x"}, "gang": []}
    spec = jobspec_from_manifest(fixture("pytorchjob-koord.yaml"), defaults=defaults)
    assert spec.capacity == "spot"
    assert spec.priority == 10  # the manifest's annotation wins
    assert spec.checkpoint is not None and spec.checkpoint.uri == "s3://x"
    assert spec.total_replicas == 2  # `gang` in defaults cannot replace the derived gang


def test_bad_defaults_name_the_field() -> None:
    with pytest.raises(ManifestError, match="capacity"):
        jobspec_from_manifest(fixture("tfjob-ps.yaml"), defaults={"capacity": "cheap"})


# -- errors name the field and the fix ---------------------------------------------------


def _worker_container(manifest: dict[str, Any]) -> dict[str, Any]:
    return manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda m: _worker_container(m)["resources"]["limits"].update({"nvidia.com/gpu": "0.5"}),
            r"spec\.pytorchReplicaSpecs\.Worker\.template\.spec\.containers\[0\]\.resources"
            r"\.limits\[nvidia\.com/gpu\]: '0\.5' is not a whole number of GPUs",
        ),
        (
            lambda m: _worker_container(m)["resources"]["limits"].update({"cpu": "lots"}),
            r"containers\[0\]\.resources\.limits\.cpu: invalid quantity 'lots'",
        ),
        (
            lambda m: _worker_container(m)["resources"]["limits"].update({"nvidia.com/gpu": 100}),
            r"100 GPUs per replica is over Muster's limit of 64",
        ),
        (
            lambda m: m["spec"]["pytorchReplicaSpecs"]["Worker"].update(replicas=-1),
            r"spec\.pytorchReplicaSpecs\.Worker\.replicas: must not be negative",
        ),
        (
            lambda m: m["spec"]["pytorchReplicaSpecs"]["Worker"].update(replicas="two"),
            r"Worker\.replicas: expected a whole number, got 'two'",
        ),
        (
            lambda m: m["spec"]["pytorchReplicaSpecs"]["Worker"].update(replicas=5000),
            r"5000 replicas is over Muster's limit of 4096",
        ),
        (
            lambda m: m["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"].update(
                containers=[]
            ),
            r"Worker\.template\.spec\.containers: the pod template has no containers",
        ),
        (
            lambda m: m["spec"]["pytorchReplicaSpecs"]["Worker"].pop("template"),
            r"spec\.pytorchReplicaSpecs\.Worker\.template: missing",
        ),
        (
            lambda m: m["spec"].pop("pytorchReplicaSpecs"),
            r"spec\.pytorchReplicaSpecs: missing",
        ),
        (
            lambda m: [r.update(replicas=0) for r in m["spec"]["pytorchReplicaSpecs"].values()],
            r"asks for no pods",
        ),
        (
            lambda m: m["metadata"].update(labels={"kueue.x-k8s.io/queue-name": "ML_Queue"}),
            r"metadata\.labels\[kueue\.x-k8s\.io/queue-name\]: 'ML_Queue' is not a valid queue",
        ),
        (lambda m: m["metadata"].pop("name"), r"metadata\.name: missing"),
        (lambda m: m["metadata"].update(name="..."), r"no letters or digits"),
        (
            lambda m: m["metadata"].update(annotations={"muster.dev/priority": "high"}),
            r"muster\.dev/priority\]: 'high' is not a whole number",
        ),
        (lambda m: m.update(spec=[1, 2]), r"spec: expected a mapping, got a list"),
    ],
)
def test_errors_name_the_field(mutate: Any, message: str) -> None:
    manifest = fixture("pytorchjob-ddp-mnist.yaml")
    mutate(manifest)
    with pytest.raises(ManifestError, match=message):
        jobspec_from_manifest(manifest)


@pytest.mark.parametrize(
    "name", ["volcano-podgroup.yaml", "volcano-queue.yaml", "koord-elasticquota.yaml"]
)
def test_objects_that_are_not_jobs_are_refused(name: str) -> None:
    with pytest.raises(ManifestError, match="not a job kind Muster can run"):
        jobspec_from_manifest(fixture(name))


def test_not_a_manifest() -> None:
    with pytest.raises(ManifestError, match="needs `apiVersion` and `kind`"):
        jobspec_from_manifest({"name": "x"})


def test_is_manifest() -> None:
    assert is_manifest(fixture("tfjob-ps.yaml"))
    assert not is_manifest({"name": "x", "gang": []})
    assert not is_manifest({"apiVersion": 1, "kind": "Job"})
    assert not is_manifest(["apiVersion", "kind"])


# -- helpers -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "label"),
    [
        ("Sweep_Run.42", "sweep-run-42"),
        ("--a--b--", "a-b"),
        ("x" * 80, "x" * 63),
        ("a" * 62 + "-b", "a" * 62),
        ("日本", ""),
    ],
)
def test_dns_label(raw: str, label: str) -> None:
    assert dns_label(raw) == label


@pytest.mark.parametrize(
    ("raw", "gpu"),
    [
        ("nvidia-tesla-a100", "a100"),
        ("nvidia-tesla-t4", "t4"),
        ("NVIDIA-A100-SXM4-80GB", "a100-sxm4-80gb"),
        ("nvidia-h100-80gb", "h100-80gb"),
        ("H100", "h100"),
    ],
)
def test_normalize_gpu_type(raw: str, gpu: str) -> None:
    assert normalize_gpu_type(raw) == gpu


def test_node_label_readers() -> None:
    assert capacity_type_from_labels({"karpenter.sh/capacity-type": "spot"}) == "spot"
    assert capacity_type_from_labels({"eks.amazonaws.com/capacityType": "ON_DEMAND"}) == "on-demand"
    assert capacity_type_from_labels({"cloud.google.com/gke-spot": "true"}) == "spot"
    assert capacity_type_from_labels({"other": "spot"}) is None
    assert gpu_type_from_labels({"cloud.google.com/gke-accelerator": "nvidia-l4"}) == "l4"
    assert gpu_type_from_labels({}) is None


# -- job files for the CLI ---------------------------------------------------------------


def test_load_manifest_yaml_and_json() -> None:
    text = fixture_text("tfjob-ps.yaml")
    from_yaml = load_job_document(text, queue="ml")
    from_json = load_job_document(json.dumps(yaml.safe_load(text)), queue="ml")
    assert from_yaml == from_json
    assert from_yaml.queue == "ml"


def test_load_muster_jobspec() -> None:
    text = """
name: resnet
queue: ml
capacity: spot-then-on-demand
gang:
  - {name: worker, replicas: 4, gpu: 8, cpu: "32", memory: 256Gi}
checkpoint: {uri: "s3://ckpt/resnet"}
"""
    spec = load_job_document(text, job_id="resnet-1")
    assert spec.job_id == "resnet-1"
    assert spec.total_gpus == 32
    assert load_job_document(text, queue="other").queue == "other"


def test_load_jobspec_with_manifest_derives_the_gang() -> None:
    doc = {
        "name": "wrapped",
        "queue": "ml",
        "capacity": "spot",
        "workload": {"kind": "manifest", "manifest": fixture("pytorchjob-ddp-mnist.yaml")},
    }
    spec = load_job_document(json.dumps(doc))
    assert spec.capacity == "spot"
    assert gang(spec)[0] == ("master", 1, 2, "8", "32Gi")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "the file is empty"),
        ("name: a\n  bad: [", r"not valid YAML or JSON at line \d+, column \d+"),
        ("- 1\n- 2\n", "expected a mapping"),
        ("name: a\n---\nname: b\n", "holds 2 YAML documents"),
        ("name: a\ngang: [{name: w, gpu: 65}]\n", r"gang\[0\]\.gpu: Expected `int` <= 64"),
        ("name: a\n", "give at least one podset"),
        ("name: a\ngang: [{name: w}]\nqueue: Bad\n", r"queue: Expected `str` matching"),
        ("name: a\ngang: [{name: w}]\nbogus: 1\n", "unknown field 'bogus'"),
        (
            "name: a\ngang: [{name: w}]\ncapacity: spot-first\n",
            "capacity: Invalid enum value 'spot-first'; valid values: any, on-demand, spot, "
            "spot-then-on-demand",
        ),
        (
            "name: a\ngang: [{name: w}]\ngpu_type: [a100]\n",
            "gpu_type: unknown field 'gpu_type'; did you mean 'gpu_types'",
        ),
        (
            "name: a\ngang: [{name: w, gpus: 2}]\n",
            r"gang\[0\]\.gpus: unknown field 'gpus'; did you mean 'gpu'",
        ),
    ],
)
def test_load_errors(text: str, message: str) -> None:
    with pytest.raises(JobDocumentError, match=message):
        load_job_document(text, source="job.yaml")


def test_load_errors_name_the_source() -> None:
    with pytest.raises(JobDocumentError, match=r"^job\.yaml: "):
        load_job_document("name: a\n", source="job.yaml")
    with pytest.raises(ManifestError, match=r"^job\.yaml: kind: "):
        load_job_document(fixture_text("volcano-queue.yaml"), source="job.yaml")


def test_bad_job_id_override() -> None:
    with pytest.raises(JobDocumentError, match="--job-id 'a b' is not valid"):
        load_job_document(fixture_text("tfjob-ps.yaml"), job_id="a b")


def test_spec_round_trips_through_builtins() -> None:
    spec = jobspec_from_manifest(fixture("volcano-job.yaml"))
    assert msgspec.convert(msgspec.to_builtins(spec), JobSpec) == spec
