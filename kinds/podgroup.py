"""Kueue plain pod groups: Pods sharing `kueue.x-k8s.io/pod-group-name`, sized by the
`kueue.x-k8s.io/pod-group-total-count` annotation, are one gang. The broker gathers them from a
multi-document file into one `v1 List`; the agent creates each Pod of it."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from typing import Any

from kinds.adapter import Adapter
from kinds.base import POD, KindError, PodTemplate, Resource, ensure, listed, mapping

GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
TOTAL_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
LIST = Resource("v1", "List", "pods")  # what the broker gathers; the agent creates its Pods


def _shape(pod: Mapping[str, Any]) -> str:
    spec = copy.deepcopy(dict(mapping(pod.get("spec"), "spec")))
    spec.pop("nodeName", None)
    return json.dumps(spec, sort_keys=True, default=str)


class PodGroup(Adapter):
    resource = LIST
    has_status = False
    podsets_doc = (
        "`pods` for the group's first pod spec, `pods-2`, ... for other specs (one pod each)"
    )
    retries_doc = "every pod `restartPolicy: Never`"
    verdict_doc = "the pods' phases (no object of its own)"

    @property
    def created(self) -> Resource:
        return POD

    def templates(self, manifest: Mapping[str, Any]) -> list[PodTemplate]:
        items = listed(manifest.get("items"), "items")
        if not items:
            raise KindError("items: a pod group needs at least one Pod")
        shapes: dict[str, str] = {}
        out: list[PodTemplate] = []
        for i, item in enumerate(items):
            pod = mapping(item, f"items[{i}]")
            if pod.get("kind") != "Pod":
                raise KindError(f"items[{i}].kind: a pod group holds Pods only")
            shape = _shape(pod)
            podset = shapes.setdefault(shape, "pods" if not shapes else f"pods-{len(shapes) + 1}")
            name = str(mapping(pod.get("metadata"), f"items[{i}].metadata").get("name") or i)
            out.append(PodTemplate(podset, 1, item, False, name, f"items[{i}]"))
        return out

    def disable_retries(self, manifest: dict[str, Any]) -> None:
        for item in manifest.get("items") or []:
            if isinstance(item, dict):
                ensure(item, "spec")["restartPolicy"] = "Never"


def grouped(doc: Any) -> bool:
    """A Pod that belongs to a Kueue pod group (its gang is the whole group)."""
    if not isinstance(doc, Mapping) or doc.get("kind") != "Pod":
        return False
    meta = doc.get("metadata")
    labels = meta.get("labels") if isinstance(meta, Mapping) else None
    return isinstance(labels, Mapping) and bool(labels.get(GROUP_LABEL))


def group_pods(docs: list[Any]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Split documents into pod-group Lists (one per group name, in first-seen order) and the
    other documents. A group must hold exactly its declared total count of Pods."""
    groups: dict[str, list[dict[str, Any]]] = {}
    rest: list[Any] = []
    for doc in docs:
        labels = (doc.get("metadata") or {}).get("labels") or {} if isinstance(doc, dict) else {}
        name = labels.get(GROUP_LABEL) if isinstance(labels, dict) else None
        if isinstance(doc, dict) and doc.get("kind") == "Pod" and name:
            groups.setdefault(str(name), []).append(doc)
        else:
            rest.append(doc)
    lists = []
    for name, pods in groups.items():
        totals = {
            str(((p.get("metadata") or {}).get("annotations") or {}).get(TOTAL_ANNOTATION, ""))
            for p in pods
        }
        if len(totals) != 1 or not re.fullmatch(r"[0-9]{1,6}", next(iter(totals))):
            raise KindError(
                f"pod group {name!r}: every pod needs the same {TOTAL_ANNOTATION} annotation "
                "(the number of pods in the group)"
            )
        total = int(next(iter(totals)))
        if total != len(pods):
            raise KindError(
                f"pod group {name!r}: {TOTAL_ANNOTATION} says {total} pods but the file holds "
                f"{len(pods)}; put the whole group in one file"
            )
        first = pods[0].get("metadata") or {}
        meta = {"name": name, "labels": dict(first.get("labels") or {})}
        if first.get("namespace"):
            meta["namespace"] = first["namespace"]
        lists.append({"apiVersion": "v1", "kind": "List", "metadata": meta, "items": pods})
    return lists, rest
