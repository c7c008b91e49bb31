"""JobSet (jobset.x-k8s.io/v1alpha2, JobSet v0.12)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kinds.adapter import Adapter
from kinds.base import (
    KindError,
    PodTemplate,
    ReplicaRow,
    Resource,
    Verdict,
    condition_verdict,
    ensure,
    job_pods,
    keep_ttl,
    listed,
    mapping,
    rename_hosts,
    replica_rows,
    template_at,
)
from kinds.topology import exclusive_topology


class JobSet(Adapter):
    """Every replicated Job's pods run at once; `dependsOn` stages are reserved together, so a
    serial pipeline holds its later stages' capacity while the first runs (docs/kinds.md)."""

    resource = Resource("jobset.x-k8s.io/v1alpha2", "JobSet", "jobsets")
    podsets_doc = "the replicatedJob `name` (replicas x min(parallelism, completions) pods)"
    retries_doc = "`failurePolicy.maxRestarts: 0`, every Job `backoffLimit: 0`, pods `Never`"
    verdict_doc = "conditions `Completed` vs `Failed`"
    retry_field = ("spec", "failurePolicy", "maxRestarts")
    suspend_field = ("spec", "suspend")
    managed_by_field = ("spec", "managedBy")
    controllers = frozenset({"jobset.sigs.k8s.io/jobset-controller"})

    def templates(self, manifest: Mapping[str, Any]) -> list[PodTemplate]:
        spec = mapping(manifest.get("spec"), "spec", required=True)
        rjobs = listed(spec.get("replicatedJobs"), "spec.replicatedJobs")
        if not rjobs:
            raise KindError("spec.replicatedJobs: a JobSet needs at least one replicatedJob")
        out: list[PodTemplate] = []
        for row in replica_rows(rjobs, "spec.replicatedJobs"):
            job_template = mapping(row.spec.get("template"), f"{row.path}.template", required=True)
            spec_path = f"{row.path}.template.spec"
            job_spec = mapping(job_template.get("spec"), spec_path, required=True)
            pods = job_pods(job_spec, spec_path)
            tpl = template_at(job_spec.get("template"), f"{spec_path}.template")
            out.append(
                PodTemplate(row.name, row.replicas() * pods, tpl, False, row.name, spec_path)
            )
        return out

    def disable_retries(self, manifest: dict[str, Any]) -> None:
        spec = ensure(manifest, "spec")
        ensure(spec, "failurePolicy")["maxRestarts"] = 0
        for rjob in spec.get("replicatedJobs") or []:
            if isinstance(rjob, dict):
                job_spec = ensure(ensure(rjob, "template"), "spec")
                job_spec["backoffLimit"] = 0
                ensure(ensure(job_spec, "template"), "spec")["restartPolicy"] = "Never"

    def rename(self, manifest: dict[str, Any], old: str, new: str) -> None:
        """Pods of a JobSet are `<jobset>-<replicatedJob>-<job index>-<pod index>` in the
        subdomain `spec.network.subdomain` (default: the JobSet's name): an author's
        `MASTER_ADDR=pytorch-workers-0-0.pytorch` must follow the rename, or rendezvous fails."""
        spec = manifest.get("spec")
        if not isinstance(spec, dict) or old == new:
            return
        network = spec.get("network")
        subdomain = network.get("subdomain") if isinstance(network, dict) else None
        rjobs = [
            str(r.get("name")) for r in spec.get("replicatedJobs") or [] if isinstance(r, dict)
        ]
        rename_hosts(self.templates(manifest), old, new, rjobs, 2, subdomain)

    def set_ttl(self, manifest: dict[str, Any], seconds: int) -> None:
        keep_ttl(ensure(manifest, "spec"), seconds)

    def verdict(self, name: str, status: Mapping[str, Any]) -> Verdict | None:
        return condition_verdict(f"JobSet {name}", status, ("Completed",), ("Failed",))

    def topology(self, manifest: Mapping[str, Any]) -> dict[str, str]:
        meta = mapping(manifest.get("metadata"), "metadata")
        children = sum(row.replicas() for row in self._rows(manifest))
        return exclusive_topology(meta.get("annotations"), children, "metadata.annotations")

    def podset_topologies(self, manifest: Mapping[str, Any]) -> dict[str, dict[str, str]]:
        """A replicatedJob's own annotation binds its child Jobs (`template.metadata`)."""
        out: dict[str, dict[str, str]] = {}
        for row in self._rows(manifest):
            at = f"{row.path}.template.metadata"
            meta = mapping(
                mapping(row.spec.get("template"), f"{row.path}.template").get("metadata"), at
            )
            found = exclusive_topology(meta.get("annotations"), row.replicas(), f"{at}.annotations")
            if found:
                out[row.name] = found
        return out

    def _rows(self, manifest: Mapping[str, Any]) -> list[ReplicaRow]:
        spec = mapping(manifest.get("spec"), "spec", required=True)
        return replica_rows(
            listed(spec.get("replicatedJobs"), "spec.replicatedJobs"), "spec.replicatedJobs"
        )
