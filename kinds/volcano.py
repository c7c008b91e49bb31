"""Volcano Job (batch.volcano.sh/v1alpha1, Volcano v1.15)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from kinds.adapter import Adapter
from kinds.base import (
    KindError,
    PodTemplate,
    ReplicaRow,
    Resource,
    Verdict,
    count,
    ensure,
    keep_pins,
    keep_ttl,
    listed,
    mapping,
    rename_hosts,
    replica_rows,
    verdict_reason,
)
from kinds.topology import volcano_topology

# Volcano's webhook rewrites `maxRetry: 0` to its default 3, so retries are turned off with
# policies: a failed or evicted pod aborts the job, and Muster's restart budget decides.
ABORT_POLICIES = [
    {"event": "PodFailed", "action": "AbortJob"},
    {"event": "PodEvicted", "action": "AbortJob"},
]
# `status.state.phase`: Completing is entered only through a CompleteJob action (the job is
# done, its remaining pods are being killed); Aborting/Terminating lead only to Aborted/
# Terminated.
SUCCESS = frozenset({"Completing", "Completed"})
FAILURE = frozenset({"Failed", "Aborting", "Aborted", "Terminating", "Terminated"})


class VolcanoJob(Adapter):
    resource = Resource("batch.volcano.sh/v1alpha1", "Job", "jobs")
    podsets_doc = "the task `name` (`default` for a single unnamed task)"
    retries_doc = "job and task `policies`: `PodFailed`/`PodEvicted` -> `AbortJob`"
    verdict_doc = "`status.state.phase` (`Completed` vs `Failed`/`Aborted`/`Terminated`)"
    retry_field = ("spec", "maxRetry")

    def templates(self, manifest: Mapping[str, Any]) -> list[PodTemplate]:
        rows = self._rows(manifest)
        if not rows:
            raise KindError("spec.tasks: a Volcano Job needs at least one task")
        return [
            PodTemplate(row.name, row.replicas(), row.template(), False, row.name, row.path)
            for row in rows
        ]

    def rename(self, manifest: dict[str, Any], old: str, new: str) -> None:
        """Volcano's `svc` plugin names pods `<job>-<task>-<index>` in the subdomain `<job>`:
        hostnames an author wrote from the old name follow the rename."""
        spec = manifest.get("spec")
        if isinstance(spec, dict):
            tasks = [str(t.get("name")) for t in spec.get("tasks") or [] if isinstance(t, dict)]
            rename_hosts(self.templates(manifest), old, new, tasks, 1, None)

    def disable_retries(self, manifest: dict[str, Any]) -> None:
        spec = ensure(manifest, "spec")
        spec.pop("maxRetry", None)
        spec["policies"] = [dict(p) for p in ABORT_POLICIES]
        for task in spec.get("tasks") or []:
            if isinstance(task, dict):
                task["policies"] = [dict(p) for p in ABORT_POLICIES]
                ensure(ensure(task, "template"), "spec")["restartPolicy"] = "Never"

    def set_ttl(self, manifest: dict[str, Any], seconds: int) -> None:
        keep_ttl(ensure(manifest, "spec"), seconds)

    def verdict(self, name: str, status: Mapping[str, Any]) -> Verdict | None:
        state = status.get("state")
        if not isinstance(state, Mapping) or not state.get("phase"):
            return None
        phase = str(state["phase"])
        if phase in SUCCESS:
            result = "succeeded"
        elif phase in FAILURE:
            result = "failed"
        else:
            return None
        what = f"Volcano Job {name}"
        return Verdict(
            result, verdict_reason(what, phase, state.get("reason"), state.get("message"))
        )

    def min_available(self, manifest: Mapping[str, Any]) -> int | None:
        spec = mapping(manifest.get("spec"), "spec")
        return count(spec.get("minAvailable"), "spec.minAvailable", 0) or None

    def elastic(self, manifest: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
        """A task's own `minAvailable` below its `replicas` makes it run between the two.
        `spec.minAvailable` below the job's pods: Volcano starts the job once that many pods
        run and keeps it running while they do; the pods above it come from one podset (the
        single task, else `worker`) without a minimum of its own, which runs between what
        minAvailable leaves it and its `replicas`. Otherwise the job-level minimum stays a
        label (see broker/manifests.py)."""
        out: dict[str, tuple[int, int]] = {}
        for row in self._rows(manifest):
            raw = row.spec.get("minAvailable")
            size = row.replicas()
            if raw is not None and size > 1:
                low = count(raw, f"{row.path}.minAvailable", size)
                if low < size:
                    out[row.name] = (max(1, low), size)
        least = self.min_available(manifest)
        rows = self.templates(manifest)
        total = sum(t.replicas for t in rows)
        if least is None or least >= total:
            return out
        scalable = [t for t in rows if len(rows) == 1 or t.podset == "worker"]
        if len(scalable) != 1 or scalable[0].podset in out:
            return out
        others = total - scalable[0].replicas
        return {**out, scalable[0].podset: (max(1, least - others), scalable[0].replicas)}

    def _rows(self, manifest: Mapping[str, Any]) -> list[ReplicaRow]:
        spec = mapping(manifest.get("spec"), "spec", required=True)
        tasks = listed(spec.get("tasks"), "spec.tasks")
        default = "default" if len(tasks) == 1 else None  # a single unnamed task
        return replica_rows(tasks, "spec.tasks", default_name=default)

    resizable = True

    def resize_patch(self, live: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
        """`spec.tasks` with each task's new `replicas` (a list: a merge patch replaces it
        whole, so every other field is the live one). Volcano scales a running job's tasks
        but keeps their templates, so pods only use the nodes each task was pinned to."""
        counts = {row.name: row for row in self._rows(new)}
        tasks = []
        for row in self._rows(live):
            task = dict(row.spec)
            now = counts.get(row.name)
            if now is not None and now.spec.get("replicas") != row.spec.get("replicas"):
                where = f"{row.path}.template"
                keep_pins("Volcano Job", where, row.spec.get("template") or {},
                          now.spec.get("template") or {})  # fmt: skip
                task["replicas"] = now.spec.get("replicas")
            tasks.append(task)
        return {"spec": {"tasks": tasks}}

    def scale(self, manifest: dict[str, Any], podset: str, count: int) -> None:
        """The elastic task runs with its admitted count; minAvailable still holds (the
        podset's minimum is what minAvailable leaves it)."""
        if podset not in self.elastic(manifest):
            super().scale(manifest, podset, count)
        for row in self._rows(manifest):
            if row.name == podset:
                cast("dict[str, Any]", row.spec)["replicas"] = count

    def queue(self, manifest: Mapping[str, Any]) -> tuple[Any, str] | None:
        spec = mapping(manifest.get("spec"), "spec")
        value = spec.get("queue")
        return (value, "spec.queue") if value else None

    def topology(self, manifest: Mapping[str, Any]) -> dict[str, str]:
        return volcano_topology(mapping(manifest.get("spec"), "spec"))
