"""The broker's YAML config, and importers for the Kueue / Volcano / Koordinator objects users
already write.

A config file is YAML with one or more documents:

- at most one Muster document (a mapping without `apiVersion`/`kind`) holding the fields of
  `schemas.config.BrokerConfig`, plus two loader-only keys:
  `import: [kueue.yaml, volcano-queues.yaml]` (paths relative to the config file; those files
  hold Kubernetes objects only) and `queue_aliases: {local-name: queue}`;
- any number of Kubernetes documents (they have `apiVersion` and `kind`), imported as if they
  had been listed under `import`: Kueue ResourceFlavor / ClusterQueue / LocalQueue, Volcano
  Queue, Koordinator ElasticQuota. A `kind: List` is unpacked.

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

from broker.manifests import capacity_type_from_labels, gpu_type_from_labels, is_manifest
from schemas.codec import DecodeError, convert_config
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
# Taints that mark spot nodes; a flavor tolerating one may land on spot capacity.
_SPOT_TAINTS = (
    "cloud.google.com/gke-spot",
    "cloud.google.com/gke-preemptible",
    "kubernetes.azure.com/scalesetpriority",
    "karpenter.sh/capacity-type",
    "spot",
)
_KUEUE_IGNORED = {
    "WorkloadPriorityClass",
    "AdmissionCheck",
    "MultiKueueConfig",
    "MultiKueueCluster",
    "ProvisioningRequestConfig",
    "Topology",
    "Cohort",
    "Workload",
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
    """Koordinator ElasticQuota: min -> nominal, max - min -> borrowing limit, in one cohort
    (the parent quota's name, or `elastic-quota`); queue policy Block -> StrictFIFO."""
    return import_documents(
        _only(docs, "scheduling.sigs.k8s.io", "Koordinator"), source="ElasticQuota objects"
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


def _only(docs: Iterable[Mapping[str, Any]], group: str, what: str) -> list[Mapping[str, Any]]:
    out = []
    for i, doc in enumerate(docs, start=1):
        if not is_manifest(doc) or str(doc["apiVersion"]).rpartition("/")[0] != group:
            kind = doc.get("kind") if isinstance(doc, Mapping) else type(doc).__name__
            raise ConfigError(
                f"document {i} ({kind}): not a {what} object (apiVersion {group}/...); "
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
    queues = raw.get("queues")
    if not isinstance(queues, list):
        return
    for qi, queue in enumerate(queues):
        if not isinstance(queue, Mapping) or not isinstance(queue.get("quotas"), list):
            continue
        for fi, fq in enumerate(queue["quotas"]):
            if not isinstance(fq, Mapping) or not isinstance(fq.get("resources"), Mapping):
                continue
            base = f"{source}: queues[{qi}].quotas[{fi}].resources"
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
    """Collects flavor classes, queues, aliases and notes from Kubernetes objects."""

    def __init__(self) -> None:
        self.flavors: dict[str, tuple[dict[str, Any], str]] = {}
        self.queues: dict[str, tuple[dict[str, Any], str]] = {}
        self.aliases: dict[str, tuple[str, str]] = {}
        self.notes: list[str] = []
        self.needs_any_flavor = False

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
        handler = {
            ("kueue.x-k8s.io", "ResourceFlavor"): self._resource_flavor,
            ("kueue.x-k8s.io", "ClusterQueue"): self._cluster_queue,
            ("kueue.x-k8s.io", "LocalQueue"): self._local_queue,
            ("scheduling.volcano.sh", "Queue"): self._volcano_queue,
            ("scheduling.sigs.k8s.io", "ElasticQuota"): self._elastic_quota,
        }.get((group, kind))
        if handler is None:
            if group == "kueue.x-k8s.io" and kind in _KUEUE_IGNORED:
                self.notes.append(f"{ctx}: ignored; Muster has no equivalent of a Kueue {kind}")
                return
            raise ConfigError(
                f"{ctx}: {api_version} {kind} is not a config object Muster imports; supported: "
                "Kueue ResourceFlavor/ClusterQueue/LocalQueue, Volcano Queue, Koordinator "
                "ElasticQuota (job manifests go to `muster submit`)"
            )
        handler(raw_name, spec, metadata, ctx, source)

    # Kueue -------------------------------------------------------------------------------

    def _resource_flavor(
        self, name: str, spec: Mapping[str, Any], meta: Mapping[str, Any], ctx: str, src: str
    ) -> None:
        labels = spec.get("nodeLabels") or {}
        if not isinstance(labels, Mapping):
            raise ConfigError(f"{ctx}: spec.nodeLabels: expected a mapping of node labels")
        flavor: dict[str, Any] = {"name": name}
        capacity = capacity_type_from_labels(labels)
        tolerates_spot = any(
            isinstance(t, Mapping) and t.get("key") in _SPOT_TAINTS
            for t in spec.get("tolerations") or []
        )
        if capacity is None and labels and not tolerates_spot:
            capacity = "on-demand"
            self.notes.append(
                f"{ctx}: no capacity-type node label; taken as on-demand (spot nodes carry a "
                "label and a taint this flavor does not tolerate). Set capacity_type under "
                "flavors: in the Muster config to change it"
            )
        elif capacity is None and tolerates_spot:
            self.notes.append(
                f"{ctx}: tolerates spot nodes but names no capacity type; it matches both"
            )
        if capacity is not None:
            flavor["capacity_type"] = capacity
        gpu_type = gpu_type_from_labels(labels)
        if gpu_type is not None:
            flavor["gpu_type"] = gpu_type
        self._put(self.flavors, name, flavor, ctx, "flavor")

    def _cluster_queue(
        self, name: str, spec: Mapping[str, Any], meta: Mapping[str, Any], ctx: str, src: str
    ) -> None:
        queue: dict[str, Any] = {"name": name}
        cohort = spec.get("cohort", spec.get("cohortName"))
        if cohort:
            queue["cohort"] = self._label(cohort, f"{ctx}: spec.cohort")
        strategy = spec.get("queueingStrategy", "BestEffortFIFO")
        if strategy not in ("StrictFIFO", "BestEffortFIFO"):
            raise ConfigError(
                f"{ctx}: spec.queueingStrategy: {strategy!r}; use StrictFIFO or BestEffortFIFO"
            )
        queue["strategy"] = strategy
        fair = spec.get("fairSharing")
        if isinstance(fair, Mapping) and fair.get("weight") is not None:
            try:
                weight = float(parse_quantity(fair["weight"]))
            except QuantityError as exc:
                raise ConfigError(f"{ctx}: spec.fairSharing.weight: {exc}") from None
            if weight <= 0:
                raise ConfigError(
                    f"{ctx}: spec.fairSharing.weight: Muster weights must be > 0 (a Kueue weight "
                    "of 0 means 'borrow last'); give a small positive weight such as 0.01"
                )
            queue["weight"] = weight
        # Kueue's defaults are Never/Never: keep them, do not take Muster's.
        pre = spec.get("preemption") or {}
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
            self.notes.append(f"{ctx}: preemption.borrowWithinCohort ignored (no equivalent)")
        for key in ("admissionChecks", "admissionChecksStrategy", "flavorFungibility"):
            if spec.get(key):
                self.notes.append(f"{ctx}: spec.{key} ignored (no equivalent)")
        if spec.get("stopPolicy") not in (None, "None"):
            self.notes.append(f"{ctx}: spec.stopPolicy ignored; the queue is active in Muster")

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
        queue["quotas"] = [{"flavor": f, "resources": r} for f, r in quotas.items()]
        self._put(self.queues, name, queue, ctx, "queue")

    def _local_queue(
        self, name: str, spec: Mapping[str, Any], meta: Mapping[str, Any], ctx: str, src: str
    ) -> None:
        target = self._label(spec.get("clusterQueue"), f"{ctx}: spec.clusterQueue")
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

    # Volcano / Koordinator --------------------------------------------------------------

    def _volcano_queue(
        self, name: str, spec: Mapping[str, Any], meta: Mapping[str, Any], ctx: str, src: str
    ) -> None:
        queue: dict[str, Any] = {"name": name}
        weight = spec.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
            raise ConfigError(f"{ctx}: spec.weight: {weight!r}; use a positive number, e.g. 4")
        queue["weight"] = float(weight)
        reclaimable = spec.get("reclaimable", True)
        if not isinstance(reclaimable, bool):
            raise ConfigError(f"{ctx}: spec.reclaimable: {reclaimable!r}; use true or false")
        queue["reclaimable"] = reclaimable
        capability = self._resources(spec.get("capability"), f"{ctx}: spec.capability")
        deserved = self._resources(spec.get("deserved"), f"{ctx}: spec.deserved")
        if deserved:
            # Volcano >= 1.9: deserved is the share, capability the ceiling -> borrowing.
            queue["cohort"] = "volcano"
            res = {}
            for r, amount in deserved.items():
                q: dict[str, Any] = {"nominal": amount}
                if r in capability:
                    q["borrowing_limit"] = max(0, capability[r] - amount)
                res[r] = q
        elif capability:
            res = {r: {"nominal": a, "borrowing_limit": 0} for r, a in capability.items()}
        else:
            res = {}
        if res:
            missing = sorted({"gpu", "cpu", "memory"} - set(res))
            if missing:
                self.notes.append(
                    f"{ctx}: no {', '.join(missing)} in capability; the queue has no quota of "
                    "it on flavor 'any'"
                )
            queue["quotas"] = [{"flavor": ANY_FLAVOR, "resources": res}]
            self.needs_any_flavor = True
        if spec.get("state") == "Closed":
            self.notes.append(f"{ctx}: state Closed ignored; the queue is open in Muster")
        self._put(self.queues, name, queue, ctx, "queue")

    def _elastic_quota(
        self, name: str, spec: Mapping[str, Any], meta: Mapping[str, Any], ctx: str, src: str
    ) -> None:
        labels = meta.get("labels") or {}
        queue: dict[str, Any] = {"name": name}
        parent = labels.get("quota.scheduling.koordinator.sh/parent")
        queue["cohort"] = self._label(parent, f"{ctx}: parent label") if parent else "elastic-quota"
        policy = labels.get("koord-queue/queue-policy", "Priority")
        if policy not in ("Priority", "Block", "Intelligent"):
            raise ConfigError(
                f"{ctx}: metadata.labels[koord-queue/queue-policy]: {policy!r}; use Priority, "
                "Block or Intelligent"
            )
        queue["strategy"] = "StrictFIFO" if policy == "Block" else "BestEffortFIFO"
        if policy == "Intelligent":
            self.notes.append(f"{ctx}: queue policy Intelligent imported as BestEffortFIFO")
        low = self._resources(spec.get("min"), f"{ctx}: spec.min")
        high = self._resources(spec.get("max"), f"{ctx}: spec.max")
        res: dict[str, Any] = {}
        for r in sorted(set(low) | set(high)):
            nominal = low.get(r, 0)
            q: dict[str, Any] = {"nominal": nominal}
            if r in high:
                if high[r] < nominal:
                    raise ConfigError(f"{ctx}: spec.max.{r} is below spec.min.{r}; raise max")
                q["borrowing_limit"] = high[r] - nominal
            res[r] = q
        if res:
            queue["quotas"] = [{"flavor": ANY_FLAVOR, "resources": res}]
            self.needs_any_flavor = True
        self._put(self.queues, name, queue, ctx, "queue")

    # helpers -----------------------------------------------------------------------------

    def _resources(self, value: Any, where: str) -> dict[str, int]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping like {{cpu: '64', memory: '256Gi'}}")
        out: dict[str, int] = {}
        for key, amount in value.items():
            ours = _kube_resource(str(key))
            if ours is None:
                self.notes.append(f"{where}: resource {key!r} ignored")
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


def _kube_resource(name: str) -> str | None:
    if name in ("cpu", "memory"):
        return name
    if name.endswith("/gpu"):
        return "gpu"
    return None


# -- assembling --------------------------------------------------------------------------


def _assemble(raw: dict[str, Any], importer: _Importer, source: str) -> LoadedConfig:
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

    try:
        config = convert_config(raw)
    except DecodeError as exc:
        raise ConfigError(f"{source}: {_explain(str(exc))}") from None

    aliases = {name: target for name, (target, _) in importer.aliases.items()}
    for alias, target in aliases_raw.items():
        aliases[str(alias)] = str(target)
    _check_references(config, aliases, source)
    config = msgspec.structs.replace(config, queue_aliases=aliases)
    return LoadedConfig(config=config, aliases=aliases, notes=list(importer.notes))


def _check_references(config: BrokerConfig, aliases: Mapping[str, str], source: str) -> None:
    queue_names = {q.name for q in config.queues}
    flavor_names = {f.name for f in config.flavors}
    if config.flavors:
        for qi, queue in enumerate(config.queues):
            for fi, fq in enumerate(queue.quotas or []):
                if fq.flavor not in flavor_names:
                    close = difflib.get_close_matches(fq.flavor, sorted(flavor_names), n=1)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    raise ConfigError(
                        f"{source}: queues[{qi}].quotas[{fi}].flavor: {fq.flavor!r} is not a "
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
    data = msgspec.to_builtins(config)
    for queue in data.get("queues", []):
        if queue.get("preemption") == {}:
            del queue["preemption"]
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
