"""Prometheus metrics for agents (`muster-agent --metrics-port 9465`, or `metrics_port` in an
agent config): the runtime's counters and outbox, and what a backend counts (the kube
backend's bad input from the API server, how long its watches have been stale).

Read at scrape time from the runtimes' own counters, so the agent's hot paths pay nothing.
Scrapes run on the exporter's thread: a dict changed under it by the event loop fails that
one scrape, which is skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from agents.runtime import AgentRuntime

# The runtime's counters, always exported (0 until they happen) so dashboards see the series.
RUNTIME_COUNTERS = (
    "batches",
    "events",
    "snapshots",
    "commands",
    "refused",
    "errors",
    "fenced",
    "outbox_dropped",
    "cancels_joined",
    "late_dispatches",
)


class AgentCollector:
    def __init__(self, runtimes: Callable[[], Mapping[str, AgentRuntime]]) -> None:
        self.runtimes = runtimes

    def collect(self) -> Iterator[Metric]:
        try:
            yield from self._collect()
        except RuntimeError:  # a dict changed during the scrape: skip this one
            return

    def _collect(self) -> Iterator[Metric]:
        runtimes = sorted(dict(self.runtimes()).items())
        counters = CounterMetricFamily(
            "muster_agent_runtime",
            "Agent runtime counters: event batches and events sent, snapshots, commands "
            "received, refused and failed, attempts fenced, events dropped from a full outbox, "
            "resent Cancels answered by the copy under way, Dispatches read after the fence "
            "lapsed",
            labels=["cluster", "counter"],
        )
        queued = GaugeMetricFamily(
            "muster_agent_queued_events",
            "Events waiting to be published to the broker",
            labels=["cluster"],
        )
        outbox = GaugeMetricFamily(
            "muster_agent_outbox_events",
            "Attempt endings and checkpoints published but not yet confirmed by the broker",
            labels=["cluster"],
        )
        bad = CounterMetricFamily(
            "muster_agent_bad_input",
            "Objects from the Kubernetes API server ignored as malformed or unexpected",
            labels=["cluster", "kind", "reason"],
        )
        stale = GaugeMetricFamily(
            "muster_agent_stale_seconds",
            "How long the agent's Kubernetes watches have been failing past the threshold "
            "(0 = fresh)",
            labels=["cluster"],
        )
        reports = CounterMetricFamily(
            "muster_agent_checkpoint_reports",
            "Checkpoint reports pods posted to the kube agent's endpoint, by the HTTP status "
            "answered (200 taken, 4xx refused: 401 no token, 403 wrong token, 404 attempt not "
            "here, 409 attempt ended, 400/408/413 bad request)",
            labels=["cluster", "status"],
        )
        for name, rt in runtimes:
            stats = dict(rt.stats)
            for key in RUNTIME_COUNTERS:
                counters.add_metric([name, key], stats.get(key, 0))
            queued.add_metric([name], rt.queue_size)
            outbox.add_metric([name], rt.outbox_size())
            backend: Any = rt.backend
            tally = getattr(getattr(backend, "bad_input", None), "counts", None)
            if tally is not None:
                for (kind, reason), n in sorted(dict(tally).items()):
                    bad.add_metric([name, kind, reason], n)
            answers = getattr(getattr(backend, "report_server", None), "counts", None)
            if answers is not None:
                for status, n in sorted(dict(answers).items()):
                    reports.add_metric([name, str(status)], n)
            stale_s = getattr(backend, "stale_s", None)
            if callable(stale_s):
                stale.add_metric([name], float(stale_s()))
        yield counters
        yield queued
        yield outbox
        yield bad
        yield reports
        yield stale


class AgentMetrics:
    """A registry of its own (no process collectors: several agents may share a process)."""

    def __init__(self, runtimes: Callable[[], Mapping[str, AgentRuntime]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(AgentCollector(runtimes))
        self._server: Any = None

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics on addr:port (0 = a free port); returns the port bound."""
        served = start_http_server(port, addr=addr, registry=self.registry)
        self._server = served[0] if isinstance(served, tuple) else None
        return int(self._server.server_port) if self._server is not None else port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
