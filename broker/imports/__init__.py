"""Importers of the Kubernetes objects users already write for Kueue, Volcano and
Koordinator or scheduler-plugins, one module per source system, and `Importer`, which hands each
object to the one that reads its kind. broker/config.py merges what they collected into the
Muster config."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from broker.imports.base import DNS_LABEL, ConfigError, Imported
from broker.imports.elastic import ElasticImporter
from broker.imports.kueue import KueueImporter
from broker.imports.volcano import VolcanoImporter

__all__ = ["Importer"]

_PRIORITY_KINDS = {
    ("scheduling.k8s.io", "PriorityClass"),
    ("kueue.x-k8s.io", "WorkloadPriorityClass"),
}
_KUEUE_IGNORED = {
    "AdmissionCheck",
    "MultiKueueConfig",
    "MultiKueueCluster",
    "ProvisioningRequestConfig",
    "Topology",
    "Workload",
}


# Objects that come with the imported ones but configure no queue: noted and skipped.
_SKIPPED = {
    ("scheduling.x-k8s.io", "Queue"): (
        "Koord-Queue's Queue orders the jobs of its quotas (queuePolicy Priority: higher "
        "priority first), as every Muster queue does (priority, then submission order); the "
        "quotas themselves come from the ElasticQuota objects"
    ),
    ("scheduling.volcano.sh", "PodGroup"): (
        "a PodGroup is one job's gang, not a queue; submit the job itself (`muster submit`) "
        "and Muster derives the gang from it"
    ),
}


class Importer:
    """Collects flavor classes, queues, cohorts, aliases and notes from Kubernetes objects."""

    def __init__(self) -> None:
        self.out = Imported()
        kueue = KueueImporter(self.out)
        volcano = VolcanoImporter(self.out)
        elastic = ElasticImporter(self.out)
        self._sources = (kueue, volcano, elastic)
        self._handlers: dict[tuple[str, str], Callable[..., None]] = {
            ("kueue.x-k8s.io", "ResourceFlavor"): kueue.resource_flavor,
            ("kueue.x-k8s.io", "ClusterQueue"): kueue.cluster_queue,
            ("kueue.x-k8s.io", "LocalQueue"): kueue.local_queue,
            ("kueue.x-k8s.io", "Cohort"): kueue.cohort,
            ("scheduling.volcano.sh", "Queue"): volcano.queue,
            ("scheduling.incubator.k8s.io", "Queue"): volcano.queue,
            ("scheduling.sigs.k8s.io", "ElasticQuota"): elastic.koord_quota,
            ("scheduling.x-k8s.io", "ElasticQuota"): elastic.plugins_quota,
        }

    def add(self, doc: Mapping[str, Any], source: str, index: int) -> None:
        api_version = str(doc.get("apiVersion"))
        kind = str(doc.get("kind"))
        group = api_version.rpartition("/")[0]
        metadata = doc.get("metadata")
        metadata = metadata if isinstance(metadata, Mapping) else {}
        raw_name = metadata.get("name")
        ctx = f"{source}: document {index} ({kind} {raw_name or '<no name>'})"
        if not isinstance(raw_name, str) or not DNS_LABEL.match(raw_name) or len(raw_name) > 63:
            raise ConfigError(
                f"{ctx}: metadata.name: {raw_name!r} is not a valid name; Muster queue and "
                "flavor names are DNS labels (lower-case letters, digits and '-')"
            )
        spec = doc.get("spec", {})
        if spec is None:
            spec = {}
        if not isinstance(spec, Mapping):
            raise ConfigError(f"{ctx}: spec: expected a mapping, got {type(spec).__name__}")
        if (group, kind) in _PRIORITY_KINDS:
            self._priority_class(raw_name, doc, ctx)
            return
        handler = self._handlers.get((group, kind))
        if handler is None:
            if group == "kueue.x-k8s.io" and kind in _KUEUE_IGNORED:
                self.out.notes.append(f"{ctx}: ignored; Muster has no equivalent of a Kueue {kind}")
                return
            skipped = _SKIPPED.get((group, kind))
            if skipped is not None:
                self.out.notes.append(f"{ctx}: skipped; {skipped}")
                return
            raise ConfigError(
                f"{ctx}: {api_version} {kind} is not a config object Muster imports; supported: "
                "Kueue ResourceFlavor/ClusterQueue/LocalQueue/Cohort/WorkloadPriorityClass, "
                "PriorityClass, Volcano Queue, ElasticQuota of Koordinator or "
                "scheduler-plugins (job manifests go to "
                "`muster submit`)"
            )
        handler(raw_name, spec, metadata, ctx, source)

    def _priority_class(self, name: str, doc: Mapping[str, Any], ctx: str) -> None:
        """PriorityClass / WorkloadPriorityClass: its `value` is the priority of the jobs that
        name it (checked against Muster's range once the Muster document had its say)."""
        value = doc.get("value")
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{ctx}: value: expected a whole number, got {value!r}")
        seen = self.out.priority_classes.get(name)
        if seen is not None and seen[0] != value:
            raise ConfigError(
                f"{ctx}: priority class {name!r} is also defined with value {seen[0]} "
                f"({seen[1]}); give both the same value or rename one"
            )
        self.out.priority_classes[name] = (value, ctx)
        if doc.get("globalDefault") is True:
            self.out.notes.append(
                f"{ctx}: globalDefault is not applied; a job that names no priority class "
                "keeps its own priority (0 unless it sets one)"
            )

    def finish(self) -> Imported:
        """Turn the pending Volcano queues and ElasticQuotas into queues and cohorts."""
        for source in self._sources:
            source.finish()
        return self.out
