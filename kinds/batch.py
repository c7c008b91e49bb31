"""batch/v1 Job (a user's manifest, or Muster's own Indexed Job + headless Service) and v1 Pod."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from kinds.adapter import Adapter
from kinds.base import (
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_PODSET,
    SERVICE,
    KindError,
    PodTemplate,
    ResizeRefused,
    Resource,
    Verdict,
    condition_verdict,
    elastic_job,
    ensure,
    job_pods,
    keep_pins,
    keep_ttl,
    mapping,
    template_at,
)
from kinds.plan import (
    PlannedObject,
    WorkloadPlan,
    assigned,
    check_assignment,
    child_name,
    container,
    finish,
    object_meta,
    workload_name,
)
from kinds.pods import Pin, PodPolicy, label_value, pin_podsets, prepare_template
from schemas.agent import Dispatch
from schemas.job import PodSet

BATCH_JOB = Resource("batch/v1", "Job", "jobs")
POD_RESOURCE = Resource("v1", "Pod", "pods")
COMPLETION_INDEX_ANN = "batch.kubernetes.io/job-completion-index"
# Kueue's partial admission: the Job may start with as few as this many pods.
MIN_PARALLELISM_ANN = "kueue.x-k8s.io/job-min-parallelism"
# Kueue lowers completions along with parallelism only when this annotation is "true".
COMPLETIONS_EQUAL_ANN = "kueue.x-k8s.io/job-completions-equal-parallelism"


class BatchJob(Adapter):
    resource = BATCH_JOB
    podsets_doc = "`worker` (min(parallelism, completions) pods)"
    retries_doc = "`backoffLimit: 0`, pod `restartPolicy: Never`"
    verdict_doc = "conditions `Complete`/`SuccessCriteriaMet` vs `Failed`/`FailureTarget`"
    retry_field = ("spec", "backoffLimit")
    suspend_field = ("spec", "suspend")
    managed_by_field = ("spec", "managedBy")
    controllers = frozenset({"kubernetes.io/job-controller"})

    def templates(self, manifest: Mapping[str, Any]) -> list[PodTemplate]:
        spec = mapping(manifest.get("spec"), "spec", required=True)
        tpl = template_at(spec.get("template"), "spec.template")
        return [PodTemplate("worker", job_pods(spec, "spec"), tpl, False, "worker", "spec")]

    def disable_retries(self, manifest: dict[str, Any]) -> None:
        spec = ensure(manifest, "spec")
        spec["backoffLimit"] = 0
        ensure(ensure(spec, "template"), "spec")["restartPolicy"] = "Never"

    def set_ttl(self, manifest: dict[str, Any], seconds: int) -> None:
        keep_ttl(ensure(manifest, "spec"), seconds)

    def verdict(self, name: str, status: Mapping[str, Any]) -> Verdict | None:
        return condition_verdict(
            f"Job {name}", status, ("Complete", "SuccessCriteriaMet"), ("Failed", "FailureTarget")
        )

    def min_pods(self, manifest: Mapping[str, Any]) -> dict[str, int]:
        meta = mapping(manifest.get("metadata"), "metadata")
        annotations = mapping(meta.get("annotations"), "metadata.annotations")
        raw = annotations.get(MIN_PARALLELISM_ANN)
        if raw is None:
            return {}
        where = f"metadata.annotations[{MIN_PARALLELISM_ANN}]"
        try:
            value = int(str(raw).strip())
        except ValueError:
            raise KindError(
                f"{where}: {raw!r} is not a whole number; write the fewest pods the Job may "
                "start with, e.g. '5'"
            ) from None
        spec = mapping(manifest.get("spec"), "spec", required=True)
        pods = job_pods(spec, "spec")
        if not 1 <= value <= pods:
            raise KindError(
                f"{where}: {value} is outside 1..{pods} (the Job's pods); set it to at least 1 "
                "and at most parallelism"
            )
        return {"worker": value} if value < pods else {}

    def elastic(self, manifest: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
        """`kueue.x-k8s.io/elastic-job: "true"`: the Job runs with any parallelism up to the
        written one, at least `job-min-parallelism` (1 without it), and grows back to it."""
        if not elastic_job(manifest):
            return {}
        meta = mapping(manifest.get("metadata"), "metadata")
        annotations = mapping(meta.get("annotations"), "metadata.annotations")
        pods = job_pods(mapping(manifest.get("spec"), "spec", required=True), "spec")
        low = 1
        if MIN_PARALLELISM_ANN in annotations:
            low = self.min_pods(manifest).get("worker", pods)
        return {"worker": (low, pods)}

    resizable = True

    def resize_patch(self, live: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
        """`spec.parallelism`; an Indexed Job whose completions equal its parallelism (one
        index per worker) changes both together, as elastic Indexed Jobs may (KEP-3715,
        Kubernetes 1.27+; GA in 1.31). Any other Job's completions are immutable, and its
        template too, so its pods can only use the nodes it was created pinned to."""
        was = mapping(live.get("spec"), "spec", required=True)
        now = mapping(new.get("spec"), "spec", required=True)
        keep_pins("Job", "spec.template", was.get("template") or {}, now.get("template") or {})
        patch = {"parallelism": now.get("parallelism")}
        indexed = was.get("completionMode") == "Indexed"
        if indexed and was.get("completions") == was.get("parallelism"):
            patch["completions"] = now.get("parallelism")
        elif now.get("completions") != was.get("completions"):
            raise ResizeRefused(
                f"Job spec.completions: {was.get('completions')} cannot change while the Job "
                "runs (only an Indexed Job whose completions equal its parallelism changes "
                "both together)"
            )
        return {"spec": patch}

    def scale(self, manifest: dict[str, Any], podset: str, count: int) -> None:
        """Kueue's partial admission: parallelism becomes the admitted count, and completions
        too when the Job says `job-completions-equal-parallelism: "true"`."""
        spec = ensure(manifest, "spec")
        spec["parallelism"] = count
        meta = manifest.get("metadata")
        annotations = meta.get("annotations") if isinstance(meta, dict) else None
        equal = isinstance(annotations, dict) and (
            str(annotations.get(COMPLETIONS_EQUAL_ANN, "")).strip().lower() == "true"
        )
        if equal and spec.get("completions") is not None:
            spec["completions"] = count


class Pod(Adapter):
    resource = POD_RESOURCE
    has_status = False  # its phase is read with every pod
    podsets_doc = "`pod` (one pod)"
    retries_doc = "`restartPolicy: Never`"
    verdict_doc = "the pod's phase (watched with every pod)"

    def templates(self, manifest: Mapping[str, Any]) -> list[PodTemplate]:
        if not isinstance(manifest.get("spec"), dict):
            raise KindError("spec: missing; give the pod's spec")
        return [PodTemplate("pod", 1, cast(dict[str, Any], manifest), True, "pod", "")]

    def disable_retries(self, manifest: dict[str, Any]) -> None:
        ensure(manifest, "spec")["restartPolicy"] = "Never"


def build_indexed_job(
    cmd: Dispatch, policy: PodPolicy, namespace: str, gpu_resource: str = "nvidia.com/gpu"
) -> WorkloadPlan:
    """One Indexed Job per podset plus one headless Service, with the Kubeflow-style env:
    WORLD_SIZE = replicas of the whole gang, RANK = podset offset + completion index,
    LOCAL_RANK = 0, MASTER_ADDR = the first podset's index-0 pod, MASTER_PORT = workload.port,
    and torchrun's PET_* equivalents.

    RANK of a podset after the first needs arithmetic Kubernetes env cannot do, so its
    command runs under `/bin/sh -c` which adds MUSTER_RANK_OFFSET to JOB_COMPLETION_INDEX;
    that needs `workload.command` (the image's entrypoint is unknown here).

    A podset whose pinning would not be exact (`kinds.pods.pin_podsets`) becomes one Indexed
    Job per node instead, each pinned to its one node."""
    gang = cmd.spec.gang
    if not gang:
        raise KindError("gang: indexed-job needs at least one podset")
    check_assignment(cmd)
    base = workload_name(cmd.job_id, cmd.attempt)
    port = cmd.spec.workload.port
    by_name = assigned(cmd)
    # Replicas as admitted: fewer than asked for under partial admission.
    total = sum(len(by_name.get(ps.name) or ()) or ps.replicas for ps in gang)
    pins = pin_podsets(by_name, {ps.name: (ps.gpu, str(ps.cpu), str(ps.memory)) for ps in gang})
    parts: list[tuple[PodSet, str, int, Pin]] = []
    for ps in gang:
        pin = pins.get(ps.name, Pin((), None, True))
        nodes = by_name.get(ps.name) or []
        if pin.exact or not nodes:
            parts.append((ps, child_name(base, ps.name), len(nodes) or ps.replicas, pin))
            continue
        for k, node in enumerate(dict.fromkeys(nodes)):
            name = child_name(base, f"{ps.name}-{k}")
            parts.append((ps, name, nodes.count(node), Pin((node,), None, True)))
    master_addr = f"{parts[0][1]}-0.{base}"
    objects: list[PlannedObject] = []
    # Controlled by the first Job (created before it), so the Service goes with the attempt
    # when that Job is deleted or its TTL runs out.
    service = PlannedObject(
        SERVICE,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": object_meta(cmd, base, namespace),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": {
                    LABEL_JOB: label_value(cmd.job_id),
                    LABEL_ATTEMPT: str(cmd.attempt),
                },
                "ports": [{"name": "rdzv", "port": port, "targetPort": port}],
            },
        },
        owner=parts[0][1],
    )
    offset = 0
    for ps, name, replicas, pin in parts:
        c = container(cmd, "trainer", ps, gpu_resource)
        index_ref = {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANN}']"}}
        env: list[dict[str, Any]] = [
            {"name": "WORLD_SIZE", "value": str(total)},
            {"name": "MASTER_ADDR", "value": master_addr},
            {"name": "MASTER_PORT", "value": str(port)},
            {"name": "LOCAL_RANK", "value": "0"},
            {"name": "PET_NNODES", "value": str(total)},
            {"name": "PET_NPROC_PER_NODE", "value": str(max(ps.gpu, 1))},
            {"name": "PET_MASTER_ADDR", "value": master_addr},
            {"name": "PET_MASTER_PORT", "value": str(port)},
            {"name": "MUSTER_RANK_OFFSET", "value": str(offset)},
        ]
        if offset == 0:
            env += [{"name": "RANK", "valueFrom": index_ref}]
            env += [{"name": "PET_NODE_RANK", "valueFrom": index_ref}]
        else:
            if not cmd.spec.workload.command:
                raise KindError(
                    f"workload.command: Job {name!r} does not start at rank 0, so its "
                    "RANK is MUSTER_RANK_OFFSET + JOB_COMPLETION_INDEX, computed by a shell "
                    "wrapper around the command; give workload.command"
                )
            script = (
                "export RANK=$((MUSTER_RANK_OFFSET + JOB_COMPLETION_INDEX)); "
                'export PET_NODE_RANK=$RANK; exec "$@"'
            )
            c["command"] = ["/bin/sh", "-c", script, "muster-rank"]
            c["args"] = [*cmd.spec.workload.command, *cmd.spec.workload.args]
        c["env"] = c["env"] + env
        template: dict[str, Any] = {
            "spec": {"restartPolicy": "Never", "subdomain": base, "containers": [c]}
        }
        prepare_template(template, cmd, policy, ps.name, ps.name, pin, total, False)
        meta = object_meta(cmd, name, namespace)
        meta["labels"][LABEL_PODSET] = ps.name
        body: dict[str, Any] = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": meta,
            "spec": {
                "completionMode": "Indexed",
                "completions": replicas,
                "parallelism": replicas,
                "backoffLimit": 0,
                "template": template,
            },
        }
        if policy.ttl_seconds is not None:
            body["spec"]["ttlSecondsAfterFinished"] = policy.ttl_seconds
        objects.append(PlannedObject(BATCH_JOB, body))
        offset += replicas
    objects.insert(1, service)
    return finish(base, objects, total, [p.name for p in gang])
