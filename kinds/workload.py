"""A Dispatch and its flavor become the Kubernetes objects of one attempt (pure, no I/O)."""

from __future__ import annotations

import copy
from collections.abc import Hashable
from typing import Any

from kinds.base import ANN_ORIGINAL_NAME, POD, KindError, podset_key
from kinds.batch import build_indexed_job
from kinds.demand import pod_demand
from kinds.kubeflow import build_pytorchjob
from kinds.plan import (
    PlannedObject,
    WorkloadPlan,
    assigned,
    check_assignment,
    child_name,
    finish,
    object_meta,
    workload_name,
)
from kinds.pods import Pin, PodPolicy, check_safety, pin_podsets, prepare_template, strip_kueue
from kinds.registry import adapter_of
from schemas.agent import Dispatch


def build_from_manifest(cmd: Dispatch, policy: PodPolicy, namespace: str) -> WorkloadPlan:
    """The user's manifest, patched: Muster's name/namespace/labels, the flavor's placement,
    the assigned nodes, MUSTER_* env, the kind's retries off. The rest is kept as written."""
    raw = cmd.spec.workload.manifest
    if not isinstance(raw, dict):
        raise KindError("workload.manifest: required for kind 'manifest'")
    manifest: dict[str, Any] = copy.deepcopy(raw)
    adapter = adapter_of(manifest)
    check_safety(manifest, policy)
    check_assignment(cmd)
    templates = adapter.patch_templates(manifest)
    by_key = {podset_key(k): list(v) for k, v in assigned(cmd).items()}
    # A partial admission (fewer) or an elastic podset admitted towards its maximum (more):
    # the kind runs the podset with the admitted count.
    written: dict[str, int] = {}
    for t in templates:
        written[t.podset] = written.get(t.podset, 0) + t.replicas
    scaled = False
    for podset, replicas in written.items():
        got = len(by_key.get(podset, ()))
        if got and got != replicas:
            adapter.scale(manifest, podset, got)
            scaled = True
    if scaled:
        templates = adapter.patch_templates(manifest)
    total = sum(t.replicas for t in templates)
    with_pods = [t for t in templates if t.replicas]
    podsets = {t.podset for t in with_pods}
    if len(podsets) == 1 and len(cmd.assignment) == 1 and not podsets & set(by_key):
        by_key = {next(iter(podsets)): list(cmd.assignment[0].nodes)}
    pins = pin_podsets(by_key, _shapes(raw))
    anywhere = Pin(tuple(sorted({n for a in cmd.assignment for n in a.nodes})), None, False)
    for t in templates:
        pin = pins.get(t.podset, anywhere)
        prepare_template(t.template, cmd, policy, t.podset, t.role, pin, total, t.leader)
    adapter.disable_retries(manifest)
    adapter.take_control(manifest)
    if policy.ttl_seconds is not None:
        adapter.set_ttl(manifest, policy.ttl_seconds)
    base = workload_name(cmd.job_id, cmd.attempt)
    names = list(dict.fromkeys(t.podset for t in templates))
    if adapter.created != adapter.resource:  # a pod group: the agent creates its Pods
        return finish(base, _group_pods(cmd, manifest, base, namespace), total, names)
    original = (raw.get("metadata") or {}).get("name")
    if isinstance(original, str) and original:
        adapter.rename(manifest, original, base)
    _take_over(manifest, cmd, base, namespace)
    return finish(base, [PlannedObject(adapter.resource, manifest)], total, names)


def _take_over(obj: dict[str, Any], cmd: Dispatch, name: str, namespace: str) -> None:
    """Muster's name, namespace, labels and annotations on a user's object (theirs kept, but
    `kueue.x-k8s.io/*` labels), the original name remembered, and no status."""
    old = obj.get("metadata")
    if not isinstance(old, dict):
        old = {}
    strip_kueue(old)
    meta = object_meta(cmd, name, namespace)
    meta["labels"] = {**(old.get("labels") or {}), **meta["labels"]}
    meta["annotations"] = {**(old.get("annotations") or {}), **meta["annotations"]}
    if old.get("name"):
        meta["annotations"][ANN_ORIGINAL_NAME] = str(old["name"])
    obj["metadata"] = meta
    obj.pop("status", None)


def _group_pods(
    cmd: Dispatch, manifest: dict[str, Any], base: str, namespace: str
) -> list[PlannedObject]:
    out = []
    for i, pod in enumerate(manifest.get("items") or []):
        original = (pod.get("metadata") or {}).get("name", "")
        _take_over(pod, cmd, child_name(base, f"{i}-{original}"), namespace)
        out.append(PlannedObject(POD, pod))
    return out


def _shapes(manifest: dict[str, Any]) -> dict[str, Hashable]:
    """podset -> what each of its pods asks for (podsets of equal shape share nodes)."""
    out: dict[str, Hashable] = {}
    for t in adapter_of(manifest).templates(manifest):
        try:
            d = pod_demand(t.template, t.path)
        except KindError:
            out[t.podset] = t.podset
            continue
        out.setdefault(t.podset, (d.gpu, d.cpu, d.memory))
    return out


def build_workload(
    cmd: Dispatch, policy: PodPolicy, namespace: str, gpu_resource: str = "nvidia.com/gpu"
) -> WorkloadPlan:
    """Dispatch -> the objects to create, by `spec.workload.kind`."""
    kind = cmd.spec.workload.kind
    if kind == "indexed-job":
        return build_indexed_job(cmd, policy, namespace, gpu_resource)
    if kind == "pytorchjob":
        return build_pytorchjob(cmd, policy, namespace, gpu_resource)
    if kind == "manifest":
        return build_from_manifest(cmd, policy, namespace)
    raise KindError(f"workload.kind: unsupported kind {kind!r}")
