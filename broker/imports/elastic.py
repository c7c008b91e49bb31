"""ElasticQuota of Koordinator (scheduling.sigs.k8s.io) and of scheduler-plugins
(scheduling.x-k8s.io) as Muster queues and cohorts (what each field means: docs/compat.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker.imports.base import (
    ANY_FLAVOR,
    ConfigError,
    DeferredImporter,
    Pending,
    amount_text,
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


class ElasticImporter(DeferredImporter):
    """Koordinator quotas are kept until `finish`: a parent quota becomes a cohort, and the
    top-level quotas share the root cohort `elastic-quota`."""

    def plugins_quota(
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
            self.out.needs_any_flavor = True
        self._put(self.out.queues, name, queue, ctx, "queue")

    def koord_quota(
        self, name: str, spec: Mapping[str, Any], meta: Mapping[str, Any], ctx: str, src: str
    ) -> None:
        self._unknown(spec, ("min", "max"), ctx, "spec")
        labels = meta.get("labels") or {}
        if not isinstance(labels, Mapping):
            raise ConfigError(f"{ctx}: metadata.labels: expected a mapping")
        for key in labels:
            if str(key).startswith(_KOORD) and str(key) not in _KOORD_LABELS:
                self.out.notes.append(f"{ctx}: label {key} ignored (no equivalent)")
        if labels.get(f"{_KOORD}shared-weight") is not None:
            self.out.notes.append(
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
        if name in self.pending:
            raise ConfigError(
                f"{ctx}: a quota named {name!r} is already defined by {self.pending[name].ctx}; "
                "names must be unique across imported files"
            )
        res = self._min_max(spec, ctx)
        self.pending[name] = Pending(
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

    def finish(self) -> None:
        pending = self.pending
        children: dict[str, list[Pending]] = {}
        for p in pending.values():
            if p.parent is None:
                continue
            up = pending.get(p.parent)
            if up is None:
                self.out.notes.append(
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

    def _koord_root(self, top: list[Pending]) -> None:
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
        self._put(self.out.cohorts, "elastic-quota", cohort, top[0].ctx, "cohort")
        self.out.needs_any_flavor = True
        self.out.notes.append(
            "cohort elastic-quota (Koordinator's root quota) lends "
            + ", ".join(f"{r} {amount_text(r, extra[r])}" for r in sorted(res))
            + " beyond the top-level mins: each quota may reach its max while the fleet has room"
        )

    def _koord_leaf(self, p: Pending) -> None:
        queue: dict[str, Any] = {"name": p.name, "cohort": p.parent or "elastic-quota"}
        queue["strategy"] = "StrictFIFO" if p.policy == "Block" else "BestEffortFIFO"
        if p.policy == "Intelligent":
            self.out.notes.append(f"{p.ctx}: queue policy Intelligent imported as BestEffortFIFO")
        res = self._quota_of(p)
        if not p.lends:
            for q in res.values():
                q["lending_limit"] = 0
        if res:
            queue["quotas"] = [{"flavor": ANY_FLAVOR, "resources": res}]
            self.out.needs_any_flavor = True
        self._put(self.out.queues, p.name, queue, p.ctx, "queue")

    def _koord_parent(self, p: Pending, kids: list[Pending]) -> None:
        """A parent quota: a cohort whose subtree quota is its min and whose borrowing limit
        (max - min) keeps the whole subtree within its max. It runs no jobs."""
        cohort: dict[str, Any] = {"name": p.name, "parent": p.parent or "elastic-quota"}
        res = self._quota_of(p)
        for r, q in res.items():
            inner = sum(k.low.get(r, 0) for k in kids)
            if inner > q["nominal"]:
                raise ConfigError(
                    f"{p.ctx}: the children's spec.min.{r} add up to more than this parent's "
                    f"({amount_text(r, inner)} > {amount_text(r, q['nominal'])}); "
                    "Koordinator's webhook refuses this (checkMinQuotaSum), so lower a child's "
                    "min or raise the parent's"
                )
            q["nominal"] -= inner
        if not p.lends:
            for q in res.values():
                q["lending_limit"] = 0
        if res:
            cohort["quotas"] = [{"flavor": ANY_FLAVOR, "resources": res}]
            self.out.needs_any_flavor = True
        who = ", ".join(k.name for k in kids) or "no child quotas"
        self.out.notes.append(
            f"{p.ctx}: parent quota imported as a cohort of {who}; it runs no jobs"
        )
        if p.policy != "Priority":
            self.out.notes.append(f"{p.ctx}: koord-queue/queue-policy of a parent quota ignored")
        self._put(self.out.cohorts, p.name, cohort, p.ctx, "cohort")

    @staticmethod
    def _quota_of(p: Pending) -> dict[str, dict[str, Any]]:
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


def _truthy(value: Any) -> bool:
    return value is True or str(value).strip().lower() == "true"


def _falsy(value: Any) -> bool:
    return value is False or str(value).strip().lower() == "false"
