"""Agent entry points: one agent per process (`run_agent`), or a fleet of agents sharing one
NATS connection (`run_fleet`; fake clusters for demos and load tests).

`muster agent --config agent.yaml [--nats nats://127.0.0.1:4222]` (or `python -m agents.main`)
runs either: a file with `clusters:` is a fleet, a file with `cluster:` a single agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import nats
import structlog
from nats.aio.client import Client

from agents.backend import Backend
from agents.config import AgentConfig
from agents.fake.cluster import AttemptRecord, FakeCluster
from agents.local.backend import LocalBackend
from agents.metrics import AgentMetrics
from agents.runtime import AgentRuntime
from schemas import healthz
from schemas.natsopts import NatsOptions
from schemas.subjects import Subjects
from shell.gcpacing import paced_gc
from shell.natsstate import NatsStateLog
from shell.tasks import cancel_and_wait


def build_backend(config: AgentConfig) -> Backend:
    """The backend for one config; the kube backend is imported only when used."""
    if config.backend == "fake":
        return FakeCluster(config.cluster, config.fake)
    if config.backend == "local":
        return LocalBackend(config.cluster, config.local)
    from agents.kube.backend import KubeBackend  # lazy: kubernetes-asyncio is heavy

    levels = config.topology.levels if config.topology is not None else ()
    declared = {p.flavor: p.provision() for p in config.pools}
    backend: Backend = KubeBackend.from_config(config.cluster, config.kube or {}, levels, declared)
    return backend


def _runtime(backend: Backend, nc: Client, config: AgentConfig, subjects: Subjects) -> AgentRuntime:
    companion = None
    if config.frontdoor is not None:
        from agents.kube.backend import KubeBackend
        from agents.kube.frontdoor import FrontDoor

        assert isinstance(backend, KubeBackend)  # AgentConfig allows a front door on kube only
        companion = FrontDoor(config.cluster, lambda: backend.rest, config.frontdoor, subjects)
    return AgentRuntime(
        backend,
        nc,
        subjects=subjects,
        heartbeat_s=config.heartbeat_s,
        batch_max=config.batch_max,
        batch_interval_s=config.batch_interval_s,
        companion=companion,
        pools={p.flavor: p.provision() for p in config.pools},
    )


@dataclass
class Fleet:
    """Handles on agents running in this process: `fleet.clusters[name]` is the FakeCluster
    (injection API, history), `fleet.runtimes[name]` its AgentRuntime."""

    nc: Client
    runtimes: dict[str, AgentRuntime] = field(default_factory=dict)
    clusters: dict[str, FakeCluster] = field(default_factory=dict)
    local: dict[str, LocalBackend] = field(default_factory=dict)  # process-running clusters

    def __getitem__(self, cluster: str) -> FakeCluster:
        return self.clusters[cluster]

    def history(self, job_id: str) -> list[AttemptRecord]:
        """Every attempt of a job on any cluster of the fleet, by attempt number."""
        out = [r for c in self.clusters.values() for r in c.history.get(job_id, [])]
        return sorted(out, key=lambda r: r.attempt)

    def live_copies(self, job_id: str) -> list[tuple[str, int]]:
        """(cluster, attempt) of every live workload of the job; more than one is a bug."""
        return [
            (name, attempt)
            for name, c in self.clusters.items()
            for (jid, attempt) in c.live_workloads()
            if jid == job_id
        ]

    async def on_reconnected(self) -> None:
        for rt in self.runtimes.values():
            await rt.on_reconnected()

    async def stop(self) -> None:
        await asyncio.gather(*(rt.stop() for rt in self.runtimes.values()))


async def start_fleet(
    nc: Client, configs: Sequence[AgentConfig], subjects: Subjects | None = None
) -> Fleet:
    """Start one runtime per config on a shared connection (any backend)."""
    fleet = Fleet(nc=nc)
    try:
        for cfg in configs:
            subj = subjects or Subjects(prefix=cfg.subject_prefix)
            backend = build_backend(cfg)
            rt = _runtime(backend, nc, cfg, subj)
            if isinstance(backend, FakeCluster):
                fleet.clusters[cfg.cluster] = backend
                backend.on_outage = rt.set_partitioned
            elif isinstance(backend, LocalBackend):
                fleet.local[cfg.cluster] = backend
            fleet.runtimes[cfg.cluster] = rt
            if isinstance(backend, FakeCluster):
                await rt.start()
            else:
                await _start_with_backoff(rt, cfg.cluster)
    except BaseException:
        await fleet.stop()
        raise
    return fleet


START_BACKOFF_S = (1.0, 30.0)  # first and longest wait between start attempts


class _Quiet:
    """A logger that drops info and debug lines and passes the rest on."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name in ("info", "debug"):
            return lambda *args, **kwargs: None
        return getattr(self._inner, name)


async def _start_with_backoff(rt: AgentRuntime, cluster: str) -> None:
    """Start an agent whose backend talks to a remote API (Kubernetes): while the API server
    cannot be reached, say so once and retry with exponential backoff. A config error
    (ValueError) is final."""
    log = structlog.get_logger("muster.agent").bind(cluster=cluster)
    wait, longest = START_BACKOFF_S
    failing = False
    base_log = rt.log
    while True:
        try:
            await rt.start()
        except ValueError:
            raise
        except Exception as exc:
            rt.log = _Quiet(base_log)  # an agent that never started does not "stop"
            with contextlib.suppress(Exception):
                await rt.stop()  # so the next attempt starts from scratch
            rt.log = base_log
            if not failing:
                log.warning(
                    "cannot reach the Kubernetes API server; retrying with backoff",
                    error=str(exc) or type(exc).__name__,
                    hint="check kube.kubeconfig / kube.context (or in_cluster) and that the "
                    "API server answers from here",
                )
                failing = True
            else:
                log.debug("Kubernetes API server still unreachable", error=str(exc), retry_s=wait)
            await asyncio.sleep(wait)
            wait = min(longest, wait * 2)
            continue
        if failing:
            log.info("Kubernetes API server reachable; agent started")
        return


async def start_fake_fleet(
    nc: Client, configs: Sequence[AgentConfig], subjects: Subjects | None = None
) -> Fleet:
    """Fake clusters driven in-process by tests, the demo and load tests."""
    bad = [c.cluster for c in configs if c.backend != "fake"]
    if bad:
        raise ValueError(f"start_fake_fleet takes fake clusters only; not fake: {bad}")
    return await start_fleet(nc, configs, subjects)


async def _connect(opts: NatsOptions, on_reconnect: Callable[[], Awaitable[None]]) -> Client:
    state = NatsStateLog(
        structlog.get_logger("muster.agent"),
        opts.url,
        "is the broker's NATS there? `muster broker` prints its URL; pass it with --nats",
    )

    async def reconnected() -> None:
        await state.on_reconnected()
        await on_reconnect()

    callbacks = state.callbacks() | {"reconnected_cb": reconnected}
    nc = await nats.connect(**opts.connect_kwargs(), **callbacks)
    state.connected(nc)
    return nc


async def run_fleet(
    configs: list[AgentConfig],
    nats: NatsOptions,
    metrics_port: int | None = None,
    metrics_addr: str = "127.0.0.1",
    *,
    pace_gc: bool = False,
) -> None:
    """Run many agents over one NATS connection until cancelled. Metrics are served on
    `metrics_port`, else on the first `metrics_port` of the configs, else not at all.
    `pace_gc`: manage the process's cycle collector (`shell.gcpacing`); the `muster agent`
    process turns it on, so a kube agent's cache of a big cluster is not walked by every full
    collection; in-process agents (tests) leave the host's collector alone."""
    holder: dict[str, Fleet] = {}
    port = metrics_port or next((c.metrics_port for c in configs if c.metrics_port), None)
    metrics = AgentMetrics(lambda: holder["fleet"].runtimes if "fleet" in holder else {})

    async def reconnected() -> None:
        if "fleet" in holder:
            await holder["fleet"].on_reconnected()

    nc = await _connect(nats, reconnected)
    health_port = healthz.port_from_env()
    health = await healthz.serve(health_port, lambda: nc.is_connected) if health_port else None
    pacing = asyncio.create_task(paced_gc()) if pace_gc else None
    try:
        if port:
            metrics.serve(port, metrics_addr)
        holder["fleet"] = await start_fleet(nc, configs)
        await asyncio.Event().wait()
    finally:
        metrics.close()
        if health is not None:
            health.close()
        if "fleet" in holder:
            with contextlib.suppress(Exception):
                await holder["fleet"].stop()
        with contextlib.suppress(Exception):
            await nc.drain()
        await cancel_and_wait(pacing)


async def run_agent(config: AgentConfig, nats: NatsOptions) -> None:
    """Run one agent until cancelled."""
    await run_fleet([config], nats)


async def until_signal(coro: Coroutine[Any, Any, None]) -> None:
    """SIGTERM/SIGINT cancel the agents so they stop cleanly (Kubernetes sends SIGTERM)."""
    task = asyncio.create_task(coro)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await task
