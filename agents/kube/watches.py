"""The kube backend's watches: one `Reflector` per kind it reads, their first lists (retried
until the API server answers) and their health (staleness, counters).

Nodes and pods (all namespaces: pods Muster did not place still use node capacity), each with
a `Reflector` (list, then watch with resourceVersion and bookmarks; re-list on 410 Gone and,
after a bounded backoff, on any other failure). Nodes that match no configured flavor are not
reported. Pods count as Muster's when they carry `muster.dev/job-id` AND live in a
configured workload namespace (a label in another namespace cannot fake a status).

Also, in each workload namespace and by Muster's top-level label selector, one Reflector per
kind Muster can create that has a status (`status.STATUS_RESOURCES`: batch/v1 Job, the Kubeflow
jobs, Volcano Job, JobSet). Pods alone miss the operator's verdict: with `restartPolicy:
OnFailure` a crashing container restarts inside a pod that stays Running until the operator
marks the job Failed, and an operator may delete pods once the job Succeeded. A kind whose CRD
is not installed (404) or not granted (403) is logged once and re-tried every resync period;
an object whose status does not decode is counted (`bad_objects`), logged and ignored.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

import aiohttp

from agents.backend import BackendError
from agents.kube.client import (
    BadInput,
    KubeApiError,
    KubeRest,
    Outage,
    Reflector,
    sleep_or_stop,
)
from agents.kube.config import KubeBackendConfig
from agents.kube.decode import KJob, KNode, KPod
from agents.kube.nodewatch import NodeWatch
from agents.kube.usage import ForeignPods
from kinds.base import LABEL_JOB, Resource
from kinds.pods import selector
from kinds.registry import OWNED_RESOURCES

# Finished pods hold no capacity; a busy cluster has far more of them than of live ones.
UNFINISHED_PODS = "status.phase!=Succeeded,status.phase!=Failed"

PodsReplaced = Callable[[list[KPod]], Awaitable[None]]
PodEvent = Callable[[str, KPod], None]
JobHandlers = tuple[Callable[[list[KJob]], Awaitable[None]], Callable[[str, KJob], None]]


class Watches:
    """The reflectors of one backend and what they feed: nodes (`NodeWatch`), every
    unfinished pod (`ForeignPods`), Muster's pods and its workload objects (the backend's
    handlers)."""

    def __init__(
        self,
        config: KubeBackendConfig,
        namespaces: Collection[str],
        status_kinds: Mapping[str, Resource],
        bad_input: BadInput,
        node_watch: NodeWatch,
        foreign_pods: ForeignPods,
        muster_pods: tuple[PodsReplaced, PodEvent],
        job_handlers: Callable[[Resource], JobHandlers],
        scan: Callable[[list[Resource]], Awaitable[Any]],
        stopped: Any,
        log: Any,
    ) -> None:
        self.config = config
        self.namespaces = namespaces
        self.status_kinds = status_kinds
        self.bad_input = bad_input
        self.node_watch = node_watch
        self.foreign_pods = foreign_pods
        self.muster_pods = muster_pods
        self.job_handlers = job_handlers
        self._scan = scan  # lists Muster's objects of kinds without a status
        self._stopped = stopped  # asyncio.Event: the backend stops
        self.log = log
        self._rest: Callable[[], KubeRest] = lambda: rest_missing()
        self.node: Reflector[KNode] | None = None
        self.pod: Reflector[KPod] | None = None  # every unfinished pod
        self.muster_pod: Reflector[KPod] | None = None  # Muster's pods, any phase
        self.jobs: dict[str, Reflector[KJob]] = {}  # by collection

    def build(self, rest: KubeRest) -> dict[str, Any]:
        """Create the reflectors; the settings they share (for the autoscaler's) returned."""
        self._rest = lambda: rest
        cfg = self.config
        outage = Outage(rest.url)
        common: dict[str, Any] = {
            "page_size": cfg.list_page_size,
            "watch_timeout_s": cfg.watch_timeout_s,
            "resync_s": cfg.resync_period_s,
            "backoff_initial_s": cfg.backoff_initial_s,
            "backoff_max_s": cfg.backoff_max_s,
            "outage": outage,
            "bad_input": self.bad_input,
        }
        self.node = Reflector(
            rest,
            "/api/v1/nodes",
            KNode,
            self.node_watch.replace_nodes,
            self.node_watch.node_event,
            label_selector=cfg.node_label_selector,
            name="nodes",
            **common,
        )
        # Pods of every namespace use node capacity, but finished ones do not: the field
        # selector keeps them (most pods of a busy cluster) out of lists and watches. A pod
        # that finishes then arrives as DELETED, which is what it is to capacity.
        # Streamed (no cache of 150,000 pods): the backend keeps a few integers per pod.
        self.pod = Reflector(
            rest,
            "/api/v1/pods",
            KPod,
            None,
            self.foreign_pods.event,
            on_page=self.foreign_pods.page,
            on_listed=self.foreign_pods.listed,
            field_selector=UNFINISHED_PODS,
            name="pods",
            **common,
        )
        # Muster's own pods, every phase (the exit codes of a failed pod are its verdict):
        # with several workload namespaces, one watch of every namespace (the ClusterRole's
        # list/watch on pods), the handler keeping those in a workload namespace.
        self.muster_pod = Reflector(
            rest,
            "/api/v1/pods"
            if len(self.namespaces) > 1
            else f"/api/v1/namespaces/{cfg.namespace}/pods",
            KPod,
            self.muster_pods[0],
            self.muster_pods[1],
            label_selector=LABEL_JOB,
            name="muster-pods",
            **common,
        )
        for collection, res in self.status_kinds.items():
            group = res.api_version.rsplit("/", 1)[0]
            replace, handle = self.job_handlers(res)
            self.jobs[collection] = Reflector(
                rest,
                collection,
                KJob,
                replace,
                handle,
                label_selector=selector(),
                absent_retry_s=cfg.resync_period_s,
                name=f"{res.plural}.{group}",
                **common,
            )
        return common

    def all(self) -> list[Reflector[Any]]:
        """Every reflector built, to run."""
        built: list[Reflector[Any] | None] = [self.node, self.pod, self.muster_pod]
        return [r for r in built if r is not None] + list(self.jobs.values())

    async def initial_lists(self) -> None:
        """The first lists, retried with backoff until the API server answers: an agent
        started before its API server is reachable waits (one log line with the URL) instead
        of exiting with a traceback."""
        assert self.node and self.pod and self.muster_pod
        backoff = self.config.backoff_initial_s
        outage = self.node.outage
        while True:
            try:
                # Kinds without a status (Services, Pods) are found by a scan; the others by
                # their reflector's list, which must not stop the agent (a CRD can be absent).
                await self._scan(
                    [
                        r
                        for r in OWNED_RESOURCES
                        if r.collection(self.config.namespace) not in self.status_kinds
                    ]
                )
                for jr in self.jobs.values():
                    try:
                        await jr.list_once()
                    except Exception as exc:
                        if not jr.note_absent(exc):
                            self.log.warning(
                                "listing workload objects failed; the watch retries",
                                collection=jr.name,
                                error=str(exc)[:300],
                            )
                await self.muster_pod.list_once()
                await self.pod.list_once()
                await self.node.list_once()
                outage.ok()
                return
            except (OSError, TimeoutError, aiohttp.ClientError, KubeApiError) as exc:
                if isinstance(exc, KubeApiError) and exc.status in (401, 403):
                    self.log.error(
                        "the API server refuses the agent's credentials; retrying",
                        url=self._rest().url,
                        error=str(exc)[:300],
                    )
                else:
                    outage.failed(exc, self.config.backoff_max_s)
                if await sleep_or_stop(self._stopped, backoff * (0.5 + random.random() / 2)):
                    raise BackendError("stopped before the API server answered") from None
                backoff = min(self.config.backoff_max_s, backoff * 2)

    def stale_s(self, stale_after_s: float) -> float:
        """Seconds the node or pod watches have been failing, once past `stale_after_s`
        (0 = fresh): the heartbeat carries it and the broker stops placing work here."""
        now = time.monotonic()
        worst = max(
            (r.stale_for(now) for r in (self.node, self.pod, self.muster_pod) if r),
            default=0.0,
        )
        return worst if worst > stale_after_s else 0.0

    def counters(self) -> dict[str, int]:
        """Watch health per reflector of nodes and pods, for the agent's metrics."""
        out: dict[str, int] = {}
        for r in (self.node, self.pod, self.muster_pod):
            if r is not None:
                for k in ("lists", "resyncs", "gone", "errors", "resumes", "events"):
                    out[f"{r.name}_{k}"] = getattr(r, k)
        return out


def rest_missing() -> KubeRest:
    raise BackendError("kube backend not started")
