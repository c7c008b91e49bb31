"""The contract of one job kind: GVK, podsets, retries, verdict, RBAC."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kinds.base import KindError, PodTemplate, ResizeRefused, Resource, Verdict

KUEUE_CONTROLLERS = "kueue.x-k8s.io/"  # MultiKueue's managedBy value starts so


class Adapter:
    """One job kind. Subclasses set the class attributes and override what differs."""

    resource: Resource
    # Whether objects of the kind carry a verdict in their status worth watching.
    has_status: bool = True
    # docs/kinds.md columns, kept beside the code they describe
    podsets_doc: str = ""
    retries_doc: str = ""
    verdict_doc: str = ""
    # Replica types / roles whose success is the job's success (Kubeflow's success policies).
    leaders: frozenset[str] = frozenset()
    # Podset order in the derived gang: these first, in this order, then the rest as written.
    order: tuple[str, ...] = ()
    # Where the author's own retry count lives (`spec.backoffLimit`, ...): Muster turns the
    # kind's retries off and restarts the whole gang that many times instead.
    retry_field: tuple[str, ...] = ()
    # Where the kind says "do not start yet" (`spec.suspend`, Kueue's admission gate) and
    # which controller reconciles it (`spec.managedBy`), and the kind's own controller names.
    suspend_field: tuple[str, ...] = ()
    managed_by_field: tuple[str, ...] = ()
    controllers: frozenset[str] = frozenset()
    # Whether `resize_patch` can change a running object's size (the agent then needs patch).
    resizable: bool = False
    # Whether `kubectl apply` of a marked object of the kind submits it (agents/kube/frontdoor.py).
    front_door: bool = True
    # The kind whose object a resize patches when it is not the created one (a RayJob's
    # workers run in the RayCluster KubeRay made from it): the agent needs patch on it only.
    resized: Resource | None = None

    @property
    def created(self) -> Resource:
        """What the agent creates for a manifest of this kind (usually the kind itself)."""
        return self.resource

    def handles(self, api_version: str, kind: str) -> bool:
        return (api_version, kind) == (self.resource.api_version, self.resource.kind)

    def templates(self, manifest: Mapping[str, Any]) -> list[PodTemplate]:
        """The pod templates with their podset names, in manifest order; templates with 0
        replicas are listed too (they need no node)."""
        raise NotImplementedError

    def patch_templates(self, manifest: dict[str, Any]) -> list[PodTemplate]:
        """The templates the agent patches (the manifest's own, unless the kind keeps its pod
        template elsewhere and takes a patch instead)."""
        return self.templates(manifest)

    def disable_retries(self, manifest: dict[str, Any]) -> None:
        """Make one failed replica fail the object: Muster's restart budget decides."""

    def take_control(self, manifest: dict[str, Any]) -> None:
        """Muster admits the object by creating it: a `suspend` a queueing controller (Kueue)
        set is cleared, and so is a `managedBy` naming Kueue or the kind's own controller; any
        other `managedBy` is refused, as the author meant another controller to run it."""
        for path, controller in ((self.suspend_field, False), (self.managed_by_field, True)):
            if not path:
                continue
            parent: Any = manifest
            for key in path[:-1]:
                parent = parent.get(key) if isinstance(parent, dict) else None
            if not isinstance(parent, dict) or path[-1] not in parent:
                continue
            value = parent[path[-1]]
            if controller and isinstance(value, str) and value:
                theirs = not value.startswith(KUEUE_CONTROLLERS) and value not in self.controllers
                if theirs:
                    where = ".".join(path)
                    raise KindError(
                        f"{where}: {value!r} hands this {self.resource.kind} to another "
                        f"controller, which Muster cannot run it with; remove {where} (Muster "
                        f"places it and {sorted(self.controllers)[0]} runs it)"
                    )
            del parent[path[-1]]

    def rename(self, manifest: dict[str, Any], old: str, new: str) -> None:
        """The object is created as `new`, not the author's `old`: rewrite what the author
        hard-coded from the old name (pod hostnames in env, command and args)."""

    def set_ttl(self, manifest: dict[str, Any], seconds: int) -> None:
        """Let the kind delete a finished object after `seconds` (no-op: Muster's own GC);
        a TTL the author set is kept."""

    def retries(self, manifest: Mapping[str, Any]) -> tuple[int, str] | None:
        """The author's retry count and its field path, when the manifest sets one."""
        value: Any = manifest
        for key in self.retry_field:
            value = value.get(key) if isinstance(value, Mapping) else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value, ".".join(self.retry_field)
        return None

    def verdict(self, name: str, status: Mapping[str, Any]) -> Verdict | None:
        """Succeeded / failed by the object's own status; None while it runs."""
        return None

    def min_available(self, manifest: Mapping[str, Any]) -> int | None:
        return None

    def min_pods(self, manifest: Mapping[str, Any]) -> dict[str, int]:
        """Partial admission: podset -> the fewest pods it may start with when quota or
        capacity is short. Empty: every podset starts whole or not at all."""
        return {}

    def elastic(self, manifest: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
        """Elastic podsets: podset -> (fewest, most) replicas it may run with while it runs,
        shrinking and growing in place. Empty: the kind declares no elasticity."""
        return {}

    def scale(self, manifest: dict[str, Any], podset: str, count: int) -> None:
        """Run `podset` with `count` pods (fewer than written: a partial admission; more:
        an elastic podset admitted towards its maximum)."""
        raise KindError(
            f"{self.resource.kind}: podset {podset!r} was admitted with {count} pods, and this "
            "kind cannot start with fewer pods than it asks for"
        )

    def resize_target(self, live: Mapping[str, Any]) -> str | None:
        """The name of the `resized` object that runs the `live` object's pods; None: the
        live object itself is patched."""
        return None

    def resize_patch(self, live: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
        """The JSON merge patch that makes the `live` object run what `new` renders: the same
        attempt for a Dispatch revision whose elastic podsets shrank or grew. Raises
        ResizeRefused when the kind cannot change its size while it runs."""
        raise ResizeRefused(
            f"{self.resource.kind} has no replica count Muster can change while it runs "
            "(only elastic podsets of PyTorchJob-style training jobs, Jobs, Volcano Jobs and "
            "the worker groups of RayJobs resize in place)"
        )

    def resize_body(
        self, live: Mapping[str, Any], new: Mapping[str, Any], leaving: Mapping[str, Sequence[str]]
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """The patch of the `live` object (or of its `resize_target`): a mapping is a JSON
        merge patch (`resize_patch`), a list a JSON patch (RFC 6902). `leaving`: the pods of
        each podset on the nodes the revision drops, for a kind that picks which to delete."""
        return self.resize_patch(live, new)

    def queue(self, manifest: Mapping[str, Any]) -> tuple[Any, str] | None:
        """A queue the kind's own scheduling fields name, with its field path."""
        return None

    def topology(self, manifest: Mapping[str, Any]) -> dict[str, str]:
        """The gang's topology level from the kind's own fields (`required`/`preferred`, as
        `kinds.topology` maps them). Empty: the kind names none."""
        return {}

    def podset_topologies(self, manifest: Mapping[str, Any]) -> dict[str, dict[str, str]]:
        """Podset -> its topology level from the kind's own per-podset fields."""
        return {}
