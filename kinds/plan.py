"""The objects of one attempt, and the names and metadata every kind gives them."""

from __future__ import annotations

import base64
import hashlib
import re
from typing import Any, NamedTuple

import msgspec

from kinds.base import ANN_JOB, ANN_KIND, ANN_TOTAL, LABEL_TOP, KindError, Resource
from kinds.pods import muster_labels
from schemas.agent import Dispatch
from schemas.job import PodSet

_NAME_RE = re.compile(r"[^a-z0-9-]+")


class PlannedObject(NamedTuple):
    resource: Resource
    body: dict[str, Any]
    # The name of an earlier object of the plan that controls this one: the agent sets the
    # owner reference from the uid the create returned, so deleting the owner cleans it up.
    owner: str = ""

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])


class WorkloadPlan(msgspec.Struct):
    """What the agent creates, in order (an owner before the objects it controls)."""

    name: str
    objects: list[PlannedObject]
    total_replicas: int
    podsets: list[str]


def _hash(text: str, n: int = 6) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:n]


def _slug(text: str) -> str:
    return _NAME_RE.sub("-", text.lower()).strip("-")


def id_digest(job_id: str) -> str:
    """80 bits of SHA-256 of the exact job id, as 16 DNS-safe characters (base32)."""
    raw = hashlib.sha256(job_id.encode()).digest()[:10]
    return base64.b32encode(raw).decode().lower()


def workload_name(job_id: str, attempt: int) -> str:
    """A DNS-1035 name unique per (job_id, attempt), at most ~40 characters, readable when the
    id is already a clean DNS label (then the name is the id itself). Any other id is a short
    readable core plus 80 bits of its digest: finding an id whose name lands on another job's
    objects is a second preimage of SHA-256 truncated to 80 bits, not the seconds a 24-bit
    hash took. The agent still refuses to adopt or delete an object that is not its attempt's
    (agents/kube/backend.py), whatever its name."""
    slug = _slug(job_id)
    if slug != job_id or len(slug) > 28 or not slug[:1].isalpha():
        core = slug[:12].strip("-")
        slug = f"{core}-{id_digest(job_id)}" if core else id_digest(job_id)
        if not slug[0].isalpha():
            slug = "j" + slug
    return f"{slug}-a{attempt}"


def child_name(base: str, part: str, limit: int = 52) -> str:
    """`base-part` within `limit` (Indexed Job pods are named `<job>-<index>-<suffix>` and
    their hostname `<job>-<index>` must stay a 63-character label)."""
    name = f"{base}-{_slug(part)}".strip("-")
    if len(name) > limit:
        name = f"{name[: limit - 7].rstrip('-')}-{_hash(name)}"
    return name


def object_meta(cmd: Dispatch, name: str, namespace: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": {**muster_labels(cmd.job_id, cmd.attempt), LABEL_TOP: "true"},
        "annotations": {
            ANN_JOB: cmd.job_id,
            ANN_TOTAL: "0",  # filled in by finish()
            ANN_KIND: cmd.spec.workload.kind,
        },
    }


def assigned(cmd: Dispatch) -> dict[str, list[str]]:
    return {a.podset: list(a.nodes) for a in cmd.assignment}


def check_assignment(cmd: Dispatch) -> None:
    by_name = assigned(cmd)
    for ps in cmd.spec.gang:
        nodes = by_name.get(ps.name)
        if nodes is not None and not ps.admits(len(nodes)):
            raise KindError(
                f"assignment: podset {ps.name!r} has {len(nodes)} nodes for {ps.replicas} replicas"
            )


def container(cmd: Dispatch, name: str, ps: PodSet, gpu_resource: str) -> dict[str, Any]:
    """The one container of a Muster-built workload (`workload.image` and friends)."""
    w = cmd.spec.workload
    if not w.image:
        raise KindError(f"workload.image: required for kind {w.kind!r}")
    requests: dict[str, Any] = {"cpu": str(ps.cpu), "memory": str(ps.memory)}
    resources: dict[str, Any] = {"requests": requests}
    limits: dict[str, Any] = {}
    if ps.gpu:
        requests[gpu_resource] = str(ps.gpu)
        limits[gpu_resource] = str(ps.gpu)
    for res, amount in sorted(ps.extended.items()):  # fabric: requests equal limits, as required
        requests[res] = limits[res] = str(amount)
    if limits:
        resources["limits"] = limits
    c: dict[str, Any] = {
        "name": name,
        "image": w.image,
        "resources": resources,
        "ports": [{"name": "rdzv", "containerPort": w.port}],
        "env": [{"name": k, "value": v} for k, v in sorted(w.env.items())]
        + [
            {"name": k, "valueFrom": {"secretKeyRef": msgspec.to_builtins(ref)}}
            for k, ref in sorted(w.secret_env.items())
        ],
    }
    if w.command:
        c["command"] = list(w.command)
    if w.args:
        c["args"] = list(w.args)
    return c


def owner_reference(resource: Resource, name: str, uid: str) -> dict[str, Any]:
    """A controller reference, as the built-in controllers set it (foreground deletion of the
    owner waits for the dependent)."""
    return {
        "apiVersion": resource.api_version,
        "kind": resource.kind,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def finish(base: str, objects: list[PlannedObject], total: int, podsets: list[str]) -> WorkloadPlan:
    for obj in objects:
        obj.body["metadata"]["annotations"][ANN_TOTAL] = str(total)
    return WorkloadPlan(name=base, objects=objects, total_replicas=total, podsets=podsets)
