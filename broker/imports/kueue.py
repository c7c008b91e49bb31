"""Kueue's ResourceFlavor, ClusterQueue, Cohort and LocalQueue as Muster flavor classes,
queues, cohorts and queue aliases (what each field means: docs/compat.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker.imports.base import ConfigError, SourceImporter, kube_resource, resource_amount
from broker.manifests import gpu_type_from_labels
from kinds.nodelabels import CAPACITY_LABELS, GPU_TYPE_SELECTOR_LABELS, capacity_type_from_labels
from kinds.requests import is_fabric
from schemas.quantity import QuantityError, parse_quantity

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


class KueueImporter(SourceImporter):
    """ResourceFlavor -> flavor class, ClusterQueue -> queue, Cohort -> cohort, LocalQueue ->
    queue alias."""

    def resource_flavor(
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
            self.out.notes.append(f"{ctx}: spot flavor (spec.nodeTaints carries {spot_taint!r})")
        elif capacity is None and labels and tolerated is None:
            capacity = "on-demand"
            self.out.notes.append(
                f"{ctx}: no capacity-type node label and no spot taint; taken as on-demand "
                "(spot nodes carry a label and a taint this flavor does not tolerate). Set "
                "capacity_type under flavors: in the Muster config to change it"
            )
        elif capacity is None and tolerated is not None:
            self.out.notes.append(
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
            self.out.notes.append(
                f"{ctx}: spec.nodeLabels {', '.join(unmatched)} not matched; Muster matches "
                "flavors by capacity type and GPU type only"
            )
        others = [
            str(t.get("key"))
            for t in spec.get("nodeTaints") or []
            if isinstance(t, Mapping) and str(t.get("key")) != spot_taint
        ]
        if others:
            self.out.notes.append(
                f"{ctx}: spec.nodeTaints {', '.join(others)} not matched; only a spot taint "
                "says something Muster uses (the capacity type)"
            )
        if spec.get("tolerations"):
            self.out.notes.append(
                f"{ctx}: spec.tolerations not added to pods; the agent's pod template decides"
            )
        self._put(self.out.flavors, name, flavor, ctx, "flavor")

    def cluster_queue(
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
            self.out.notes.append(
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
            self.out.notes.append(
                f"{ctx}: spec.preemption.borrowWithinCohort ignored; Muster never preempts to "
                "borrow"
            )
        fungibility = spec.get("flavorFungibility")
        if isinstance(fungibility, Mapping):
            for key, default in (("whenCanBorrow", "Borrow"), ("whenCanPreempt", "TryNextFlavor")):
                value = fungibility.get(key)
                if value not in (None, default):
                    self.out.notes.append(
                        f"{ctx}: spec.flavorFungibility.{key}: {value} imported as {default}: "
                        "the next flavor in order is tried when one has no room"
                    )
        for key in ("admissionChecks", "admissionChecksStrategy", "admissionScope"):
            if spec.get(key):
                self.out.notes.append(f"{ctx}: spec.{key} ignored (no equivalent)")
        if spec.get("namespaceSelector"):
            self.out.notes.append(
                f"{ctx}: spec.namespaceSelector ignored; Muster has no namespaces, jobs pick "
                "their queue by name"
            )
        if spec.get("stopPolicy") not in (None, "None"):
            self.out.notes.append(f"{ctx}: spec.stopPolicy ignored; the queue is active in Muster")
        queue["quotas"] = self._resource_groups(spec, ctx, fabric=True)
        order = list(dict.fromkeys(q["flavor"] for q in queue["quotas"]))
        if len(order) > 1:  # Kueue tries a ClusterQueue's flavors in the order listed
            queue["flavor_order"] = order
        self._put(self.out.queues, name, queue, ctx, "queue")

    def cohort(
        self, name: str, spec: Mapping[str, Any], meta: Mapping[str, Any], ctx: str, src: str
    ) -> None:
        self._unknown(spec, ("parent", "parentName", "resourceGroups", "fairSharing"), ctx, "spec")
        cohort: dict[str, Any] = {"name": name}
        parent = spec.get("parentName", spec.get("parent"))
        if parent:
            cohort["parent"] = self._label(parent, f"{ctx}: spec.parentName")
        if spec.get("fairSharing"):
            self.out.notes.append(
                f"{ctx}: spec.fairSharing ignored; Muster shares between queues by their own "
                "weights, not per cohort"
            )
        quotas = self._resource_groups(spec, ctx)
        if quotas:
            cohort["quotas"] = quotas
        self._put(self.out.cohorts, name, cohort, ctx, "cohort")

    def _resource_groups(
        self, spec: Mapping[str, Any], ctx: str, fabric: bool = False
    ) -> list[dict[str, Any]]:
        """Quotas per flavor. With `fabric` (a ClusterQueue), a fabric resource's nominalQuota
        becomes the queue's cap of it (`FlavorQuota.extended`); its borrowing and lending
        limits have no equivalent and are noted."""
        quotas: dict[str, dict[str, Any]] = {}
        caps: dict[str, dict[str, int]] = {}
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
                    ours = kube_resource(rname)
                    if fabric and ours is None and is_fabric(rname):
                        unit = "memory" if rname.startswith("hugepages-") else "gpu"
                        mine = caps.setdefault(fname, {})
                        mine[rname] = resource_amount(
                            unit, res.get("nominalQuota"), f"{rpath}.nominalQuota"
                        )
                        if res.get("borrowingLimit") is not None or res.get("lendingLimit"):
                            self.out.notes.append(
                                f"{rpath}: {rname} borrowingLimit/lendingLimit ignored (a "
                                "fabric resource's quota is the queue's own cap)"
                            )
                        continue
                    if ours is None:
                        self.out.notes.append(
                            f"{rpath}: resource {rname!r} ignored (Muster "
                            "counts gpu, cpu and memory)"
                        )
                        continue
                    if ours in resources:
                        raise ConfigError(f"{rpath}: {rname!r} listed twice for {fname}")
                    quota: dict[str, Any] = {
                        "nominal": resource_amount(
                            ours, res.get("nominalQuota"), f"{rpath}.nominalQuota"
                        )
                    }
                    for kube_key, our_key in (
                        ("borrowingLimit", "borrowing_limit"),
                        ("lendingLimit", "lending_limit"),
                    ):
                        if res.get(kube_key) is not None:
                            quota[our_key] = resource_amount(
                                ours, res[kube_key], f"{rpath}.{kube_key}"
                            )
                    resources[ours] = quota
        return [
            {"flavor": f, "resources": r, **({"extended": caps[f]} if f in caps else {})}
            for f, r in quotas.items()
        ]

    def local_queue(
        self, name: str, spec: Mapping[str, Any], meta: Mapping[str, Any], ctx: str, src: str
    ) -> None:
        self._unknown(spec, ("clusterQueue", "stopPolicy", "fairSharing"), ctx, "spec")
        target = self._label(spec.get("clusterQueue"), f"{ctx}: spec.clusterQueue")
        if spec.get("fairSharing"):
            self.out.notes.append(
                f"{ctx}: spec.fairSharing ignored; a LocalQueue is another name for its "
                "ClusterQueue in Muster, with no share of its own"
            )
        if spec.get("stopPolicy") not in (None, "None"):
            self.out.notes.append(f"{ctx}: spec.stopPolicy ignored; the alias stays open")
        if target == name:
            return  # submitting to the LocalQueue's name already reaches the queue
        seen = self.out.aliases.get(name)
        if seen is not None and seen[0] != target:
            raise ConfigError(
                f"{ctx}: LocalQueue {name!r} points at {target!r}, but another LocalQueue of "
                f"that name ({seen[1]}) points at {seen[0]!r}; Muster has no namespaces, so "
                "rename one of them"
            )
        self.out.aliases[name] = (target, ctx)

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
