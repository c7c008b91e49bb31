"""Volcano's Queue as a Muster queue, or as a cohort when other queues name it as their
parent (what each field means: docs/compat.md)."""

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


class VolcanoImporter(DeferredImporter):
    """Volcano queues are kept until `finish`: whether one is a leaf (a queue) or a parent (a
    cohort) depends on the other queues of the import."""

    def queue(
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
        pending = Pending(
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
            self.out.notes.append(f"{ctx}: spec.state Closed ignored; the queue is open in Muster")
        for key in ("priority", "affinity", "extendClusters", "type", "dequeueStrategy"):
            if spec.get(key) is not None:
                self.out.notes.append(f"{ctx}: spec.{key} ignored (no equivalent)")
        if name in self.pending:
            raise ConfigError(
                f"{ctx}: a queue named {name!r} is already defined by "
                f"{self.pending[name].ctx}; names must be unique across imported files"
            )
        self.pending[name] = pending

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
                self.out.notes.append(
                    f"{ctx}: annotation volcano.sh/hierarchy-weights ignored without "
                    "volcano.sh/hierarchy"
                )
            return None
        if parent is not None:
            self.out.notes.append(
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

    def finish(self) -> None:
        pending = self.pending
        children: dict[str, list[Pending]] = {}
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

    def _volcano_leaf(self, p: Pending, flat_weights: dict[str, float]) -> None:
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
                if node not in self.out.cohorts:
                    cohort = {"name": node}
                    if i > 0:
                        cohort["parent"] = p.hierarchy[i - 1][0]
                    self.out.cohorts[node] = (cohort, p.ctx)
            queue["weight"] = flat_weights[p.hierarchy[-1][0]]
            self.out.notes.append(
                f"{p.ctx}: volcano.sh/hierarchy-weights flattened into the queue weight "
                f"{queue['weight']:g} (the product of its share at each level); cohorts carry "
                "no weight in Muster, and spec.weight is superseded"
            )
        if res:
            missing = sorted({"gpu", "cpu", "memory"} - set(res))
            if missing:
                self.out.notes.append(
                    f"{p.ctx}: {', '.join(missing)} not in spec.deserved/capability, so not "
                    "limited (as Volcano, whose root capability is the whole cluster)"
                )
            queue["quotas"] = [{"flavor": ANY_FLAVOR, "resources": res}]
            self.out.needs_any_flavor = True
        self._put(self.out.queues, p.name, queue, p.ctx, "queue")

    def _volcano_parent(self, p: Pending, kids: list[Pending]) -> None:
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
                    f"parent's ({amount_text(r, inner)} > {amount_text(r, share)}); Volcano "
                    "refuses that, so lower a child's deserved or raise the parent's"
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
            self.out.needs_any_flavor = True
        self.out.notes.append(
            f"{p.ctx}: parent queue imported as a cohort of {', '.join(k.name for k in kids)} "
            "(jobs go to leaf queues)"
        )
        if p.weight != 1.0:
            self.out.notes.append(
                f"{p.ctx}: spec.weight of a parent queue ignored (cohorts carry no weight)"
            )
        self._put(self.out.cohorts, p.name, cohort, p.ctx, "cohort")

    def _guarantee(self, p: Pending, res: dict[str, dict[str, Any]]) -> None:
        """Volcano's guarantee is reserved for the queue: Kueue's lending limit N - guarantee."""
        for r, keep in p.keep.items():
            q = res.get(r)
            if q is None or keep > q["nominal"]:
                raise ConfigError(
                    f"{p.ctx}: spec.guarantee.resource.{r} exceeds spec.deserved.{r}; Volcano "
                    "requires guarantee <= deserved"
                )
            q["lending_limit"] = q["nominal"] - keep


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
