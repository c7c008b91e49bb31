"""The agent's side of the cluster fence: it keeps the one Lease (`fence.py`) renewed while
the broker hears it, takes up the Lease an earlier agent left, and marks what a fenced attempt
creates for the fence watchdog.

Kept apart from the backend's watches: a fence is a safety path, and its requests (one merge
patch per step, whatever the number of attempts) are easier to audit in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp

from agents.backend import BackendError
from agents.kube.client import KubeApiError, KubeRest
from agents.kube.fence import (
    ANN_FENCED,
    FENCED_VALUE,
    ClusterFence,
    decode_lease,
    lease_body,
    lease_collection,
    lease_path,
    renewal_patch,
)
from kinds.base import LABEL_TOP, SERVICE
from kinds.plan import PlannedObject
from schemas.agent import Dispatch


def fence_marked(cmd: Dispatch, obj: PlannedObject) -> PlannedObject:
    """The object with the fence watchdog's mark when it is a top-level workload object of a
    fenced attempt (Services run nothing); otherwise unchanged."""
    labels = obj.body.get("metadata", {}).get("labels", {})
    if not (cmd.fence_after_s > 0 and obj.resource != SERVICE and LABEL_TOP in labels):
        return obj
    meta = obj.body["metadata"]
    annotations = {**meta.get("annotations", {}), ANN_FENCED: FENCED_VALUE}
    return obj._replace(body={**obj.body, "metadata": {**meta, "annotations": annotations}})


class LeaseKeeper:
    """Renews and adopts the cluster's fence Lease in `namespace` for agent `cluster`."""

    def __init__(
        self,
        cluster: str,
        namespace: str,
        rest: Callable[[], KubeRest],
        clock: Callable[[], float],
        log: Any,
    ) -> None:
        self.namespace = namespace
        self.holder = f"muster-agent/{cluster}"
        self.state = ClusterFence(clock)
        self._rest = rest
        self.log = log

    async def renew(self, since: float) -> None:
        """The broker heard this agent at `since`: move the cluster's Lease to `since` + the
        window, when it grew a step. One request, whatever the number of attempts."""
        until = self.state.due(since)
        if until is None:
            return
        fence = self.state
        ns = self.namespace
        rest = self._rest()
        try:
            if fence.until is None:
                body = lease_body(ns, self.holder, since, fence.window_s)
                if await rest.create(lease_collection(ns), body) is None:
                    await rest.merge_patch(
                        lease_path(ns), renewal_patch(self.holder, since, fence.window_s)
                    )
            elif not await rest.merge_patch(
                lease_path(ns), renewal_patch(self.holder, since, fence.window_s)
            ):
                fence.until = None  # deleted under us: create it on the next renewal
                return
        except KubeApiError as exc:
            raise BackendError(f"fence lease renewal: {exc}") from None
        except (TimeoutError, OSError, aiohttp.ClientError) as exc:
            raise BackendError(f"fence lease renewal: {exc!r}") from None
        fence.written(until)

    async def adopt(self) -> None:
        """Take up the Lease an earlier agent of this cluster kept: its window covers every
        attempt found here, whatever its kind."""
        try:
            data = await self._rest().request("GET", lease_path(self.namespace), ok_missing=True)
        except KubeApiError as exc:
            self.log.warning("fence lease unreadable; renewed at the next dispatch", error=str(exc))
            return
        lease = decode_lease(data) if data is not None else None
        if lease is not None:
            self.state.adopt(lease)
            self.log.info(
                "fence lease taken up",
                window_s=self.state.window_s,
                until=self.state.until,
            )
