"""The fence watchdog: ends a cluster's fenced attempts once its fence Lease lapsed, without
the agent.

The kube agent renews ONE Lease per cluster (`muster-fence` in the workload namespace) while
the broker hears it (agents/kube/fence.py). A hung, dead or cut-off agent stops renewing it.
This small process, deployed on its own (deploy/agent/watchdog.yaml), reads that Lease every
`period_s` (one GET); only once its deadline lies more than `skew_s` in the past does it list
Muster's objects and delete each that carries the fence mark (`muster.dev/fenced`), unless the
Lease was renewed meanwhile; the operators (or the Job controller) then end the pods. Objects
without the mark, and everything while the Lease is absent, are never touched.

The broker re-dispatches a silent cluster's jobs only `lost_after_s` after it last heard the
agent, and the Lease lapses `fence_lead_s` before that, so "never two copies" needs
`fence_lead_s` > period_s + skew_s + the pods' termination grace (docs/kubernetes.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Annotated, Literal

import aiohttp
import msgspec
import structlog
from kubernetes_asyncio import config as kube_config
from kubernetes_asyncio.client import ApiClient, Configuration
from msgspec import Meta
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, Metric

from agents.kube.auth import TokenRefresher
from agents.kube.client import KubeApiError, KubeRest, Outage, item_path, sleep_or_stop
from agents.kube.fence import ANN_FENCED, FENCED_VALUE, decode_lease, lease_path, lease_until
from kinds.base import ANN_JOB, Resource
from kinds.pods import selector
from kinds.registry import FENCED_RESOURCES
from schemas import healthz
from schemas.job import DnsLabel

log = structlog.get_logger("muster.kube.watchdog")

# What one failed sweep may raise: the API server's answers and the transport's failures.
SWEEP_ERRORS = (KubeApiError, TimeoutError, OSError, aiohttp.ClientError)


class _FencedMeta(msgspec.Struct):
    name: str = ""
    annotations: dict[str, str] = {}
    deletionTimestamp: str | None = None


class _Fenced(msgspec.Struct):
    """What the watchdog reads of a workload object: its name and fence mark."""

    metadata: _FencedMeta = msgspec.field(default_factory=_FencedMeta)


class WatchdogConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """How often the watchdog looks, and how far past its fence an object must be."""

    namespace: DnsLabel = "muster-workloads"
    period_s: Annotated[float, Meta(gt=0, le=600)] = 5.0
    # Clocks of the agent's and the watchdog's nodes may differ by this much.
    skew_s: Annotated[float, Meta(ge=0, le=600)] = 2.0
    list_page_size: Annotated[int, Meta(ge=1, le=10_000)] = 500
    delete_propagation: Literal["Background", "Foreground"] = "Background"
    backoff_initial_s: Annotated[float, Meta(gt=0, le=60)] = 0.5
    backoff_max_s: Annotated[float, Meta(gt=0, le=600)] = 30.0

    def __post_init__(self) -> None:
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s: must be >= backoff_initial_s")


class FenceWatchdog:
    """Deletes Muster's workload objects whose fence annotation has lapsed."""

    def __init__(
        self,
        rest: KubeRest,
        config: WatchdogConfig,
        clock: Callable[[], float] = time.time,
        resources: tuple[Resource, ...] = FENCED_RESOURCES,
    ) -> None:
        self.rest = rest
        self.config = config
        self._clock = clock
        self._resources = resources
        self._absent: set[str] = set()  # collections answering 404/403, logged once
        self.deleted = 0  # objects deleted because their fence lapsed (the metric)
        self.sweeps = 0
        self.failures = 0  # sweeps that failed and were retried
        self.outage = Outage(rest.url)
        self.log = log.bind(namespace=config.namespace)

    async def lapsed_at(self) -> float | None:
        """The deadline of the cluster's fence Lease when it lapsed more than `skew_s` ago;
        None while it is live, or absent (never fenced: nothing to enforce)."""
        data = await self.rest.request("GET", lease_path(self.config.namespace), ok_missing=True)
        lease = decode_lease(data) if data is not None else None
        until = lease_until(lease) if lease is not None else None
        if until is None or self._clock() - until <= self.config.skew_s:
            return None
        return until

    async def sweep(self) -> int:
        """One look at the Lease and, only when it lapsed, one pass over every fenced kind;
        the count of objects deleted."""
        deleted = await self._sweep()
        self.sweeps += 1
        return deleted

    async def _sweep(self) -> int:
        until = await self.lapsed_at()
        if until is None:
            return 0
        doomed: list[tuple[Resource, str, _Fenced]] = []
        for res in self._resources:
            collection = res.collection(self.config.namespace)
            try:
                # list_all decodes any Struct; its TypeVar names the agent's own kinds
                items, _ = await self.rest.list_all(
                    collection,
                    _Fenced,  # type: ignore[type-var]
                    selector(),
                    self.config.list_page_size,
                )
            except KubeApiError as exc:
                if exc.status in (404, 403):  # CRD not installed, or not granted: skip it
                    if collection not in self._absent:
                        self._absent.add(collection)
                        self.log.info("kind not served; skipped", kind=res.kind, status=exc.status)
                    continue
                raise
            self._absent.discard(collection)
            for obj in items:
                meta = obj.metadata
                if meta.annotations.get(ANN_FENCED) != FENCED_VALUE or meta.deletionTimestamp:
                    continue
                doomed.append((res, collection, obj))
        # Renewed while we listed (the agent is back): nothing may go. The agent renews before
        # it creates, so anything created after this check is not in the list.
        if not doomed or await self.lapsed_at() is None:
            return 0
        late = round(self._clock() - until, 1)
        deleted = 0
        for res, collection, obj in doomed:
            path = item_path(collection, obj.metadata.name)
            if await self.rest.delete(path, self.config.delete_propagation):
                deleted += 1
                self.deleted += 1
                self.log.warning(
                    "fence lapsed; workload object deleted",
                    kind=res.kind,
                    name=obj.metadata.name,
                    job_id=obj.metadata.annotations.get(ANN_JOB, ""),
                    late_s=late,
                )
        return deleted

    async def run(self, stop: asyncio.Event) -> None:
        """Sweep every period until `stop`; a failed sweep is retried with backoff (one log
        line per outage, one when the API server answers again)."""
        backoff = self.config.backoff_initial_s
        while not stop.is_set():
            try:
                await self.sweep()
            except SWEEP_ERRORS as exc:
                self.failures += 1
                self.outage.failed(exc, self.config.backoff_max_s)
                if await sleep_or_stop(stop, backoff):
                    return
                backoff = min(backoff * 2, self.config.backoff_max_s)
                continue
            self.outage.ok()
            backoff = self.config.backoff_initial_s
            if await sleep_or_stop(stop, self.config.period_s):
                return


class WatchdogCollector:
    """Prometheus view of one watchdog's counters, read at scrape time."""

    def __init__(self, watchdog: FenceWatchdog) -> None:
        self.watchdog = watchdog

    def collect(self) -> Iterator[Metric]:
        counters = CounterMetricFamily(
            "muster_fence_watchdog",
            "Fence watchdog: workload objects deleted because their fence lapsed, sweeps "
            "done, sweeps failed (retried with backoff)",
            labels=["counter"],
        )
        w = self.watchdog
        for name, value in (("deleted", w.deleted), ("sweeps", w.sweeps), ("failures", w.failures)):
            counters.add_metric([name], float(value))
        yield counters


async def serve(
    config: WatchdogConfig,
    *,
    in_cluster: bool,
    kubeconfig: str | None = None,
    context: str | None = None,
    metrics_port: int | None = None,
    metrics_addr: str = "127.0.0.1",
) -> None:
    """Run the watchdog until cancelled (SIGTERM through the caller)."""
    cfg = Configuration()
    refresher: TokenRefresher | None = None
    if in_cluster:
        kube_config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    else:
        refresher = await TokenRefresher.load(cfg, kubeconfig, context)
    api = ApiClient(configuration=cfg)

    async def refresh() -> bool:
        return refresher is not None and await refresher.force()

    watchdog = FenceWatchdog(KubeRest(api, refresh=refresh), config)
    if metrics_port is not None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(WatchdogCollector(watchdog))
        start_http_server(metrics_port, addr=metrics_addr, registry=registry)
    watchdog.log.info(
        "fence watchdog started",
        period_s=config.period_s,
        skew_s=config.skew_s,
        url=api.configuration.host,
    )
    # Ready once a sweep went through and while the API server answers.
    health_port = healthz.port_from_env()
    health = (
        await healthz.serve(
            health_port, lambda: watchdog.sweeps > 0 and watchdog.outage.since is None
        )
        if health_port
        else None
    )
    try:
        await watchdog.run(asyncio.Event())
    finally:
        if health is not None:
            health.close()
        await api.close()
