"""The broker's YAML config, and importers for the Kueue / Volcano / Koordinator objects users
already write.

A config file is YAML with one or more documents:

- at most one Muster document (a mapping without `apiVersion`/`kind`) holding the fields of
  `schemas.config.BrokerConfig`, plus two loader-only keys:
  `import: [kueue.yaml, volcano-queues.yaml]` (paths relative to the config file; those files
  hold Kubernetes objects only) and `queue_aliases: {local-name: queue}`;
- any number of Kubernetes documents (they have `apiVersion` and `kind`), imported as if they
  had been listed under `import`: Kueue ResourceFlavor / ClusterQueue / LocalQueue / Cohort,
  Volcano Queue, ElasticQuota of Koordinator or scheduler-plugins. A `kind: List` is unpacked.

Imports mean what the source system means (the field-by-field table is docs/compat.md):
parent quotas and parent queues become cohorts, an imported Kueue ClusterQueue admits only the
resources it lists, and every field Muster does not honour yields a note naming it.

Merging: imported flavors and queues come first; an entry of the Muster document with the same
name replaces the imported one, so a Muster file can override one imported queue. Two imports
defining the same name is an error. If nothing defines queues, the default `default` queue
stays.

Units: in YAML, quota `cpu` is a Kubernetes quantity in cores ("64", 64, "500m") and `memory`
one in bytes ("256Gi", 1073741824); both are normalised to millicores and bytes before
validation, as `BrokerConfig` stores them. `gpu` is a whole number of devices.

Every error is a ConfigError naming the file, the document, the field path and the fix.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import yaml

from broker.manifests import gpu_type_from_labels, is_manifest
from kinds.nodelabels import CAPACITY_LABELS, GPU_TYPE_SELECTOR_LABELS, capacity_type_from_labels
from schemas.codec import DecodeError, convert_config, every_field
from schemas.config import BrokerConfig
from schemas.fieldhints import explain
from schemas.quantity import QuantityError, cpu_milli, memory_bytes, parse_quantity

__all__ = [
    "ANY_FLAVOR",
    "ConfigError",
    "LoadedConfig",
    "config_to_yaml",
    "from_elastic_quota",
    "from_kueue",
    "from_volcano",
    "import_documents",
    "kueue_aliases",
    "load_config",
    "load_config_full",
    "parse_config",
]

# The flavor class that Volcano and Koordinator quotas (which know no flavors) are written
# against: it has no capacity or GPU type, so every cluster flavor matches it.
ANY_FLAVOR = "any"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LOADER_KEYS = ("import", "queue_aliases")
_QUOTA_FIELDS = ("nominal", "borrowing_limit", "lending_limit")
# Taints (and the values) that mark spot nodes: a flavor whose nodeTaints carry one is spot; one
# that only tolerates one may land on spot capacity.
_SPOT_TAINTS: dict[str, frozenset[str]] = {
    "cloud.google.com/gke-spot": frozenset({"true"}),
    "cloud.google.com/gke-preemptible": frozenset({"true"}),
    "kubernetes.azure.com/scalesetpriority": frozenset({"spot"}),
    "karpenter.sh/capacity-type": frozenset({"spot"}),
    "eks.amazonaws.com/capacityType": frozenset({"spot"}),
    "spot": frozenset({"true"}),
}
# Hand-made node labels for the capacity type, as in Kueue's examples (`node-type: spot`).
_GENERIC_CAPACITY_KEYS = ("node-type", "instance-type", "capacity-type", "lifecycle")
_GENERIC_CAPACITY_VALUES = {
    "spot": "spot",
    "preemptible": "spot",
    "on-demand": "on-demand",
    "ondemand": "on-demand",
    "on_demand": "on-demand",
    "regular": "on-demand",
}
# Node labels a flavor class is matched by (capacity type and GPU type); others are noted.
_MATCHED_LABELS = frozenset(
    {
        *_SPOT_TAINTS,
        *_GENERIC_CAPACITY_KEYS,
        *CAPACITY_LABELS,
        *GPU_TYPE_SELECTOR_LABELS,
    }
)
_PRIORITY_KINDS = {
    ("scheduling.k8s.io", "PriorityClass"),
    ("kueue.x-k8s.io", "WorkloadPriorityClass"),
}
_PRIORITY_RANGE = 1_000_000  # a job's priority lies within +-this (schemas.job.JobSpec)
_CLUSTER_QUEUE_FIELDS = (
    "cohort",
    "cohortName",
    "queueingStrategy",
    "fairSharing",
    "preemption",
    "resourceGroups",
    "namespaceSelector",
    "flavorFungibility",
    "admissionChecks",
    "admissionChecksStrategy",
    "admissionScope",
    "stopPolicy",
)
_VOLCANO_FIELDS = (
    "weight",
    "capability",
    "deserved",
    "guarantee",
    "reclaimable",
    "parent",
    "state",
    "priority",
    "affinity",
    "extendClusters",
    "type",
    "dequeueStrategy",
)
_KOORD = "quota.scheduling.koordinator.sh/"
_KOORD_LABELS = frozenset(
    {
        f"{_KOORD}parent",
        f"{_KOORD}is-parent",
        f"{_KOORD}allow-lent-resource",
        f"{_KOORD}shared-weight",
    }
)
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


class ConfigError(ValueError):
    """An invalid config file: the text names the file, the field path and the fix."""


@dataclass
class LoadedConfig:
    """A config with what the loader learnt beside it.

    `aliases` maps a Kueue LocalQueue name (or a `queue_aliases` entry) to the queue it feeds;
    BrokerConfig has no field for it yet. `notes` lists what an import ignored or assumed.
    """

    config: BrokerConfig
    aliases: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)


# -- public API --------------------------------------------------------------------------


def load_config(path: str | Path | None) -> BrokerConfig:
    """Load the broker config from a YAML file; None gives the defaults."""
    return load_config_full(path).config


def load_config_full(path: str | Path | None) -> LoadedConfig:
    """Like load_config, and also return queue aliases and import notes."""
    if path is None:
        return LoadedConfig(BrokerConfig())
    p = Path(path)
    return parse_config(_read(p, str(path)), source=str(path), base_dir=p.parent)


def parse_config(
    text: str, *, source: str = "config", base_dir: Path | None = None
) -> LoadedConfig:
    """Parse config YAML text (see the module docstring for the layout)."""
    docs = _yaml_documents(text, source)
    muster_doc: dict[str, Any] | None = None
    kube_docs: list[tuple[str, int, Mapping[str, Any]]] = []
    for index, doc in enumerate(docs, start=1):
        if is_manifest(doc):
            kube_docs.extend((source, n, d) for n, d in _unpack_list(doc, index))
        elif isinstance(doc, Mapping):
            if muster_doc is not None:
                raise ConfigError(
                    f"{source}: document {index}: a second Muster config document; keep one "
                    "mapping of broker settings per file (Kubernetes objects may follow it)"
                )
            muster_doc = {str(k): v for k, v in doc.items()}
        else:
            raise ConfigError(
                f"{source}: document {index}: expected a mapping of broker settings, "
                f"got {type(doc).__name__}"
            )
    raw = muster_doc or {}
    imports = raw.get("import", [])
    if isinstance(imports, str):
        imports = [imports]
    if not isinstance(imports, list) or not all(isinstance(i, str) for i in imports):
        raise ConfigError(
            f"{source}: import: expected a list of file paths, e.g. import: [kueue.yaml]"
        )
    sources = [source]
    for rel in imports:
        p = Path(rel)
        if not p.is_absolute() and base_dir is not None:
            p = base_dir / p
        sub_docs = _yaml_documents(_read(p, f"{source}: import {rel!r}"), rel)
        for index, doc in enumerate(sub_docs, start=1):
            if not is_manifest(doc):
                raise ConfigError(
                    f"{rel}: document {index}: imported files hold Kubernetes objects only "
                    "(apiVersion and kind); put broker settings in the main config file"
                )
            kube_docs.extend((rel, n, d) for n, d in _unpack_list(doc, index))
        sources.append(rel)

    importer = _Importer()
    for src, index, doc in kube_docs:
        importer.add(doc, src, index)
    loaded = _assemble(raw, importer, source)
    loaded.sources = sources
    return loaded


def import_documents(
    docs: Iterable[Mapping[str, Any]], *, source: str = "documents"
) -> LoadedConfig:
    """Import Kubernetes objects (any mix of the supported kinds) into a config."""
    importer = _Importer()
    for index, doc in enumerate(docs, start=1):
        for n, d in _unpack_list(doc, index):
            importer.add(d, source, n)
    return _assemble({}, importer, source)


def from_kueue(docs: Iterable[Mapping[str, Any]]) -> BrokerConfig:
    """Kueue ResourceFlavor -> FlavorClass, ClusterQueue -> QueueConfig, LocalQueue -> an
    entry of `queue_aliases`."""
    return import_documents(_only(docs, "kueue.x-k8s.io", "Kueue"), source="Kueue objects").config


def kueue_aliases(docs: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """LocalQueue name -> ClusterQueue name, for the LocalQueues in `docs`."""
    return import_documents(_only(docs, "kueue.x-k8s.io", "Kueue"), source="Kueue objects").aliases


def from_volcano(docs: Iterable[Mapping[str, Any]]) -> BrokerConfig:
    """Volcano Queue: weight -> weight, capability -> nominal quota with no borrowing (on the
    flavor class `any`), reclaimable -> reclaimable."""
    return import_documents(
        _only(docs, "scheduling.volcano.sh", "Volcano"), source="Volcano objects"
    ).config


def from_elastic_quota(docs: Iterable[Mapping[str, Any]]) -> BrokerConfig:
    """ElasticQuota of Koordinator (scheduling.sigs.k8s.io) or scheduler-plugins
    (scheduling.x-k8s.io): min -> nominal, max - min -> borrowing limit; a Koordinator parent
    quota becomes a cohort; the top level shares the cohort `elastic-quota`."""
    return import_documents(
        _only(docs, ("scheduling.sigs.k8s.io", "scheduling.x-k8s.io"), "ElasticQuota"),
        source="ElasticQuota objects",
    ).config


# -- reading -----------------------------------------------------------------------------


def _read(path: Path, label: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{label}: file not found ({path}); check the path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{label}: cannot read {path}: {exc}") from None


def _yaml_documents(text: str, source: str) -> list[Any]:
    try:
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from None


def _unpack_list(doc: Any, index: int) -> list[tuple[int, Mapping[str, Any]]]:
    if isinstance(doc, Mapping) and doc.get("kind") == "List":
        items = doc.get("items") or []
        return [(index, d) for d in items if isinstance(d, Mapping)]
    return [(index, doc)]


def _only(
    docs: Iterable[Mapping[str, Any]], group: str | tuple[str, ...], what: str
) -> list[Mapping[str, Any]]:
    groups = (group,) if isinstance(group, str) else group
    out = []
    for i, doc in enumerate(docs, start=1):
        if not is_manifest(doc) or str(doc["apiVersion"]).rpartition("/")[0] not in groups:
            kind = doc.get("kind") if isinstance(doc, Mapping) else type(doc).__name__
            raise ConfigError(
                f"document {i} ({kind}): not a {what} object (apiVersion {groups[0]}/...); "
                "use import_documents for a mix of kinds"
            )
        out.append(doc)
    return out


# -- quantities --------------------------------------------------------------------------


def _resource_amount(resource: str, value: Any, where: str) -> int:
    """cpu -> millicores, memory -> bytes, gpu -> devices; Kubernetes quantity semantics."""
    if value is None:
        raise ConfigError(f"{where}: missing amount; write e.g. 8, '64' or '256Gi'")
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError(f"{where}: expected a quantity like 8, '64' or '256Gi', got {value!r}")
    try:
        if resource == "cpu":
            return cpu_milli(value)
        if resource == "memory":
            return memory_bytes(value)
        amount = parse_quantity(value)
    except QuantityError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if amount != amount.to_integral_value():
        raise ConfigError(f"{where}: {value!r} is not a whole number of GPUs; write e.g. 8")
    return int(amount)


def _normalise_quotas(raw: dict[str, Any], source: str) -> None:
    """Turn the quantities of a Muster document's quotas into integers, in place."""
    for key in ("queues", "cohorts"):
        entries = raw.get(key)
        if isinstance(entries, list):
            _normalise_entries(entries, f"{source}: {key}")


def _normalise_entries(entries: list[Any], where: str) -> None:
    for qi, queue in enumerate(entries):
        if not isinstance(queue, Mapping) or not isinstance(queue.get("quotas"), list):
            continue
        for fi, fq in enumerate(queue["quotas"]):
            if not isinstance(fq, Mapping) or not isinstance(fq.get("resources"), Mapping):
                continue
            base = f"{where}[{qi}].quotas[{fi}].resources"
            for res, rq in fq["resources"].items():
                if res not in ("gpu", "cpu", "memory"):
                    hint = (
                        " (Kubernetes' nvidia.com/gpu is `gpu` here)" if "gpu" in str(res) else ""
                    )
                    raise ConfigError(
                        f"{base}.{res}: unknown resource; use gpu, cpu or memory{hint}"
                    )
                if not isinstance(rq, dict):
                    if isinstance(rq, str | int | float) and not isinstance(rq, bool):
                        raise ConfigError(
                            f"{base}.{res}: expected a mapping like {{nominal: {rq!r}}}, "
                            f"got the bare amount {rq!r}"
                        )
                    continue
                for key in _QUOTA_FIELDS:
                    if rq.get(key) is not None:
                        rq[key] = _resource_amount(res, rq[key], f"{base}.{res}.{key}")


# -- importing Kubernetes objects --------------------------------------------------------


class _Importer:
    """Collects flavor classes, queues, cohorts, aliases and notes from Kubernetes objects.

    Volcano queues and ElasticQuotas are kept until `finish`, because whether one is a leaf
    (a queue) or a parent (a cohort) depends on the other objects of the import."""

    def __init__(self) -> None:
        self.flavors: dict[str, tuple[dict[str, Any], str]] = {}
        self.queues: dict[str, tuple[dict[str, Any], str]] = {}
        self.cohorts: dict[str, tuple[dict[str, Any], str]] = {}
        self.aliases: dict[str, tuple[str, str]] = {}
        self.priority_classes: dict[str, tuple[int, str]] = {}
        self.notes: list[str] = []
        self.needs_any_flavor = False
        self._volcano: dict[str, _Pending] = {}
        self._koord: dict[str, _Pending] = {}

    def add(self, doc: Mapping[str, Any], source: str, index: int) -> None:
        api_version = str(doc.get("apiVersion"))
        kind = str(doc.get("kind"))
        group = api_version.rpartition("/")[0]
        metadata = doc.get("metadata")
        metadata = metadata if isinstance(metadata, Mapping) else {}
        raw_name = metadata.get("name")
        ctx = f"{source}: document {index} ({kind} {raw_name or '<no name>'})"
        if not isinstance(raw_name, str) or not _DNS_LABEL.match(raw_name) or len(raw_name) > 63:
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
        handler = {
            ("kueue.x-k8s.io", "ResourceFlavor"): self._resource_flavor,
            ("kueue.x-k8s.io", "ClusterQueue"): self._cluster_queue,
            ("kueue.x-k8s.io", "LocalQueue"): self._local_queue,
            ("kueue.x-k8s.io", "Cohort"): self._kueue_cohort,
            ("scheduling.volcano.sh", "Queue"): self._volcano_queue,
            ("scheduling.incubator.k8s.io", "Queue"): self._volcano_queue,
            ("scheduling.sigs.k8s.io", "ElasticQuota"): self._koord_quota,
            ("scheduling.x-k8s.io", "ElasticQuota"): self._plugins_quota,
        }.get((group, kind))
        if handler is None:
            if group == "kueue.x-k8s.io" and kind in _KUEUE_IGNORED:
                self.notes.append(f"{ctx}: ignored; Muster has no equivalent of a Kueue {kind}")
                return
            skipped = _SKIPPED.get((group, kind))
            if skipped is not None:
                self.notes.append(f"{ctx}: skipped; {skipped}")
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
        seen = self.priority_classes.get(name)
        if seen is not None and seen[0] != value:
            raise ConfigError(
                f"{ctx}: priority class {name!r} is also defined with value {seen[0]} "
                f"({seen[1]}); give both the same value or rename one"
            )
        self.priority_classes[name] = (value, ctx)
        if doc.get("globalDefault") is True:
            self.notes.append(
                f"{ctx}: globalDefault is not applied; a job that names no priority class "
                "keeps its own priority (0 unless it sets one)"
            )

    def finish(self) -> None:
        """Turn the pending Volcano queues and ElasticQuotas into queues and cohorts."""
        self._finish_volcano()
        self._finish_koord()

    # Kueue -------------------------------------------------------------------------------

    def _resource_flavor(
        self, name: str, spec: Mapping[str, Any], meta: Mapping[str, Any], ctx: str, src: str
    ) -> None:
        self._unknown(
            spec, ("nodeLabels", "nodeTaints", "tolerations", "topologyName"), ctx, "spec"
        )
        labels = spec.get("nodeLabels") or {}
        if not isinstance(labels, Mapping):
            raise ConfigError(f"{ctx}: spec.nodeLabels: expected a mapping of node labels")
        flavor: dict[str, Any] = {"name": name}
        capacity = capacity_type_from_labels(labels) or _generic_capacity(labels)
        spot_taint = _spot_key(spec.get("nodeTaints"))
        tolerated = _spot_key(spec.get("tolerations"))
        if capacity == "on-demand" and spot_taint is not None:
            raise ConfigError(
                f"{ctx}: spec.nodeLabels select on-demand nodes but spec.nodeTaints carries "
                f"the spot taint {spot_taint!r}; fix one of them"
            )
        if capacity is None and spot_taint is not None:
            capacity = "spot"
            self.notes.append(f"{ctx}: spot flavor (spec.nodeTaints carries {spot_taint!r})")
        elif capacity is None and labels and tolerated is None:
            capacity = "on-demand"
            self.notes.append(
                f"{ctx}: no capacity-type node label and no spot taint; taken as on-demand "
                "(spot nodes carry a label and a taint this flavor does not tolerate). Set "
                "capacity_type under flavors: in the Muster config to change it"
            )
        elif capacity is None and tolerated is not None:
            self.notes.append(
                f"{ctx}: tolerates the spot taint {tolerated!r} but names no capacity type; "
                "it matches spot and on-demand flavors alike"
            )
        if capacity is not None:
            flavor["capacity_type"] = capacity
        gpu_type = gpu_type_from_labels(labels)
        if gpu_type is not None:
            flavor["gpu_type"] = gpu_type
        unmatched = sorted(str(k) for k in labels if str(k) not in _MATCHED_LABELS)
        if unmatched:
            self.notes.append(
                f"{ctx}: spec.nodeLabels {', '.join(unmatched)} not matched; Muster matches "
                "flavors by capacity type and GPU type only"
            )
        others = [
            str(t.get("key"))
            for t in spec.get("nodeTaints") or []
            if isinstance(t, Mapping) and str(t.get("key")) != spot_taint
        ]
        if others:
            self.notes.append(
                f"{ctx}: spec.nodeTaints {', '.join(others)} not matched; only a spot taint "
                "says something Muster uses (the capacity type)"
            )
        if spec.get("tolerations"):
            self.notes.append(
                f"{ctx}: spec.tolerations not added to pods; the agent's pod template decides"
            )
        self._put(self.flavors, name, flavor, ctx, "flavor")

    def _cluster_queue(
        self, name: str, spec: Mapping[str, Any], meta: Mapping[str, Any], ctx: str, src: str
    ) -> None:
        self._unknown(spec, _CLUSTER_QUEUE_FIELDS, ctx, "spec")
        # Kueue admits only the resources a ClusterQueue lists (its troubleshooting guide).
        queue: dict[str, Any] = {"name": name, "unlisted_resources": "zero"}
        cohort = spec.get("cohort", spec.get("cohortName"))
        if cohort:
            queue["cohort"] = self._label(cohort, f"{ctx}: spec.cohort")
        strategy = spec.get("queueingStrategy", "BestEffortFIFO")
        if strategy not in ("StrictFIFO", "BestEffortFIFO"):
            raise ConfigError(
                f"{ctx}: spec.queueingStrategy: {strategy!r}; use StrictFIFO or BestEffortFIFO"
            )
        queue["strategy"] = strategy
        weight = self._fair_weight(spec.get("fairSharing"), ctx)
        if weight is not None:
            queue["weight"] = weight
        # Kueue's defaults are Never/Never: keep them, do not take Muster's.
        pre = spec.get("preemption") or {}
        self._unknown(
            pre,
            ("withinClusterQueue", "reclaimWithinCohort", "borrowWithinCohort"),
            ctx,
            "spec.preemption",
        )
        within = pre.get("withinClusterQueue", "Never")
        if within == "LowerOrNewerEqualPriority":
            self.notes.append(
                f"{ctx}: preemption.withinClusterQueue LowerOrNewerEqualPriority imported as "
                "LowerPriority"
            )
            within = "LowerPriority"
        if within not in ("Never", "LowerPriority"):
            raise ConfigError(
                f"{ctx}: spec.preemption.withinClusterQueue: {within!r}; use Never or LowerPriority"
            )
        reclaim = pre.get("reclaimWithinCohort", "Never")
        if reclaim not in ("Never", "LowerPriority", "Any"):
            raise ConfigError(
                f"{ctx}: spec.preemption.reclaimWithinCohort: {reclaim!r}; use Never, "
                "LowerPriority or Any"
            )
        queue["preemption"] = {"within_queue": within, "reclaim_within_cohort": reclaim}
        if pre.get("borrowWithinCohort"):
            self.notes.append(
                f"{ctx}: spec.preemption.borrowWithinCohort ignored; Muster never preempts to "
                "borrow"
            )
        fungibility = spec.get("flavorFungibility")
        if isinstance(fungibility, Mapping):
            for key, default in (("whenCanBorrow", "Borrow"), ("whenCanPreempt", "TryNextFlavor")):
                value = fungibility.get(key)
                if value not in (None, default):
                    self.notes.append(
                        f"{ctx}: spec.flavorFungibility.{key}: {value} imported as {default}: "
                        "the next flavor in order is tried when one has no room"
                    )
        for key in ("admissionChecks", "admissionChecksStrategy", "admissionScope"):
            if spec.get(key):
                self.notes.append(f"{ctx}: spec.{key} ignored (no equivalent)")
        if spec.get("namespaceSelector"):
            self.notes.append(
                f"{ctx}: spec.namespaceSelector ignored; Muster has no namespaces, jobs pick "
                "their queue by name"
            )
        if spec.get("stopPolicy") not in (None, "None"):
            self.notes.append(f"{ctx}: spec.stopPolicy ignored; the queue is active in Muster")
        queue["quotas"] = self._resource_groups(spec, ctx)
        order = list(dict.fromkeys(q["flavor"] for q in queue["quotas"]))
        if len(order) > 1:  # Kueue tries a ClusterQueue's flavors in the order listed
            queue["flavor_order"] = order
        self._put(self.queues, name, queue, ctx, "queue")

    def _kueue_cohort(
        self, name: str, spec: Mapping[str, Any], meta: Mapping[str, Any], ctx: str, src: str
    ) -> None:
        self._unknown(spec, ("parent", "parentName", "resourceGroups", "fairSharing"), ctx, "spec")
        cohort: dict[str, Any] = {"name": name}
        parent = spec.get("parentName", spec.get("parent"))
        if parent:
            cohort["parent"] = self._label(parent, f"{ctx}: spec.parentName")
        if spec.get("fairSharing"):
            self.notes.append(
                f"{ctx}: spec.fairSharing ignored; Muster shares between queues by their own "
                "weights, not per cohort"
            )
        quotas = self._resource_groups(spec, ctx)
        if quotas:
            cohort["quotas"] = quotas
        self._put(self.cohorts, name, cohort, ctx, "cohort")

    def _resource_groups(self, spec: Mapping[str, Any], ctx: str) -> list[dict[str, Any]]:
        quotas: dict[str, dict[str, Any]] = {}
        for gi, group in enumerate(spec.get("resourceGroups") or []):
            gpath = f"spec.resourceGroups[{gi}]"
            if not isinstance(group, Mapping):
                raise ConfigError(f"{ctx}: {gpath}: expected a mapping")
            for fi, flavor in enumerate(group.get("flavors") or []):
                fpath = f"{gpath}.flavors[{fi}]"
                if not isinstance(flavor, Mapping):
                    raise ConfigError(f"{ctx}: {fpath}: expected a mapping")
                fname = self._label(flavor.get("name"), f"{ctx}: {fpath}.name")
                resources = quotas.setdefault(fname, {})
                for ri, res in enumerate(flavor.get("resources") or []):
                    rpath = f"{ctx}: {fpath}.resources[{ri}]"
                    if not isinstance(res, Mapping):
                        raise ConfigError(f"{rpath}: expected a mapping")
                    rname = str(res.get("name"))
                    ours = _kube_resource(rname)
                    if ours is None:
                        self.notes.append(
                            f"{rpath}: resource {rname!r} ignored (Muster "
                            "counts gpu, cpu and memory)"
                        )
                        continue
                    if ours in resources:
                        raise ConfigError(f"{rpath}: {rname!r} listed twice for {fname}")
                    quota: dict[str, Any] = {
                        "nominal": _resource_amount(
                            ours, res.get("nominalQuota"), f"{rpath}.nominalQuota"
                        )
                    }
                    for kube_key, our_key in (
                        ("borrowingLimit", "borrowing_limit"),
                        ("lendingLimit", "lending_limit"),
                    ):
                        if res.get(kube_key) is not None:
                            quota[our_key] = _resource_amount(
                                ours, res[kube_key], f"{rpath}.{kube_key}"
                            )
                    resources[ours] = quota
        return [{"flavor": f, "resources": r} for f, r in quotas.items()]

    def _local_queue(
        self, name: str, spec: Mapping[str, Any], meta: Mapping[str, Any], ctx: str, src: str
    ) -> None:
        self._unknown(spec, ("clusterQueue", "stopPolicy", "fairSharing"), ctx, "spec")
        target = self._label(spec.get("clusterQueue"), f"{ctx}: spec.clusterQueue")
        if spec.get("fairSharing"):
            self.notes.append(
                f"{ctx}: spec.fairSharing ignored; a LocalQueue is another name for its "
                "ClusterQueue in Muster, with no share of its own"
            )
        if spec.get("stopPolicy") not in (None, "None"):
            self.notes.append(f"{ctx}: spec.stopPolicy ignored; the alias stays open")
        if target == name:
            return  # submitting to the LocalQueue's name already reaches the queue
        seen = self.aliases.get(name)
        if seen is not None and seen[0] != target:
            raise ConfigError(
                f"{ctx}: LocalQueue {name!r} points at {target!r}, but another LocalQueue of "
                f"that name ({seen[1]}) points at {seen[0]!r}; Muster has no namespaces, so "
                "rename one of them"
            )
        self.aliases[name] = (target, ctx)

    def _fair_weight(self, fair: Any, ctx: str) -> float | None:
        if not isinstance(fair, Mapping) or fair.get("weight") is None:
            return None
        try:
            weight = float(parse_quantity(fair["weight"]))
        except QuantityError as exc:
            raise ConfigError(f"{ctx}: spec.fairSharing.weight: {exc}") from None
        if weight <= 0:
            raise ConfigError(
                f"{ctx}: spec.fairSharing.weight: Muster weights must be > 0 (a Kueue weight "
                "of 0 means 'borrow last'); give a small positive weight such as 0.01"
            )
        return weight

    # Volcano -----------------------------------------------------------------------------

    def _volcano_queue(
        self, name: str, spec: Mapping[str, Any], meta: Mapping[str, Any], ctx: str, src: str
    ) -> None:
        self._unknown(spec, _VOLCANO_FIELDS, ctx, "spec")
        weight = spec.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
            raise ConfigError(f"{ctx}: spec.weight: {weight!r}; use a positive number, e.g. 4")
        reclaimable = spec.get("reclaimable", True)
        if not isinstance(reclaimable, bool):
            raise ConfigError(f"{ctx}: spec.reclaimable: {reclaimable!r}; use true or false")
        guarantee = spec.get("guarantee") or {}
        if not isinstance(guarantee, Mapping):
            raise ConfigError(f"{ctx}: spec.guarantee: expected a mapping with resource:")
        parent = spec.get("parent")
        if parent in ("", "root"):
            parent = None
        if parent is not None:
            parent = self._label(parent, f"{ctx}: spec.parent")
        annotations = meta.get("annotations") or {}
        pending = _Pending(
            name=name,
            ctx=ctx,
            parent=parent,
            low=self._resources(spec.get("deserved"), f"{ctx}: spec.deserved"),
            high=self._resources(spec.get("capability"), f"{ctx}: spec.capability"),
            keep=self._resources(guarantee.get("resource"), f"{ctx}: spec.guarantee.resource"),
            weight=float(weight),
            reclaimable=reclaimable,
            hierarchy=self._hierarchy(annotations, parent, ctx),
        )
        if spec.get("state") == "Closed":
            self.notes.append(f"{ctx}: spec.state Closed ignored; the queue is open in Muster")
        for key in ("priority", "affinity", "extendClusters", "type", "dequeueStrategy"):
            if spec.get(key) is not None:
                self.notes.append(f"{ctx}: spec.{key} ignored (no equivalent)")
        if name in self._volcano:
            raise ConfigError(
                f"{ctx}: a queue named {name!r} is already defined by "
                f"{self._volcano[name].ctx}; names must be unique across imported files"
            )
        self._volcano[name] = pending

    def _hierarchy(
        self, annotations: Any, parent: str | None, ctx: str
    ) -> list[tuple[str, float]] | None:
        """The ancestors named by `volcano.sh/hierarchy` (the hdrf plugin's path), with the
        weights of `volcano.sh/hierarchy-weights`; None without the annotation."""
        if not isinstance(annotations, Mapping):
            return None
        path = annotations.get("volcano.sh/hierarchy")
        weights = annotations.get("volcano.sh/hierarchy-weights")
        if path is None:
            if weights is not None:
                self.notes.append(
                    f"{ctx}: annotation volcano.sh/hierarchy-weights ignored without "
                    "volcano.sh/hierarchy"
                )
            return None
        if parent is not None:
            self.notes.append(
                f"{ctx}: annotations volcano.sh/hierarchy and hierarchy-weights ignored; "
                "spec.parent (the newer form) places the queue"
            )
            return None
        parts = str(path).strip("/").split("/")
        raw_weights = str(weights).strip("/").split("/") if weights is not None else []
        if weights is not None and len(raw_weights) != len(parts):
            raise ConfigError(
                f"{ctx}: annotation volcano.sh/hierarchy-weights {weights!r} has "
                f"{len(raw_weights)} levels but volcano.sh/hierarchy {path!r} has {len(parts)}; "
                "give one weight per level"
            )
        out: list[tuple[str, float]] = []
        for i in range(len(parts)):
            try:
                w = float(raw_weights[i]) if raw_weights else 1.0
            except ValueError:
                w = -1.0
            if w <= 0:
                raise ConfigError(
                    f"{ctx}: annotation volcano.sh/hierarchy-weights: level {i + 1} is "
                    f"{raw_weights[i]!r}; use positive numbers such as 1/2/8"
                )
            name = "-".join(parts[: i + 1])
            out.append((self._label(name, f"{ctx}: annotation volcano.sh/hierarchy"), w))
        return out

    def _finish_volcano(self) -> None:
        pending = self._volcano
        children: dict[str, list[_Pending]] = {}
        for p in pending.values():
            if p.parent is not None:
                if p.parent not in pending:
                    raise ConfigError(
                        f"{p.ctx}: spec.parent: {p.parent!r} is not among the imported "
                        "queues; import the parent queue too"
                    )
                children.setdefault(p.parent, []).append(p)
        flat_weights = _flat_weights([p.hierarchy for p in pending.values() if p.hierarchy])
        for p in pending.values():
            kids = children.get(p.name)
            if kids:
                self._volcano_parent(p, kids)
            else:
                self._volcano_leaf(p, flat_weights)

    def _volcano_leaf(self, p: _Pending, flat_weights: dict[str, float]) -> None:
        queue: dict[str, Any] = {"name": p.name, "weight": p.weight, "reclaimable": p.reclaimable}
        res: dict[str, dict[str, Any]] = {}
        if p.low:
            # Volcano >= 1.9 (capacity plugin): deserved is the share, capability the ceiling.
            queue["cohort"] = p.parent or "volcano"
            for r, amount in p.low.items():
                q: dict[str, Any] = {"nominal": amount}
                if r in p.high:
                    q["borrowing_limit"] = max(0, p.high[r] - amount)
                res[r] = q
        elif p.high:
            res = {r: {"nominal": a, "borrowing_limit": 0} for r, a in p.high.items()}
            if p.parent is not None:
                queue["cohort"] = p.parent
        elif p.parent is not None:
            queue["cohort"] = p.parent
        self._guarantee(p, res)
        if p.hierarchy:
            queue["cohort"] = p.hierarchy[-2][0] if len(p.hierarchy) > 1 else p.hierarchy[0][0]
            for i, (node, _) in enumerate(p.hierarchy[:-1]):
                if node not in self.cohorts:
                    cohort = {"name": node}
                    if i > 0:
                        cohort["parent"] = p.hierarchy[i - 1][0]
                    self.cohorts[node] = (cohort, p.ctx)
            queue["weight"] = flat_weights[p.hierarchy[-1][0]]
            self.notes.append(
                f"{p.ctx}: volcano.sh/hierarchy-weights flattened into the queue weight "
                f"{queue['weight']:g} (the product of its share at each level); cohorts carry "
                "no weight in Muster, and spec.weight is superseded"
            )
        if res:
            missing = sorted({"gpu", "cpu", "memory"} - set(res))
            if missing:
                self.notes.append(
                    f"{p.ctx}: {', '.join(missing)} not in spec.deserved/capability, so not "
                    "limited (as Volcano, whose root capability is the whole cluster)"
                )
            queue["quotas"] = [{"flavor": ANY_FLAVOR, "resources": res}]
            self.needs_any_flavor = True
        self._put(self.queues, p.name, queue, p.ctx, "queue")

    def _volcano_parent(self, p: _Pending, kids: list[_Pending]) -> None:
        """A queue other queues name as parent: a cohort, never a queue that runs jobs
        (Volcano accepts jobs in leaf queues only)."""
        cohort: dict[str, Any] = {"name": p.name, "parent": p.parent or "volcano"}
        res: dict[str, dict[str, Any]] = {}
        for r in sorted(set(p.low) | set(p.high)):
            inner = sum(k.low.get(r, 0) for k in kids)
            share = p.low.get(r)
            if share is not None and inner > share:
                raise ConfigError(
                    f"{p.ctx}: the child queues' spec.deserved.{r} add up to more than this "
                    f"parent's ({_text(r, inner)} > {_text(r, share)}); Volcano refuses that, "
                    "so lower a child's deserved or raise the parent's"
                )
            q: dict[str, Any] = {"nominal": (share - inner) if share is not None else 0}
            if r in p.high:
                top = share if share is not None else inner
                if p.high[r] < top:
                    raise ConfigError(
                        f"{p.ctx}: spec.capability.{r} is below what its children deserve; "
                        "raise the capability"
                    )
                q["borrowing_limit"] = p.high[r] - top
            res[r] = q
        for r, keep in p.keep.items():
            # the subtree keeps `keep` of the parent's deserved: lending limit deserved - keep
            share = p.low.get(r)
            if share is None or keep > share:
                raise ConfigError(
                    f"{p.ctx}: spec.guarantee.resource.{r} exceeds spec.deserved.{r}; Volcano "
                    "requires guarantee <= deserved"
                )
            res[r]["lending_limit"] = share - keep
        if res:
            cohort["quotas"] = [{"flavor": ANY_FLAVOR, "resources": res}]
            self.needs_any_flavor = True
        self.notes.append(
            f"{p.ctx}: parent queue imported as a cohort of {', '.join(k.name for k in kids)} "
            "(jobs go to leaf queues)"
        )
        if p.weight != 1.0:
            self.notes.append(
                f"{p.ctx}: spec.weight of a parent queue ignored (cohorts carry no weight)"
            )
        self._put(self.cohorts, p.name, cohort, p.ctx, "cohort")

    def _guarantee(self, p: _Pending, res: dict[str, dict[str, Any]]) -> None:
        """Volcano's guarantee is reserved for the queue: Kueue's lending limit N - guarantee."""
        for r, keep in p.keep.items():
            q = res.get(r)
            if q is None or keep > q["nominal"]:
                raise ConfigError(
                    f"{p.ctx}: spec.guarantee.resource.{r} exceeds spec.deserved.{r}; Volcano "
                    "requires guarantee <= deserved"
                )
            q["lending_limit"] = q["nominal"] - keep

    # ElasticQuota (Koordinator and scheduler-plugins) -----------------------------------

    def _plugins_quota(
        self, name: str, spec: Mapping[str, Any], meta: Mapping[str, Any], ctx: str, src: str
    ) -> None:
        """scheduler-plugins' capacity scheduling: min is guaranteed, max caps; a quota
        borrows while the sum of all usage stays within the sum of all mins, which is a flat
        Kueue cohort with min -> nominal and max - min -> borrowing limit."""
        self._unknown(spec, ("min", "max"), ctx, "spec")
        queue: dict[str, Any] = {"name": name, "cohort": "elastic-quota"}
        res = self._min_max(spec, ctx)
        if res:
            queue["quotas"] = [{"flavor": ANY_FLAVOR, "resources": res}]
            self.needs_any_flavor = True
        self._put(self.queues, name, queue, ctx, "queue")

    def _koord_quota(
        self, name: str, spec: Mapping[str, Any], meta: Mapping[str, Any], ctx: str, src: str
    ) -> None:
        self._unknown(spec, ("min", "max"), ctx, "spec")
        labels = meta.get("labels") or {}
        if not isinstance(labels, Mapping):
            raise ConfigError(f"{ctx}: metadata.labels: expected a mapping")
        for key in labels:
            if str(key).startswith(_KOORD) and str(key) not in _KOORD_LABELS:
                self.notes.append(f"{ctx}: label {key} ignored (no equivalent)")
        if labels.get(f"{_KOORD}shared-weight") is not None:
            self.notes.append(
                f"{ctx}: label {_KOORD}shared-weight ignored; Muster lends unused quota to "
                "borrowers first come, bounded by their borrowing limits"
            )
        parent = labels.get(f"{_KOORD}parent")
        if parent in (None, "", "root", "koordinator-root-quota"):
            parent = None
        else:
            parent = self._label(parent, f"{ctx}: metadata.labels[{_KOORD}parent]")
        policy = labels.get("koord-queue/queue-policy", "Priority")
        if policy not in ("Priority", "Block", "Intelligent"):
            raise ConfigError(
                f"{ctx}: metadata.labels[koord-queue/queue-policy]: {policy!r}; use Priority, "
                "Block or Intelligent"
            )
        if name in self._koord:
            raise ConfigError(
                f"{ctx}: a quota named {name!r} is already defined by {self._koord[name].ctx}; "
                "names must be unique across imported files"
            )
        res = self._min_max(spec, ctx)
        self._koord[name] = _Pending(
            name=name,
            ctx=ctx,
            parent=parent,
            low={r: q["nominal"] for r, q in res.items()},
            high={
                r: q["nominal"] + q["borrowing_limit"]
                for r, q in res.items()
                if "borrowing_limit" in q
            },
            keep={},
            weight=1.0,
            reclaimable=True,
            hierarchy=None,
            is_parent=_truthy(labels.get(f"{_KOORD}is-parent")),
            lends=not _falsy(labels.get(f"{_KOORD}allow-lent-resource")),
            policy=str(policy),
        )

    def _finish_koord(self) -> None:
        pending = self._koord
        children: dict[str, list[_Pending]] = {}
        for p in pending.values():
            if p.parent is None:
                continue
            up = pending.get(p.parent)
            if up is None:
                self.notes.append(
                    f"{p.ctx}: parent quota {p.parent!r} is not among the imported objects; "
                    "it becomes a cohort without limits of its own"
                )
            elif not up.is_parent:
                raise ConfigError(
                    f"{p.ctx}: parent quota {p.parent!r} is not a parent (label "
                    f'{_KOORD}is-parent: "true"); Koordinator\'s webhook refuses this, so mark '
                    "the parent or pick another"
                )
            children.setdefault(p.parent, []).append(p)
        for p in pending.values():
            if p.is_parent:
                self._koord_parent(p, children.get(p.name, []))
            else:
                self._koord_leaf(p)
        self._koord_root([p for p in pending.values() if p.parent is None])

    def _koord_root(self, top: list[_Pending]) -> None:
        """Koordinator's root quota is the cluster: a quota may use idle capacity beyond its
        min up to its max. The root cohort gets the top-level quotas' max - min as its own
        quota, so each may reach its max; the fleet's free capacity bounds the rest."""
        extra: dict[str, int] = {}
        for p in top:
            for r, high in p.high.items():
                extra[r] = extra.get(r, 0) + max(0, high - p.low.get(r, 0))
        res: dict[str, Any] = {r: {"nominal": v} for r, v in extra.items() if v}
        if not res:
            return
        cohort: dict[str, Any] = {
            "name": "elastic-quota",
            "quotas": [{"flavor": ANY_FLAVOR, "resources": res}],
        }
        self._put(self.cohorts, "elastic-quota", cohort, top[0].ctx, "cohort")
        self.needs_any_flavor = True
        self.notes.append(
            "cohort elastic-quota (Koordinator's root quota) lends "
            + ", ".join(f"{r} {_text(r, extra[r])}" for r in sorted(res))
            + " beyond the top-level mins: each quota may reach its max while the fleet has room"
        )

    def _koord_leaf(self, p: _Pending) -> None:
        queue: dict[str, Any] = {"name": p.name, "cohort": p.parent or "elastic-quota"}
        queue["strategy"] = "StrictFIFO" if p.policy == "Block" else "BestEffortFIFO"
        if p.policy == "Intelligent":
            self.notes.append(f"{p.ctx}: queue policy Intelligent imported as BestEffortFIFO")
        res = self._quota_of(p)
        if not p.lends:
            for q in res.values():
                q["lending_limit"] = 0
        if res:
            queue["quotas"] = [{"flavor": ANY_FLAVOR, "resources": res}]
            self.needs_any_flavor = True
        self._put(self.queues, p.name, queue, p.ctx, "queue")

    def _koord_parent(self, p: _Pending, kids: list[_Pending]) -> None:
        """A parent quota: a cohort whose subtree quota is its min and whose borrowing limit
        (max - min) keeps the whole subtree within its max. It runs no jobs."""
        cohort: dict[str, Any] = {"name": p.name, "parent": p.parent or "elastic-quota"}
        res = self._quota_of(p)
        for r, q in res.items():
            inner = sum(k.low.get(r, 0) for k in kids)
            if inner > q["nominal"]:
                raise ConfigError(
                    f"{p.ctx}: the children's spec.min.{r} add up to more than this parent's "
                    f"({_text(r, inner)} > {_text(r, q['nominal'])}); Koordinator's webhook "
                    "refuses this (checkMinQuotaSum), so lower a child's min or raise the "
                    "parent's"
                )
            q["nominal"] -= inner
        if not p.lends:
            for q in res.values():
                q["lending_limit"] = 0
        if res:
            cohort["quotas"] = [{"flavor": ANY_FLAVOR, "resources": res}]
            self.needs_any_flavor = True
        who = ", ".join(k.name for k in kids) or "no child quotas"
        self.notes.append(f"{p.ctx}: parent quota imported as a cohort of {who}; it runs no jobs")
        if p.policy != "Priority":
            self.notes.append(f"{p.ctx}: koord-queue/queue-policy of a parent quota ignored")
        self._put(self.cohorts, p.name, cohort, p.ctx, "cohort")

    @staticmethod
    def _quota_of(p: _Pending) -> dict[str, dict[str, Any]]:
        res: dict[str, dict[str, Any]] = {}
        for r in sorted(set(p.low) | set(p.high)):
            q: dict[str, Any] = {"nominal": p.low.get(r, 0)}
            if r in p.high:
                q["borrowing_limit"] = p.high[r] - q["nominal"]
            res[r] = q
        return res

    def _min_max(self, spec: Mapping[str, Any], ctx: str) -> dict[str, dict[str, Any]]:
        low = self._resources(spec.get("min"), f"{ctx}: spec.min")
        high = self._resources(spec.get("max"), f"{ctx}: spec.max")
        res: dict[str, dict[str, Any]] = {}
        for r in sorted(set(low) | set(high)):
            nominal = low.get(r, 0)
            q: dict[str, Any] = {"nominal": nominal}
            if r in high:
                if high[r] < nominal:
                    raise ConfigError(f"{ctx}: spec.max.{r} is below spec.min.{r}; raise max")
                q["borrowing_limit"] = high[r] - nominal
            res[r] = q
        return res

    # helpers -----------------------------------------------------------------------------

    def _unknown(self, spec: Any, known: Iterable[str], ctx: str, where: str) -> None:
        """A note for every field Muster does not read, so none is dropped silently."""
        if not isinstance(spec, Mapping):
            return
        known = set(known)
        for key in spec:
            if str(key) not in known:
                self.notes.append(f"{ctx}: {where}.{key} ignored (Muster does not read it)")

    def _resources(self, value: Any, where: str) -> dict[str, int]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping like {{cpu: '64', memory: '256Gi'}}")
        out: dict[str, int] = {}
        for key, amount in value.items():
            ours = _kube_resource(str(key))
            if ours is None:
                self.notes.append(
                    f"{where}: resource {key!r} ignored (Muster counts gpu, cpu and memory)"
                )
                continue
            out[ours] = out.get(ours, 0) + _resource_amount(ours, amount, f"{where}[{key}]")
        return out

    @staticmethod
    def _label(value: Any, where: str) -> str:
        if not isinstance(value, str) or not _DNS_LABEL.match(value) or len(value) > 63:
            raise ConfigError(
                f"{where}: {value!r} is not a valid name; use a DNS label (lower-case letters, "
                "digits and '-')"
            )
        return value

    @staticmethod
    def _put(
        table: dict[str, tuple[dict[str, Any], str]],
        name: str,
        value: dict[str, Any],
        ctx: str,
        what: str,
    ) -> None:
        if name in table:
            raise ConfigError(
                f"{ctx}: a {what} named {name!r} is already defined by {table[name][1]}; "
                "names must be unique across imported files"
            )
        table[name] = (value, ctx)


@dataclass
class _Pending:
    """A Volcano queue or an ElasticQuota until the import knows whether it is a parent."""

    name: str
    ctx: str
    parent: str | None
    low: dict[str, int]  # deserved / min
    high: dict[str, int]  # capability / max
    keep: dict[str, int]  # guarantee
    weight: float
    reclaimable: bool
    hierarchy: list[tuple[str, float]] | None
    is_parent: bool = False
    lends: bool = True
    policy: str = "Priority"


def _flat_weights(paths: list[list[tuple[str, float]]]) -> dict[str, float]:
    """hdrf's per-level weights as one weight per leaf: the product, over the levels below the
    root, of the node's weight over the sum of its siblings' weights."""
    siblings: dict[str, dict[str, float]] = {}
    for path in paths:
        for i in range(1, len(path)):
            siblings.setdefault(path[i - 1][0], {})[path[i][0]] = path[i][1]
    out: dict[str, float] = {}
    for path in paths:
        share = 1.0
        for i in range(1, len(path)):
            level = siblings[path[i - 1][0]]
            share *= path[i][1] / sum(level.values())
        out[path[-1][0]] = float(f"{share:.6g}")
    return out


def _truthy(value: Any) -> bool:
    return value is True or str(value).strip().lower() == "true"


def _falsy(value: Any) -> bool:
    return value is False or str(value).strip().lower() == "false"


def _text(resource: str, amount: int) -> str:
    if resource == "cpu":
        return f"{amount / 1000:g} cores"
    if resource == "memory":
        return str(_memory_text(amount))
    return str(amount)


def _spot_key(items: Any) -> str | None:
    """The key of the first spot taint (or toleration of one) in `items`, else None."""
    if not isinstance(items, list):
        return None
    for t in items:
        if not isinstance(t, Mapping):
            continue
        key = str(t.get("key"))
        value = t.get("value")
        if key in _SPOT_TAINTS and (value is None or str(value).lower() in _SPOT_TAINTS[key]):
            return key
    return None


def _generic_capacity(labels: Mapping[str, Any]) -> str | None:
    """`node-type: spot` and its kin, which clusters set by hand and Kueue's examples use."""
    for key in _GENERIC_CAPACITY_KEYS:
        value = labels.get(key)
        if value is not None:
            found = _GENERIC_CAPACITY_VALUES.get(str(value).strip().lower())
            if found is not None:
                return found
    return None


def _kube_resource(name: str) -> str | None:
    if name in ("cpu", "memory"):
        return name
    if name.endswith("/gpu"):
        return "gpu"
    return None


# -- assembling --------------------------------------------------------------------------


def _assemble(raw: dict[str, Any], importer: _Importer, source: str) -> LoadedConfig:
    importer.finish()
    raw = dict(raw)
    aliases_raw = raw.pop("queue_aliases", None) or {}
    raw.pop("import", None)
    if not isinstance(aliases_raw, Mapping):
        raise ConfigError(f"{source}: queue_aliases: expected a mapping of alias: queue")
    _normalise_quotas(raw, source)

    def merged(key: str, imported: dict[str, tuple[dict[str, Any], str]]) -> None:
        own = raw.get(key)
        if own is not None and not isinstance(own, list):
            raise ConfigError(f"{source}: {key}: expected a list, got {type(own).__name__}")
        if not imported:
            return
        own_names = {e.get("name") for e in own or [] if isinstance(e, Mapping)}
        raw[key] = [v for n, (v, _) in imported.items() if n not in own_names] + list(own or [])

    flavors = dict(importer.flavors)
    if importer.needs_any_flavor and ANY_FLAVOR not in flavors:
        own = raw.get("flavors")
        if not (
            isinstance(own, list)
            and any(isinstance(f, Mapping) and f.get("name") == ANY_FLAVOR for f in own)
        ):
            flavors[ANY_FLAVOR] = ({"name": ANY_FLAVOR}, "imports")
    merged("flavors", flavors)
    merged("queues", importer.queues)
    merged("cohorts", importer.cohorts)
    _merge_priority_classes(raw, importer.priority_classes, source)

    try:
        config = convert_config(raw)
    except DecodeError as exc:
        raise ConfigError(f"{source}: {_explain(str(exc))}") from None

    aliases = {name: target for name, (target, _) in importer.aliases.items()}
    queue_names = {q.name for q in config.queues}
    for name, (target, ctx) in importer.aliases.items():
        if name in queue_names and name != target:
            # A Volcano queue and a Kueue LocalQueue of one name (two systems describing the
            # same team): the queue keeps the name, as a job naming it reaches a queue either
            # way; the ClusterQueue stays reachable by its own name.
            del aliases[name]
            importer.notes.append(
                f"{ctx}: LocalQueue {name!r} has the name of the queue imported from another "
                f"object; jobs naming {name!r} go to that queue, and ClusterQueue {target!r} is "
                f"reached by its own name (or give it another alias under queue_aliases)"
            )
    for alias, target in aliases_raw.items():
        aliases[str(alias)] = str(target)
    _check_references(config, aliases, source)
    config = msgspec.structs.replace(config, queue_aliases=aliases)
    return LoadedConfig(config=config, aliases=aliases, notes=list(importer.notes))


def _merge_priority_classes(
    raw: dict[str, Any], imported: Mapping[str, tuple[int, str]], source: str
) -> None:
    """Imported classes under the Muster document's own `priority_classes` (which win)."""
    own = raw.get("priority_classes")
    if own is not None and not isinstance(own, Mapping):
        raise ConfigError(f"{source}: priority_classes: expected a mapping of class name: priority")
    if not imported:
        return
    merged: dict[str, Any] = {}
    for name, (value, ctx) in imported.items():
        if own is not None and name in own:
            continue
        if abs(value) > _PRIORITY_RANGE:
            raise ConfigError(
                f"{ctx}: value {value} is outside Muster's job priorities "
                f"(-{_PRIORITY_RANGE:,} to {_PRIORITY_RANGE:,}); map the class in the Muster "
                f"document, e.g. `priority_classes: {{{name}: 1000}}`"
            )
        merged[name] = value
    raw["priority_classes"] = {**merged, **(own or {})}


def _check_references(config: BrokerConfig, aliases: Mapping[str, str], source: str) -> None:
    queue_names = {q.name for q in config.queues}
    flavor_names = {f.name for f in config.flavors}
    if config.flavors:
        owners = [("queues", q.quotas or []) for q in config.queues]
        owners += [("cohorts", c.quotas) for c in config.cohorts]
        seen: dict[str, int] = {}
        for key, quotas in owners:
            qi = seen[key] = seen.get(key, -1) + 1
            for fi, fq in enumerate(quotas):
                if fq.flavor not in flavor_names:
                    close = difflib.get_close_matches(fq.flavor, sorted(flavor_names), n=1)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    raise ConfigError(
                        f"{source}: {key}[{qi}].quotas[{fi}].flavor: {fq.flavor!r} is not a "
                        f"declared flavor class{hint}; add it under flavors: or fix the name"
                    )
    names = [f.name for f in config.flavors]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"{source}: flavors: {name!r} is declared twice; keep one")
    for alias, target in aliases.items():
        if not _DNS_LABEL.match(alias) or len(alias) > 63:
            raise ConfigError(f"{source}: queue_aliases: {alias!r} is not a valid queue name")
        if target not in queue_names:
            raise ConfigError(
                f"{source}: queue alias {alias!r} points at {target!r}, which is not a queue; "
                f"known queues: {sorted(queue_names)}"
            )
        if alias in queue_names:
            raise ConfigError(
                f"{source}: queue alias {alias!r} has the name of a queue; rename the alias"
            )


def _explain(message: str) -> str:
    """Turn msgspec's "... - at `$.queues[0].quota`" into "queues[0].quota: ...", with a
    spelling hint for unknown fields."""
    return explain(message.removeprefix("invalid broker config: "), BrokerConfig)


def config_to_yaml(config: BrokerConfig, aliases: Mapping[str, str] | None = None) -> str:
    """The config as Muster YAML (cpu in millicores written as quantities), for `muster
    config`."""
    # Every setting, defaults included: what the broker will do is what it prints (a queue's
    # preemption policies, say, whose defaults differ from Kueue's).
    data = every_field(config, drop_none=True)
    for queue in [*data.get("queues", []), *data.get("cohorts", [])]:
        for fq in queue.get("quotas") or []:
            for res, rq in fq.get("resources", {}).items():
                for key in _QUOTA_FIELDS:
                    if key in rq and res == "cpu":
                        milli = rq[key]
                        rq[key] = str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"
                    elif key in rq and res == "memory":
                        rq[key] = _memory_text(rq[key])
    data = {k: v for k, v in data.items() if v != {}}
    if aliases:
        data["queue_aliases"] = dict(aliases)
    return yaml.safe_dump(data, sort_keys=False)


def _memory_text(n: int) -> str | int:
    for suffix, size in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{suffix}"
    return n
