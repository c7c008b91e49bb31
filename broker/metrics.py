"""Prometheus metrics for the broker (`muster broker --metrics-port 9464`).

Read at scrape time from the broker's own counters and the machine, so the hot paths pay
nothing and there is one source of truth. Scrapes run on the exporter's thread: reading the
machine's dicts while the event loop changes them can fail, and such a scrape is skipped.
"""

from __future__ import annotations

import asyncio
from collections import Counter as Tally
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, get_args

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from broker.core.machine import Machine
from schemas.api import JobState

STATES: tuple[JobState, ...] = get_args(JobState)  # in the order the wire lists them
HEALTH = ("healthy", "unreachable", "lost")


class _LeaseState(Protocol):
    @property
    def epoch(self) -> int: ...
    @property
    def renew_failures(self) -> int: ...


class BrokerState(Protocol):
    """What the metrics read of a broker (broker/service.py Broker); stated here so this
    module does not import the service that imports it."""

    @property
    def stats(self) -> Mapping[str, int]: ...
    @property
    def refused(self) -> Mapping[str, int]: ...
    @property
    def lease(self) -> _LeaseState: ...
    @property
    def storage_full(self) -> bool: ...
    @property
    def leading(self) -> asyncio.Event: ...
    @property
    def machine(self) -> Machine | None: ...
    def agent_drops(self) -> Mapping[tuple[str, str], int]: ...


class BrokerCollector:
    def __init__(self, broker: BrokerState) -> None:
        self.broker = broker

    def collect(self) -> Iterator[Metric]:
        b = self.broker
        stats: dict[str, Any] = dict(b.stats)
        sub = CounterMetricFamily("muster_submissions", "Submissions", labels=["outcome"])
        sub.add_metric(["accepted"], stats.get("submitted", 0))
        sub.add_metric(["rejected"], stats.get("rejected", 0))
        yield sub
        disp = CounterMetricFamily("muster_dispatches", "Dispatch requests", labels=["outcome"])
        disp.add_metric(["acked"], stats.get("dispatch_acked", 0))
        disp.add_metric(["failed"], stats.get("dispatch_failed", 0))
        yield disp
        requests = CounterMetricFamily(
            "muster_dispatch_requests",
            "Dispatch requests sent to agents: one Dispatch each (single), or several in one "
            "dispatch_batch to an agent of wire 1.3 or newer (batch)",
            labels=["kind"],
        )
        batches = stats.get("dispatch_batches", 0)
        requests.add_metric(["single"], stats.get("dispatch_requests", 0) - batches)
        requests.add_metric(["batch"], batches)
        yield requests
        resent = CounterMetricFamily(
            "muster_command_resends",
            "Commands sent again to an agent whose ack took longer than the wait (resent), "
            "acks that answered an earlier copy (late_ack), and waits started again without "
            "a copy because the agent was heard from meanwhile (busy)",
            labels=["kind"],
        )
        resent.add_metric(["resent"], stats.get("ack_retries", 0))
        resent.add_metric(["late_ack"], stats.get("late_acks", 0))
        resent.add_metric(["busy"], stats.get("ack_waits_again", 0))
        yield resent
        yield CounterMetricFamily(
            "muster_agent_events", "Agent events received", value=stats.get("events", 0)
        )
        yield CounterMetricFamily(
            "muster_bad_batches",
            "Agent batches rejected (malformed, foreign cluster, or failed)",
            value=stats.get("bad_batches", 0),
        )
        refused = CounterMetricFamily(
            "muster_refused_messages",
            "Messages a handler refused (bad input or a failure processing it)",
            labels=["handler"],
        )
        for handler, count in sorted(dict(b.refused).items()):
            refused.add_metric([handler], count)
        yield refused
        for name, key, text in (
            (
                "muster_dead_lettered",
                "dead_lettered",
                "Submissions moved to the dead-letter subject",
            ),
            (
                "muster_submissions_put_back",
                "put_back_for_storage",
                "Redeliveries put back uncounted: the job bucket did not take their attempt marker",
            ),
            ("muster_rate_limited", "rate_limited", "Submissions refused by a submitter's rate"),
            (
                "muster_storage_full_rejections",
                "storage_full_rejections",
                "Submissions refused because the store is full",
            ),
            (
                "muster_store_quota_rejections",
                "store_quota_rejections",
                "Submissions refused by their team's share of the job bucket",
            ),
            (
                "muster_stale_epoch_ignored",
                "stale_epoch_ignored",
                "Stale-epoch answers the lease did not confirm",
            ),
            (
                "muster_redispatched",
                "redispatched",
                "Unacknowledged dispatches re-sent on takeover",
            ),
            (
                "muster_store_records_lost",
                "store_records_lost",
                "Times the job bucket had lost records the leader held (written back)",
            ),
        ):
            yield CounterMetricFamily(name, text, value=stats.get(key, 0))
        yield CounterMetricFamily(
            "muster_lease_renew_failures",
            "Lease renewals that failed and were retried",
            value=b.lease.renew_failures,
        )
        yield GaugeMetricFamily(
            "muster_storage_full", "1 while the store refuses writes", value=int(b.storage_full)
        )
        yield GaugeMetricFamily(
            "muster_leader", "1 while this broker leads", value=1 if b.leading.is_set() else 0
        )
        yield GaugeMetricFamily("muster_epoch", "Leader epoch held", value=b.lease.epoch)
        yield GaugeMetricFamily(
            "muster_newer_job_records",
            "Job records of a newer format than this broker's: it does not lead while any",
            value=stats.get("newer_records", 0),
        )
        drops = CounterMetricFamily(
            "muster_agent_batches_dropped",
            "Agent batches not applied: coalesced (a newer snapshot replaced them) or "
            "over-budget (the cluster's mailbox was full)",
            labels=["cluster", "reason"],
        )
        try:
            for (cluster, reason), n in sorted(b.agent_drops().items()):
                drops.add_metric([cluster, reason], n)
        except RuntimeError:  # changed under us; the next scrape will see it
            pass
        yield drops
        machine = b.machine
        if machine is None:
            return
        try:
            states: Tally[str] = Tally(record.state for record in list(machine.jobs.values()))
            health: Tally[str] = Tally(track.health for track in list(machine.agents.values()))
        except RuntimeError:  # changed under us; the next scrape will see it
            return
        jobs = GaugeMetricFamily("muster_jobs", "Jobs by state", labels=["state"])
        for state in STATES:
            jobs.add_metric([state], states.get(state, 0))
        yield jobs
        clusters = GaugeMetricFamily("muster_clusters", "Clusters by health", labels=["health"])
        for h in HEALTH:
            clusters.add_metric([h], health.get(h, 0))
        yield clusters
        breakers = machine.lifecycle.health
        try:
            tripped = breakers.open_pools()
        except RuntimeError:
            return
        gauge = GaugeMetricFamily(
            "muster_dispatch_breaker_open",
            "1 per cluster x flavor whose dispatch breaker takes no placements (open or probing)",
            labels=["cluster", "flavor"],
        )
        for cluster, flavor in tripped:
            gauge.add_metric([cluster, flavor], 1)
        yield gauge
        yield CounterMetricFamily(
            "muster_dispatch_breaker_trips",
            "Times a pool's dispatch breaker opened",
            value=breakers.trips(),
        )
        try:
            asks, stockouts, coming = machine.scheduler.provision_counts()
        except RuntimeError:
            return
        yield CounterMetricFamily(
            "muster_pool_provisions", "Autoscaled pools asked to grow for a gang", value=asks
        )
        yield CounterMetricFamily(
            "muster_pool_stockouts",
            "Asks to grow a pool whose nodes did not all come within its window",
            value=stockouts,
        )
        nodes = GaugeMetricFamily(
            "muster_pool_nodes_coming",
            "Nodes asked of an autoscaled pool that have not come yet",
            labels=["cluster", "flavor"],
        )
        for (cluster, flavor), n in sorted(coming.items()):
            nodes.add_metric([cluster, flavor], n)
        yield nodes


class Metrics:
    def __init__(self, broker: BrokerState) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(BrokerCollector(broker))

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
