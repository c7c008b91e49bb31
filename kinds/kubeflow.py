"""The Kubeflow training family: one layout (`spec.<x>ReplicaSpecs`, `spec.runPolicy`), one
adapter, a table of kinds. `kubeflow.org/v1` from the training operator (v1.9) and `MPIJob`
`kubeflow.org/v2beta1` from mpi-operator (v0.8), picked by the manifest's apiVersion."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, cast

from kinds.adapter import Adapter
from kinds.base import (
    KindError,
    PodTemplate,
    ResizeRefused,
    Resource,
    Verdict,
    condition_verdict,
    count,
    ensure,
    keep_ttl,
    mapping,
    replica_rows,
)
from kinds.plan import (
    PlannedObject,
    WorkloadPlan,
    assigned,
    check_assignment,
    container,
    finish,
    object_meta,
    workload_name,
)
from kinds.pods import Pin, PodPolicy, pin_podsets, prepare_template
from schemas.agent import Dispatch
from schemas.job import PodSet


class TrainingKind(NamedTuple):
    api_version: str
    kind: str
    plural: str
    replica_specs: str  # the key of the replica specs in `spec`
    leaders: frozenset[str]  # replica types whose success is the job's (lower-cased)


TABLE: tuple[TrainingKind, ...] = (
    TrainingKind(
        "kubeflow.org/v1", "PyTorchJob", "pytorchjobs", "pytorchReplicaSpecs", frozenset({"master"})
    ),
    TrainingKind(
        "kubeflow.org/v1", "TFJob", "tfjobs", "tfReplicaSpecs", frozenset({"chief", "master"})
    ),
    TrainingKind(
        "kubeflow.org/v1", "MPIJob", "mpijobs", "mpiReplicaSpecs", frozenset({"launcher"})
    ),
    TrainingKind(
        "kubeflow.org/v2beta1", "MPIJob", "mpijobs", "mpiReplicaSpecs", frozenset({"launcher"})
    ),
    TrainingKind(
        "kubeflow.org/v1", "XGBoostJob", "xgboostjobs", "xgbReplicaSpecs", frozenset({"master"})
    ),
    TrainingKind(
        "kubeflow.org/v1", "PaddleJob", "paddlejobs", "paddleReplicaSpecs", frozenset({"master"})
    ),
    TrainingKind("kubeflow.org/v1", "JAXJob", "jaxjobs", "jaxReplicaSpecs", frozenset()),
)
_ORDER = ("launcher", "master", "chief", "scheduler", "server", "ps", "worker", "evaluator")


class Training(Adapter):
    """One row of TABLE."""

    podsets_doc = "the replica type, lower-cased (`master`, `worker`, `launcher`, `ps`, ...)"
    retries_doc = "`runPolicy.backoffLimit: 0`, every replica `restartPolicy: Never`"
    verdict_doc = "conditions `Succeeded` vs `Failed`"
    retry_field = ("spec", "runPolicy", "backoffLimit")
    suspend_field = ("spec", "runPolicy", "suspend")
    managed_by_field = ("spec", "runPolicy", "managedBy")
    controllers = frozenset({"kubeflow.org/training-operator", "kubeflow.org/mpi-operator"})
    order = _ORDER

    def __init__(self, row: TrainingKind) -> None:
        self.row = row
        self.resource = Resource(row.api_version, row.kind, row.plural)
        # torchrun's elastic rendezvous is what lets a running PyTorchJob change size
        self.resizable = row.kind == "PyTorchJob"
        self.leaders = row.leaders

    def _specs(self, manifest: Mapping[str, Any]) -> Mapping[str, Any]:
        key = self.row.replica_specs
        spec = mapping(manifest.get("spec"), "spec", required=True)
        specs = mapping(spec.get(key), f"spec.{key}", required=True)
        if not specs:
            raise KindError(f"spec.{key}: empty; give at least one replica type, e.g. Worker")
        return specs

    def templates(self, manifest: Mapping[str, Any]) -> list[PodTemplate]:
        rows = replica_rows(self._specs(manifest), f"spec.{self.row.replica_specs}")
        return [
            PodTemplate(r.name, r.replicas(), r.template(), r.name in self.leaders, r.name, r.path)
            for r in rows
        ]

    def disable_retries(self, manifest: dict[str, Any]) -> None:
        spec = ensure(manifest, "spec")
        ensure(spec, "runPolicy")["backoffLimit"] = 0
        for rspec in ensure(spec, self.row.replica_specs).values():
            if isinstance(rspec, dict):
                rspec["restartPolicy"] = "Never"

    def set_ttl(self, manifest: dict[str, Any], seconds: int) -> None:
        keep_ttl(ensure(ensure(manifest, "spec"), "runPolicy"), seconds)

    def verdict(self, name: str, status: Mapping[str, Any]) -> Verdict | None:
        return condition_verdict(f"{self.row.kind} {name}", status, ("Succeeded",), ("Failed",))

    def _scheduling(self, manifest: Mapping[str, Any]) -> Mapping[str, Any]:
        spec = mapping(manifest.get("spec"), "spec")
        run_policy = mapping(spec.get("runPolicy"), "spec.runPolicy")
        return mapping(run_policy.get("schedulingPolicy"), "spec.runPolicy.schedulingPolicy")

    def min_available(self, manifest: Mapping[str, Any]) -> int | None:
        raw = self._scheduling(manifest).get("minAvailable")
        return count(raw, "spec.runPolicy.schedulingPolicy.minAvailable", 0) or None

    def elastic(self, manifest: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
        """`spec.elasticPolicy` (PyTorchJob, PaddleJob): the Worker replicas run between
        `minReplicas` and `maxReplicas` (torchrun's `--nnodes=min:max`), defaulted as the
        training operator does: one left out is the other, both left out the Worker's
        `replicas`."""
        spec = mapping(manifest.get("spec"), "spec")
        policy = mapping(spec.get("elasticPolicy"), "spec.elasticPolicy")
        if not policy:
            return {}
        workers = [t for t in self.templates(manifest) if t.podset == "worker"]
        if not workers:
            raise KindError(
                "spec.elasticPolicy: elastic training scales the Worker replicas, and this "
                f"{self.row.kind} has none; add a Worker replica type or drop elasticPolicy"
            )
        replicas = sum(t.replicas for t in workers)
        low_raw, high_raw = policy.get("minReplicas"), policy.get("maxReplicas")
        if low_raw is None:
            low_raw = replicas if high_raw is None else high_raw
        if high_raw is None:
            high_raw = low_raw
        low = count(low_raw, "spec.elasticPolicy.minReplicas", replicas)
        high = count(high_raw, "spec.elasticPolicy.maxReplicas", replicas)
        if not 1 <= low <= replicas <= high:
            raise KindError(
                f"spec.elasticPolicy: minReplicas {low}, Worker replicas {replicas} and "
                f"maxReplicas {high} must satisfy 1 <= minReplicas <= replicas <= maxReplicas"
            )
        return {"worker": (low, high)}

    def resize_patch(self, live: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
        """The replica types whose count changed: `replicas` and the template pinned to the
        new nodes (the operator creates and deletes pods by index to match), allowed only
        with `spec.elasticPolicy`, so torchrun's rendezvous expects the change."""
        if not self.resizable or not mapping(live.get("spec"), "spec").get("elasticPolicy"):
            raise ResizeRefused(
                f"{self.row.kind} {live.get('metadata', {}).get('name', '')}: without "
                "spec.elasticPolicy its workers rendezvous at a fixed size, so its replica "
                "count cannot change while it runs"
            )
        key = self.row.replica_specs
        before, after = self._specs(live), self._specs(new)
        changed = {}
        for name, spec in after.items():
            old = before.get(name)
            if not isinstance(old, Mapping) or not isinstance(spec, Mapping):
                raise ResizeRefused(f"spec.{key}.{name}: not in the running {self.row.kind}")
            if spec.get("replicas") != old.get("replicas"):
                changed[name] = {"replicas": spec.get("replicas"), "template": spec.get("template")}
        return {"spec": {key: changed}}

    def scale(self, manifest: dict[str, Any], podset: str, count: int) -> None:
        """An elastic Worker runs with its admitted count, within elasticPolicy's bounds."""
        if podset not in self.elastic(manifest):
            super().scale(manifest, podset, count)
        key = self.row.replica_specs
        for row in replica_rows(self._specs(manifest), f"spec.{key}"):
            if row.name == podset:
                cast("dict[str, Any]", row.spec)["replicas"] = count

    def queue(self, manifest: Mapping[str, Any]) -> tuple[Any, str] | None:
        value = self._scheduling(manifest).get("queue")
        return (value, "spec.runPolicy.schedulingPolicy.queue") if value else None


ADAPTERS: tuple[Training, ...] = tuple(Training(row) for row in TABLE)
PYTORCHJOB = next(a.resource for a in ADAPTERS if a.resource.kind == "PyTorchJob")


def build_pytorchjob(
    cmd: Dispatch, policy: PodPolicy, namespace: str, gpu_resource: str = "nvidia.com/gpu"
) -> WorkloadPlan:
    """A PyTorchJob: Master x1 + Worker xN. With one podset of R replicas, one replica is the
    Master and R-1 are Workers, both templates pinned to the podset's nodes; with two podsets,
    the first (1 replica) is the Master and the second the Workers. The Training Operator
    injects WORLD_SIZE/RANK/MASTER_ADDR."""
    gang = cmd.spec.gang
    check_assignment(cmd)
    by_name = assigned(cmd)

    def admitted(ps: PodSet) -> int:  # fewer than asked for under partial admission
        return len(by_name.get(ps.name) or ()) or ps.replicas

    if len(gang) == 1:
        ps = gang[0]
        roles = [("Master", ps, 1)]
        if admitted(ps) > 1:
            roles.append(("Worker", ps, admitted(ps) - 1))
    elif len(gang) == 2 and gang[0].replicas == 1:
        roles = [("Master", gang[0], 1), ("Worker", gang[1], admitted(gang[1]))]
    else:
        raise KindError(
            "gang: pytorchjob needs one podset (one replica becomes the Master) or two podsets "
            "(a 1-replica master, then the workers)"
        )
    base = workload_name(cmd.job_id, cmd.attempt)
    total = sum(admitted(ps) for ps in gang)
    pins = pin_podsets(by_name, {ps.name: (ps.gpu, str(ps.cpu), str(ps.memory)) for ps in gang})
    specs: dict[str, Any] = {}
    for role, ps, replicas in roles:
        template: dict[str, Any] = {
            "spec": {"containers": [container(cmd, "pytorch", ps, gpu_resource)]}
        }
        pin = pins.get(ps.name, Pin((), None, True))
        prepare_template(template, cmd, policy, ps.name, role.lower(), pin, total, role == "Master")
        specs[role] = {"replicas": replicas, "restartPolicy": "Never", "template": template}
    run_policy: dict[str, Any] = {"backoffLimit": 0, "cleanPodPolicy": "None"}
    if policy.ttl_seconds is not None:
        run_policy["ttlSecondsAfterFinished"] = policy.ttl_seconds
    body = {
        "apiVersion": PYTORCHJOB.api_version,
        "kind": "PyTorchJob",
        "metadata": object_meta(cmd, base, namespace),
        "spec": {"runPolicy": run_policy, "pytorchReplicaSpecs": specs},
    }
    return finish(base, [PlannedObject(PYTORCHJOB, body)], total, [p.name for p in gang])
