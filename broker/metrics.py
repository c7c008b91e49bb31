"""Prometheus metrics for the broker (`muster broker --metrics-port 9464`).

One registry per broker so tests and several in-process brokers do not collide.
"""

from __future__ import annotations

from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from broker.core.machine import Machine

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
STATES = ("queued", "admitted", "running", "preempting", "succeeded", "failed", "cancelled")


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.submissions = Counter(
            "muster_submissions_total", "Submissions by outcome", ["outcome"], registry=r
        )
        self.dispatches = Counter(
            "muster_dispatches_total", "Dispatch requests by outcome", ["outcome"], registry=r
        )
        self.dispatch_ack = Histogram(
            "muster_dispatch_ack_seconds",
            "From sending a Dispatch to the agent's ack",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.cycle = Histogram(
            "muster_schedule_cycle_seconds",
            "Time spent in one admission cycle",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.agent_events = Counter("muster_agent_events_total", "Agent events applied", registry=r)
        self.bad_messages = Counter(
            "muster_bad_messages_total", "Rejected messages by source", ["source"], registry=r
        )
        self.job_events = Counter(
            "muster_job_events_total", "Lifecycle events published", ["kind"], registry=r
        )
        self.jobs = Gauge("muster_jobs", "Jobs by state", ["state"], registry=r)
        self.clusters = Gauge("muster_clusters", "Clusters by health", ["health"], registry=r)
        self.leader = Gauge("muster_leader", "1 while this broker leads", registry=r)
        self.epoch = Gauge("muster_epoch", "The leader epoch this broker holds", registry=r)

    def observe_machine(self, machine: Machine | None) -> None:
        """Refresh the gauges that are cheaper to recount than to track (every few seconds)."""
        if machine is None:
            self.leader.set(0)
            return
        self.leader.set(1)
        self.epoch.set(machine.epoch)
        states = Tally(record.state for record in machine.jobs.values())
        for state in STATES:
            self.jobs.labels(state).set(states.get(state, 0))
        health = Tally(track.health for track in machine.agents.values())
        for h in ("healthy", "unreachable", "lost"):
            self.clusters.labels(h).set(health.get(h, 0))

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
