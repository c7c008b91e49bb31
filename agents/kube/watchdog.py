"""The fence watchdog: ends attempts whose fence lapsed, without the agent.

The kube agent writes each attempt's broker-granted fence on every workload object it creates
as the annotation `muster.dev/fence-until` (unix seconds) and moves it forward while the
broker hears it (agents/kube/fence.py). A hung agent stops moving it. This small process,
deployed on its own (deploy/watchdog/), lists Muster's objects every `period_s` and deletes
each whose annotation lies more than `skew_s` in the past; the operators (or the Job
controller) then end the pods. Objects without the annotation are never touched.

The broker re-dispatches once the fence lapsed, so the guarantee of "never two copies" needs
fence window > period_s + skew_s + the pods' termination grace (docs/kubernetes.md).
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
from agents.kube.decode import KObject
from agents.kube.fence import fence_until
from kinds.base import ANN_JOB, Resource
from kinds.pods import selector
from kinds.registry import FENCED_RESOURCES
from schemas import healthz
from schemas.job import DnsLabel

log = structlog.get_logger("muster.kube.watchdog")

# What one failed sweep may raise: the API server's answers and the transport's failures.
SWEEP_ERRORS = (KubeApiError, TimeoutError, OSError, aiohttp.ClientError)


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

    async def sweep(self) -> int:
        """One pass over every fenced kind; the count of objects deleted."""
        deleted = 0
        for res in self._resources:
            collection = res.collection(self.config.namespace)
            try:
                items, _ = await self.rest.list_all(
                    collection, KObject, selector(), self.config.list_page_size
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
                until = fence_until(obj.metadata.annotations)
                if until is None or obj.metadata.deletionTimestamp is not None:
                    continue
                late = self._clock() - until
                if late <= self.config.skew_s:
                    continue
                path = item_path(collection, obj.metadata.name)
                if await self.rest.delete(path, self.config.delete_propagation):
                    deleted += 1
                    self.deleted += 1
                    self.log.warning(
                        "fence lapsed; workload object deleted",
                        kind=res.kind,
                        name=obj.metadata.name,
                        job_id=obj.metadata.annotations.get(ANN_JOB, ""),
                        late_s=round(late, 1),
                    )
        self.sweeps += 1
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
