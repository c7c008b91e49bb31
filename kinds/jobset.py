"""JobSet (jobset.x-k8s.io/v1alpha2, JobSet v0.12)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kinds.adapter import Adapter
from kinds.base import (
    KindError,
    PodTemplate,
    Resource,
    Verdict,
    condition_verdict,
    count,
    ensure,
    job_pods,
    listed,
    mapping,
    podset_name,
    template_at,
)


class JobSet(Adapter):
    """Every replicated Job's pods run at once; `dependsOn` stages are reserved together, so a
    serial pipeline holds its later stages' capacity while the first runs (docs/kinds.md)."""

    resource = Resource("jobset.x-k8s.io/v1alpha2", "JobSet", "jobsets")
    podsets_doc = "the replicatedJob `name` (replicas x min(parallelism, completions) pods)"
    retries_doc = "`failurePolicy.maxRestarts: 0`, every Job `backoffLimit: 0`, pods `Never`"
    verdict_doc = "conditions `Completed` vs `Failed`"

    def templates(self, manifest: Mapping[str, Any]) -> list[PodTemplate]:
        spec = mapping(manifest.get("spec"), "spec", required=True)
        rjobs = listed(spec.get("replicatedJobs"), "spec.replicatedJobs")
        if not rjobs:
            raise KindError("spec.replicatedJobs: a JobSet needs at least one replicatedJob")
        out: list[PodTemplate] = []
        for i, rjob in enumerate(rjobs):
            path = f"spec.replicatedJobs[{i}]"
            rjob = mapping(rjob, path)
            name = podset_name(rjob.get("name"), f"{path}.name")
            replicas = count(rjob.get("replicas"), f"{path}.replicas", 1)
            job_template = mapping(rjob.get("template"), f"{path}.template", required=True)
            job_spec = mapping(job_template.get("spec"), f"{path}.template.spec", required=True)
            pods = job_pods(job_spec, f"{path}.template.spec")
            tpl = template_at(job_spec.get("template"), f"{path}.template.spec.template")
            out.append(
                PodTemplate(name, replicas * pods, tpl, False, name, f"{path}.template.spec")
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

    def set_ttl(self, manifest: dict[str, Any], seconds: int) -> None:
        ensure(manifest, "spec")["ttlSecondsAfterFinished"] = seconds

    def verdict(self, name: str, status: Mapping[str, Any]) -> Verdict | None:
        return condition_verdict(f"JobSet {name}", status, ("Completed",), ("Failed",))
