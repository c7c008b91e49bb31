"""Deterministic simulation of the broker core and the agent protocol (in the manner of
FoundationDB's simulation testing and TigerBeetle's VOPR).

One process, one seeded random generator, one virtual clock. The pure lifecycle machine runs
behind the broker shell's own effect rules (`broker/sequencer.py`: persist before send, the
Cancel-before-Dispatch barrier, retries with the ack wait learnt per cluster, Cancels resent
until heard), driven here from the virtual clock over a modelled network; a restart is a new
epoch restored from the persisted records. Model agents speak the agent protocol: act
idempotently on (job_id, attempt), refuse older epochs, resend a snapshot after a resync or
reconnect (carrying terminal outcomes the broker may have missed), fence their workloads when
cut off, and report terminal outcomes.
The network between them loses, duplicates, delays and reorders messages;
faults (broker crashes between any two effects, agent restarts and freezes, partitions, spot
notices) strike at seeded random points. The invariants of `broker.core.invariants` are
checked after every step, the cross-process ones (never two copies of a job made, never two
live copies) from the agents' own records, and the eventual ones at the end: every accepted
job terminal, none completed twice, usage back to zero.

    python -m load.vopr --seeds 2000          # many seeds; failures print a replay command
    python -m load.vopr --seed 1234 --verbose # replay one seed exactly
    python -m load.vopr --retention-s 10      # ended jobs forgotten 10 s after they end

With a retention, the model deletes a record when the core forgets its job, as the shell does,
and checks it marked no Cancel unacknowledged (`invariants.unsettled_forgets`): a restored
leader would no longer send that Cancel again.
"""

from __future__ import annotations

import functools
import heapq
import random
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import typer

from agents.gate import CommandGate, Duplicate, Refuse, Resize
from agents.runtime import AgentRuntime
from broker.core.effects import (
    Effect,
    Forget,
    Persist,
    Publish,
    Send,
    applied,
    refusal,
    split_reply,
)
from broker.core.inputs import (
    CYCLE,
    TICK,
    AgentBatch,
    CancelSettled,
    DispatchAcked,
    Restore,
    SubmitJob,
)
from broker.core.invariants import unordered_dispatches, unsettled_forgets, violations
from broker.core.machine import TERMINAL, Machine
from broker.core.records import JobRecord, record_decoder, record_encoder
from broker.sequencer import RecordWrites, Sequencer, acknowledges, persist_first
from load.command import program, summary
from schemas.agent import (
    AgentEvent,
    Applied,
    Cancel,
    CheckpointNow,
    CheckpointReport,
    ClusterSnapshot,
    CommandAck,
    Dispatch,
    EventBatch,
    FlavorInfo,
    Heartbeat,
    NodeGone,
    NodeInfo,
    NodeUpsert,
    Resync,
    SpotNotice,
    WorkloadStatus,
)
from schemas.config import (
    BrokerConfig,
    FlavorClass,
    FlavorQuota,
    QueueConfig,
    ResourceQuota,
    SchedulingConfig,
    Timeouts,
)
from schemas.job import CheckpointSpec, JobSpec, PodSet

GiB = 1 << 30
START_AT = 1_000_000.0
AGENT_TICK_S = 1.0
BROKER_TICK_S = 1.0
STARTUP_S = 1.0  # dispatch -> every replica running, on a model agent
HEALTHY_SLACK_S = 10.0  # message delays between the broker hearing a batch and its Applied


class SimFailure(AssertionError):
    """An invariant broke; the message names the seed, the step and the replay command."""


@dataclass(frozen=True, slots=True)
class Faults:
    drop: float = 0.03  # a message is lost
    dup: float = 0.03  # a message is delivered twice
    max_delay_s: float = 1.5  # uniform extra latency; reorders messages
    broker_crash: float = 0.004  # per record written or effect executed: dies right after it
    broker_down_s: float = 8.0  # at most this long before the new leader restores
    agent_restart: float = 0.002  # per agent tick: the agent process restarts
    agent_freeze: float = 0.001  # per agent tick: SIGSTOP for a while
    partition: float = 0.001  # per agent tick: cut off from NATS for a while
    spot: float = 0.002  # per agent tick: a spot notice on a busy spot node
    # per agent tick: an outage of minutes, of the cluster's API server (the fence cannot be
    # renewed; the agent is still heard), the agent (frozen), its NATS link or the broker
    long_outage: float = 0.0
    long_outage_max_s: float = 1800.0  # agent and NATS: past lost_after_s, sometimes
    api_outage_max_s: float = 600.0  # API server and broker: a control-plane upgrade, a failover


QUIET = Faults(0, 0, 0.01, 0, 0, 0, 0, 0, 0)
# Minutes-long outages among the usual faults, with the shipped windows (`long_config`).
LONG = Faults(long_outage=0.0005)
LONG_KINDS = ("api", "agent", "nats", "broker")


def sim_config(min_runtime_s: float | None = None) -> BrokerConfig:
    """Two team queues sharing a cohort (lend, borrow, reclaim) and one queue of its own."""
    q = ResourceQuota
    sched = SchedulingConfig()
    if min_runtime_s is not None and "reclaim_min_runtime_s" in SchedulingConfig.__struct_fields__:
        sched = msgspec.structs.replace(sched, reclaim_min_runtime_s=min_runtime_s)
    return BrokerConfig(
        flavors=[
            FlavorClass(name="gpu-spot", capacity_type="spot"),
            FlavorClass(name="gpu-od", capacity_type="on-demand"),
        ],
        queues=[
            QueueConfig(
                name="team-a",
                cohort="ml",
                quotas=[
                    FlavorQuota(flavor="gpu-spot", resources={"gpu": q(nominal=8)}),
                    FlavorQuota(
                        flavor="gpu-od", resources={"gpu": q(nominal=4, borrowing_limit=4)}
                    ),
                ],
            ),
            QueueConfig(
                name="team-b",
                cohort="ml",
                quotas=[
                    FlavorQuota(flavor="gpu-spot", resources={"gpu": q(nominal=8)}),
                    FlavorQuota(flavor="gpu-od", resources={"gpu": q(nominal=4)}),
                ],
            ),
            QueueConfig(name="solo"),
        ],
        timeouts=Timeouts(
            heartbeat_s=1.0,
            unreachable_after_s=5.0,
            lost_after_s=30.0,
            dispatch_ack_s=2.0,
            dispatch_retries=2,
            start_s=60.0,
            checkpoint_grace_s=10.0,
            fence_lead_s=10.0,
        ),
        scheduling=sched,
    )


def retaining(config: BrokerConfig, retention_s: float) -> BrokerConfig:
    """`config` whose ended jobs are forgotten `retention_s` after they end (0: never)."""
    limits = msgspec.structs.replace(config.limits, ended_retention_s=retention_s)
    return msgspec.structs.replace(config, limits=limits)


def long_config() -> BrokerConfig:
    """The simulation's config with the shipped fence windows (schemas.config.Timeouts):
    re-dispatch after 18 minutes of silence, a 15-minute fence."""
    base = sim_config()
    shipped = Timeouts()
    timeouts = msgspec.structs.replace(
        base.timeouts, lost_after_s=shipped.lost_after_s, fence_lead_s=shipped.fence_lead_s
    )
    return msgspec.structs.replace(base, timeouts=timeouts)


# ---------------------------------------------------------------------------- the network


@dataclass(order=True, slots=True)
class _Due:
    at: float
    seq: int
    fn: Callable[[], None] = field(compare=False)


class Clock:
    """Virtual time and the event queue; every choice comes from one seeded generator."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.now = START_AT
        self._q: list[_Due] = []
        self._seq = 0

    def at(self, delay: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._q, _Due(self.now + max(0.0, delay), self._seq, fn))

    def step(self) -> bool:
        if not self._q:
            return False
        due = heapq.heappop(self._q)
        self.now = max(self.now, due.at)
        due.fn()
        return True


class Net:
    """NATS core messaging between processes: at most once, delayed, order kept per channel
    (one publisher to one subscriber, as NATS does), so messages of different channels
    reorder against each other; a retried request arrives twice."""

    def __init__(self, clock: Clock, faults: Faults) -> None:
        self.clock = clock
        self.faults = faults
        self.sent = 0
        self.dropped = 0
        self._tail: dict[str, float] = {}

    def send(self, channel: str, fn: Callable[[], None]) -> None:
        rng = self.clock.rng
        f = self.faults
        self.sent += 1
        if rng.random() < f.drop:
            self.dropped += 1
            return
        copies = 2 if rng.random() < f.dup else 1
        for _ in range(copies):
            at = max(
                self._tail.get(channel, 0.0), self.clock.now + 0.001 + rng.random() * f.max_delay_s
            )
            self._tail[channel] = at
            self.clock.at(at - self.clock.now, fn)


# ---------------------------------------------------------------------------- agents


@dataclass(slots=True)
class Work:
    job_id: str
    attempt: int
    nodes: list[str]
    replicas: int
    remaining: float  # seconds of work left
    ckpt_every: float | None
    started: float
    running: bool = False
    step: int = 0
    since_ckpt: float = 0.0
    fence_until: float = float("inf")  # the cluster stops it then, agent alive or not


class SimAgent:
    """One cluster's agent and the workloads it runs (the agent protocol, modelled)."""

    def __init__(
        self, world: World, cluster: str, flavors: list[FlavorInfo], nodes: list[NodeInfo]
    ):
        self.w = world
        self.cluster = cluster
        self.flavors = flavors
        self.nodes = {n.name: n for n in nodes}
        self.instance = ""
        self.seq = 0
        self.gate = CommandGate()
        self.work: dict[tuple[str, int], Work] = {}
        self.queue: list[AgentEvent] = []
        # Terminal outcomes ride in every snapshot. The agent keeps them until the broker has
        # persisted them (agents/runtime.py, its outbox), not for a fixed time; the model keeps
        # them for the run, as its Applied also answers batches the broker did not apply.
        self.outcomes: dict[tuple[str, int], tuple[float, WorkloadStatus]] = {}
        self.snapshot_pending = True
        self.last_contact = START_AT
        self.cut_until = 0.0  # partitioned from NATS until
        self.frozen_until = 0.0  # SIGSTOPped until
        self.api_down_until = 0.0  # the cluster's API server refuses every request until
        self.fence_after: dict[tuple[str, int], float] = {}
        self.sent_at: dict[int, float] = {}  # batch seq -> when it left (Applied extends fences)
        self.restart()

    # -- process life ----------------------------------------------------------------
    def restart(self) -> None:
        """A new process: new instance, fresh sequence, same workloads (they outlive it)."""
        self.w.incarnations += 1
        self.instance = f"{self.cluster}-{self.w.incarnations}"
        self.seq = 0
        self.queue = []
        self.snapshot_pending = True
        self.gate.forget(self.w.clock.now)
        for job_id, attempt in self.work:
            self.gate.adopt(job_id, attempt, live=True, fence_after=None)
        # The cluster still shows the workloads that finished (a kube Job until its
        # ttlSecondsAfterFinished, the fake backend's for good): the snapshot's terminal
        # entries, which the runtime adopts as attempts already made here.
        for job_id, attempt in self.outcomes:
            self.gate.adopt(job_id, attempt, live=False, fence_after=None)

    def linked(self) -> bool:
        return self.w.clock.now >= self.cut_until

    def alive(self) -> bool:
        return self.w.clock.now >= self.frozen_until

    def emit(self, ev: AgentEvent) -> None:
        if isinstance(ev, WorkloadStatus):
            self.w.log("agent", self.cluster, ev.job_id, ev.attempt, ev.phase)
        self.queue.append(ev)

    # -- commands ----------------------------------------------------------------------
    def on_command(
        self, cmd: Dispatch | Cancel | CheckpointNow | Resync, reply: Callable[[CommandAck], None]
    ) -> None:
        if not self.linked():
            return
        if not self.alive():
            # A stopped process reads nothing; the message waits in its socket, and is lost
            # with it if the process is restarted meanwhile.
            instance = self.instance

            def later() -> None:
                if self.instance == instance:
                    self.on_command(cmd, reply)

            self.w.clock.at(self.frozen_until - self.w.clock.now + 0.01, later)
            return
        self.last_contact = self.w.clock.now
        stale = self.gate.epoch_refusal(cmd.epoch)
        if stale is not None:
            reply(stale)
            return
        if isinstance(cmd, Applied):
            self._on_applied(cmd)
            reply(CommandAck(ok=True))
            return
        if isinstance(cmd, Resync):
            self.snapshot_pending = True
            reply(CommandAck(ok=True))
            return
        if isinstance(cmd, Cancel):
            for a in self.gate.cancel_targets(cmd.job_id, cmd.attempt):
                self._end(cmd.job_id, a, None)
            self.gate.cancelled(cmd.job_id, cmd.attempt)
            # As the agent's runtime, which keeps an ending until the broker acknowledges it
            # (the model keeps them all: the broker takes a known one as a repeat).
            kept = self.outcomes.get((cmd.job_id, cmd.attempt)) if cmd.attempt is not None else None
            reply(CommandAck(ok=True, ended=kept[1] if kept is not None else None))
            return
        if isinstance(cmd, CheckpointNow):
            wk = self.work.get((cmd.job_id, cmd.attempt))
            if wk is not None and wk.running and wk.ckpt_every is not None:
                self._checkpoint(wk)
            reply(CommandAck(ok=True))
            return
        # Dispatch, through the agent's own gate.
        verdict = self.gate.judge(cmd, self.w.clock.now)
        if isinstance(verdict, Refuse):
            if verdict.fence_lapsed:
                self.w.stats["late-dispatches"] += 1
            reply(verdict.ack)
            return
        if isinstance(verdict, Resize | Duplicate):
            if isinstance(verdict, Resize):
                self.gate.resized(cmd)  # these simulated workloads cannot resize in place
            reply(CommandAck(ok=True))
            return
        for old in verdict.supersede:
            self._end(cmd.job_id, old, None)
            self.gate.ended(cmd.job_id, old)
        nodes = [n for a in cmd.assignment for n in a.nodes]
        spec = cmd.spec
        done = self.w.work_of[cmd.job_id]
        if cmd.resume_from is not None:
            done = max(0.0, done - cmd.resume_from.step * AGENT_TICK_S)
        # A copy counts from when it is made, not only once it runs: a second one made while
        # the first still exists is one the fences and Cancels failed to keep apart.
        self.w.made_copies[cmd.job_id] += 1
        if self.w.made_copies[cmd.job_id] > 1:
            self.w.breach(
                "two-copies-made",
                f"two copies of {cmd.job_id} made (attempt {cmd.attempt} on {self.cluster})",
            )
        self.work[(cmd.job_id, cmd.attempt)] = Work(
            job_id=cmd.job_id,
            attempt=cmd.attempt,
            nodes=nodes,
            replicas=len(nodes),
            remaining=done,
            ckpt_every=5.0 if spec.checkpoint is not None else None,
            started=self.w.clock.now,
            step=cmd.resume_from.step if cmd.resume_from is not None else 0,
        )
        self.fence_after[(cmd.job_id, cmd.attempt)] = cmd.fence_after_s
        if cmd.fence_after_s > 0:
            base = self.gate.fence_base(self.w.clock.now)
            self.work[(cmd.job_id, cmd.attempt)].fence_until = base + cmd.fence_after_s
        self.gate.ran(cmd)
        self.emit(
            WorkloadStatus(
                job_id=cmd.job_id, attempt=cmd.attempt, phase="created", total_replicas=len(nodes)
            )
        )
        reply(CommandAck(ok=True))

    # -- workloads ---------------------------------------------------------------------
    def _status(self, wk: Work, phase: str) -> WorkloadStatus:
        running = wk.replicas if phase == "running" else 0
        return WorkloadStatus(
            job_id=wk.job_id,
            attempt=wk.attempt,
            phase=phase,  # type: ignore[arg-type]
            running_replicas=running,
            total_replicas=wk.replicas,
            nodes=wk.nodes,
        )

    def _end(self, job_id: str, attempt: int, phase: str | None) -> None:
        """A workload stops: cancelled (phase None, nothing to report) or ended with a verdict."""
        wk = self.work.pop((job_id, attempt), None)
        if wk is None:
            return
        self.w.live_copies[job_id] -= 1 if wk.running else 0
        self.w.made_copies[job_id] -= 1
        if phase is None:
            return
        st = self._status(wk, phase)
        self.outcomes[(job_id, attempt)] = (self.w.clock.now, st)
        self.emit(st)

    def _checkpoint(self, wk: Work) -> None:
        wk.since_ckpt = 0.0
        self.emit(
            CheckpointReport(
                job_id=wk.job_id,
                attempt=wk.attempt,
                step=wk.step,
                uri=f"mem://{wk.job_id}/{wk.step}",
            )
        )

    def tick(self) -> None:
        w = self.w
        now = w.clock.now
        self._progress(now)  # the cluster's workloads run whether the agent runs or not
        self._enforce_fences(now)
        if self.alive():
            if self.linked():
                self.last_contact = now
            self._flush(now)
        self._faults(now)
        if not w.finished:
            w.clock.at(AGENT_TICK_S, self.tick)

    def _progress(self, now: float) -> None:
        for key, wk in list(self.work.items()):
            if not wk.running:
                if now - wk.started >= STARTUP_S:
                    wk.running = True
                    self.w.live_copies[wk.job_id] += 1
                    if self.w.live_copies[wk.job_id] > 1:
                        self.w.breach(
                            "two-live-copies",
                            f"two live copies of {wk.job_id} "
                            f"(attempt {wk.attempt} on {self.cluster})",
                        )
                    self.emit(self._status(wk, "running"))
                continue
            wk.remaining -= AGENT_TICK_S
            wk.step += 1
            wk.since_ckpt += AGENT_TICK_S
            if wk.remaining <= 0:
                self.w.completions[wk.job_id] += 1
                self.w.completed_by[wk.job_id].append((self.cluster, wk.attempt))
                self.w.succeeded_at[key] = now
                self._end(key[0], key[1], "succeeded")
                self.gate.ended(key[0], key[1])
            elif wk.ckpt_every is not None and wk.since_ckpt >= wk.ckpt_every:
                self._checkpoint(wk)

    def _on_applied(self, cmd: Applied) -> None:
        """The broker persisted our batches up to cmd.seq: extend fences from when it left."""
        if cmd.instance != self.instance:
            return
        sent = self.sent_at.get(cmd.seq)
        for s in [s for s in self.sent_at if s < cmd.seq]:
            del self.sent_at[s]
        if sent is not None:
            self.gate.heard(sent)
            # Heard, whether or not the fence can be renewed: an API-server outage longer
            # than the window ends healthy work (long-outage seed 9 with 20 s windows).
            self.w.heard_at.setdefault(self.cluster, deque(maxlen=64)).append(
                (self.w.clock.now, sent)
            )
        if sent is None or self.w.clock.now < self.api_down_until:
            return  # the fence lives in the cluster: no API server, no renewal
        for key, wk in self.work.items():
            after = self.fence_after.get(key, 0.0)
            if after > 0:
                wk.fence_until = max(
                    wk.fence_until if wk.fence_until != float("inf") else 0.0, sent + after
                )

    def _enforce_fences(self, now: float) -> None:
        for (job_id, attempt), wk in list(self.work.items()):
            if wk.fence_until <= now:
                self._healthy_fenced(job_id, attempt, now)
                self._end(job_id, attempt, "evicted")
                self.gate.ended(job_id, attempt)
                self.w.stats["fenced"] += 1

    def _healthy_fenced(self, job_id: str, attempt: int, now: float) -> None:
        """A fence must end only what the broker may have given up on: an attempt it still
        runs, on a cluster whose agent heard the broker acknowledge a batch sent within the
        fence window, was healthy. An Applied lost on the way proves nothing to the agent
        (seed 17102: both Applieds of the batches after a restore were lost, then the broker
        crashed before the next; the fence lapsed 20 s after the last one heard). Not one of
        an agent frozen when its fence lapses: it could not renew the fence, and the cluster
        cannot tell it from a dead agent (seed 450: the broker down 5 s and a resync kept
        the Applied away for 12 s, then the agent froze for 27 s just after sending the
        batch the broker applied; the fence lapsed 8 s into the freeze, as every attempt's
        there would have)."""
        if now < self.frozen_until:
            return
        w = self.w
        window = w.config.timeouts.fence_window_s
        # The newest batch whose Applied the agent heard.
        sent = max((s for _, s in w.heard_at.get(self.cluster, ())), default=None)
        record = w.machine.jobs.get(job_id)
        current = record.current if record is not None else None
        if (
            sent is None
            or current is None
            or (current.cluster, current.attempt) != (self.cluster, attempt)
            or now - sent >= window - HEALTHY_SLACK_S
        ):
            return
        w.breach(
            "healthy-fenced",
            f"attempt {attempt} of {job_id} on {self.cluster} ended by its fence though a "
            f"broker acknowledged the agent's batch sent {now - sent:.1f}s ago (window "
            f"{window:g}s)",
        )

    def snapshot(self) -> ClusterSnapshot:
        live = [
            self._status(wk, "running" if wk.running else "created") for wk in self.work.values()
        ]
        ended = [st for _, st in self.outcomes.values()]
        return ClusterSnapshot(
            flavors=self.flavors, nodes=list(self.nodes.values()), workloads=live + ended
        )

    def _flush(self, now: float) -> None:
        if not self.linked():
            return
        events, self.queue = self.queue, []
        if self.snapshot_pending:
            self.snapshot_pending = False
            events = AgentRuntime._around_snapshot(self.snapshot(), events)
        events.append(Heartbeat(at=now))
        self.seq += 1
        self.sent_at[self.seq] = now
        batch = EventBatch(
            cluster=self.cluster, instance=self.instance, seq=self.seq, events=events, sent_at=now
        )
        self.w.net.send(f"ev.{self.cluster}", lambda: self.w.broker_batch(self.cluster, batch))

    def _faults(self, now: float) -> None:
        w = self.w
        if not w.faulty(now):
            return
        f = w.faults
        rng = w.clock.rng
        if rng.random() < f.agent_restart:
            w.stats["agent_restarts"] += 1
            self.restart()
        if rng.random() < f.agent_freeze:
            w.stats["agent_freezes"] += 1
            self.frozen_until = now + rng.uniform(2.0, 45.0)
        if rng.random() < f.partition:
            w.stats["partitions"] += 1
            self.cut_until = now + rng.uniform(2.0, 60.0)
            self.snapshot_pending = True  # a reconnect resends a snapshot
        if rng.random() < f.long_outage:
            self._long_outage(now, rng.choice(LONG_KINDS))
        if rng.random() < f.spot:
            busy = sorted({n for wk in self.work.values() for n in wk.nodes})
            spot = [
                n
                for n in busy
                if self._flavor(n).capacity_type == "spot" and self.nodes[n].spot_deadline is None
            ]
            if spot:
                name = rng.choice(spot)
                deadline = now + 5.0
                self.nodes[name] = msgspec.structs.replace(self.nodes[name], spot_deadline=deadline)
                self.emit(SpotNotice(node=name, deadline=deadline))
                w.stats["spot_notices"] += 1
                w.clock.at(5.0, lambda: self._reclaim_node(name))

    def _long_outage(self, now: float, kind: str) -> None:
        """One outage of minutes at a time, each followed by a fence window of calm: the
        promise is about one outage shorter than the window, not a chain of them."""
        w, f = self.w, self.w.faults
        if now < w.calm_after or (kind == "broker" and not w.broker_up):
            return
        longest = f.long_outage_max_s if kind in ("agent", "nats") else f.api_outage_max_s
        down = w.clock.rng.uniform(60.0, longest)
        w.calm_after = now + down + w.config.timeouts.fence_window_s
        w.stats[f"long_{kind}_outages"] += 1
        if kind == "api":
            self.api_down_until = now + down
        elif kind == "agent":
            self.frozen_until = max(self.frozen_until, now + down)
        elif kind == "nats":
            self.cut_until = max(self.cut_until, now + down)
            self.snapshot_pending = True
        else:
            w.crash(down)

    def _flavor(self, node: str) -> FlavorInfo:
        fl = self.nodes[node].flavor
        return next(f for f in self.flavors if f.name == fl)

    def _reclaim_node(self, name: str) -> None:
        """The provider takes the node: its workloads are evicted; a fresh node replaces it."""
        for (job_id, attempt), wk in list(self.work.items()):
            if name in wk.nodes:
                self._end(job_id, attempt, "evicted")
                self.gate.ended(job_id, attempt)
        old = self.nodes.pop(name)
        self.emit(NodeGone(node=name, reason="spot reclaimed"))
        fresh = msgspec.structs.replace(old, name=f"{name}r", spot_deadline=None)
        self.nodes[fresh.name] = fresh
        self.emit(NodeUpsert(node=fresh))


# ---------------------------------------------------------------------------- the world


def is_cluster_lost(reason: str) -> bool:
    """A Cancel the broker sends because the attempt's cluster was silent for `lost_after_s`
    (`broker.core.agents.AgentTracker.lost_cause`)."""
    return reason == "cluster-lost" or reason.startswith("fenced: cluster ")


def successes(batch: EventBatch) -> list[WorkloadStatus]:
    """The successes a batch reports, as events or as terminal entries of a snapshot."""
    out: list[WorkloadStatus] = []
    for ev in batch.events:
        if isinstance(ev, ClusterSnapshot):
            out.extend(w for w in ev.workloads if w.phase == "succeeded")
        elif isinstance(ev, WorkloadStatus) and ev.phase == "succeeded":
            out.append(ev)
    return out


@dataclass(slots=True)
class Scenario:
    """A fixed fleet and job plan instead of the seeded random one."""

    fleet: list[tuple[str, list[FlavorInfo], list[NodeInfo]]]
    jobs: list[tuple[float, JobSpec, float]]  # (submit after, spec, seconds of work)


@dataclass(slots=True)
class _Request:
    """One command asked of an agent, as the shell's request loop holds it: copies left, the
    number of the next copy (its ack wait), the copies unanswered (by id), a refusal kept while
    a later copy may still be carried out, and (for a Cancel) its ticket at the barrier."""

    cluster: str
    cmd: Any
    tries: int
    incarnation: int
    ticket: int = 0
    copy: int = 0
    sent: int = 0  # copies sent in all: the id of the next one
    round: int = 0  # a Cancel asked again starts a new round; older timers are ignored
    out: set[int] = field(default_factory=set)
    first_at: float = 0.0  # when its first copy (of this round) left: its patience counts
    heard: int = 0  # the cluster's `Sequencer.heard` when the running wait began
    refused: CommandAck | None = None
    done: bool = False


class World:
    """The broker shell model, the agents and the network for one seed."""

    def __init__(
        self,
        seed: int,
        *,
        jobs: int = 6,
        faults: Faults | None = None,
        config: BrokerConfig | None = None,
        fault_window_s: float = 90.0,
        horizon_s: float = 1200.0,
        check_every: int = 1,
        verbose: bool = False,
        scenario: Scenario | None = None,
        tolerate: frozenset[str] = frozenset(),
        ignore_order: bool = False,
        long_work: bool = False,
    ) -> None:
        self.seed = seed
        self.long_work = long_work  # jobs of many minutes, so long outages find them running
        # A shell that drops `Send.after_cancel_of` (to show the checks catch what follows).
        self.ignore_order = ignore_order
        rng = random.Random(seed)
        self.clock = Clock(rng)
        self.started = self.clock.now
        self.tolerate = tolerate
        self.faults = faults if faults is not None else Faults()
        self.net = Net(self.clock, self.faults)
        self.config = config if config is not None else sim_config()
        self.fault_until = START_AT + fault_window_s
        self.horizon = START_AT + horizon_s
        self.check_every = check_every
        self.verbose = verbose
        self.steps = 0
        self.finished = False
        self.incarnations = 0
        self.stats: Counter[str] = Counter()
        self.live_copies: Counter[str] = Counter()  # running, per job
        self.made_copies: Counter[str] = Counter()  # made and not ended, per job
        self.completions: Counter[str] = Counter()
        self.completed_by: dict[str, list[tuple[str, int]]] = {}
        # (job, attempt) -> when it succeeded on its cluster, when a broker first applied a batch
        # carrying that success, and when a broker cancelled it for its cluster's silence
        self.succeeded_at: dict[tuple[str, int], float] = {}
        self.success_heard: dict[tuple[str, int], float] = {}
        self.lost_cancel: dict[tuple[str, int], float] = {}
        self.work_of: dict[str, float] = {}
        self.accepted: set[str] = set()
        self.forgotten: set[str] = set()  # ended jobs whose records the core forgot (retention)
        self.reclaims: Counter[str] = Counter()
        # cluster -> (when its agent heard an Applied, when the batch it names left)
        self.heard_at: dict[str, deque[tuple[float, float]]] = {}
        self.calm_after = 0.0  # no outage of minutes starts before this
        # broker shell state
        self.store: dict[str, bytes] = {}
        self.epoch = 1
        self.broker_up = True
        self.broker_inc = 0
        self.machine = Machine(self.config, epoch=self.epoch)
        self.requests: dict[int, _Request] = {}
        self._req_ids = 0
        self.sequencer = Sequencer(self.config.timeouts)  # the shell's barrier and retries
        self.writes = RecordWrites(self.config.timeouts.deferred_write_s)  # deferred records
        self.writes_wake: float | None = None  # when the first deferred record is written
        self.applied_at: dict[str, float] = {}  # cluster -> when its last batch was acknowledged
        self.stream: dict[str, JobSpec] = {}  # submissions not yet persisted (JetStream)
        self.agents: dict[str, SimAgent] = {}
        if scenario is None:
            self._build_fleet(rng)
            self._plan_jobs(rng, jobs)
        else:
            self._use(scenario)
        self.clock.at(0.0, self.broker_tick)

    # -- setup -------------------------------------------------------------------------
    def _use(self, sc: Scenario) -> None:
        for name, flavors, nodes in sc.fleet:
            self.agents[name] = SimAgent(self, name, flavors, nodes)
            self.clock.at(self.clock.rng.random() * AGENT_TICK_S, self.agents[name].tick)
        for at, spec, work in sc.jobs:
            assert spec.job_id is not None
            self.completed_by[spec.job_id] = []
            self.work_of[spec.job_id] = work
            self.clock.at(at, functools.partial(self.client_submit, spec))

    def _build_fleet(self, rng: random.Random) -> None:
        for i in range(rng.randint(2, 3)):
            name = f"c{i}"
            flavors = [
                FlavorInfo(
                    name="spot", capacity_type="spot", gpu_type="a100", price_per_gpu_hour=1.0
                ),
                FlavorInfo(
                    name="od", capacity_type="on-demand", gpu_type="a100", price_per_gpu_hour=3.0
                ),
            ]
            nodes = [
                NodeInfo(
                    name=f"{name}-{fl.name}-{j}",
                    flavor=fl.name,
                    gpu=4,
                    cpu_milli=32_000,
                    memory=128 * GiB,
                )
                for fl in flavors
                for j in range(rng.randint(2, 3))
            ]
            self.agents[name] = SimAgent(self, name, flavors, nodes)
            self.clock.at(rng.random() * AGENT_TICK_S, self.agents[name].tick)

    def _plan_jobs(self, rng: random.Random, n: int) -> None:
        queues = [q.name for q in self.config.queues]
        for i in range(n):
            job_id = f"j{i}"
            self.completed_by[job_id] = []
            gpu = rng.choice([1, 2, 4])
            replicas = rng.randint(1, 8 // gpu)  # within every queue's quota
            spec = JobSpec(
                name=f"sim{i}",
                job_id=job_id,
                queue=rng.choice(queues),
                priority=rng.choice([0, 0, 10]),
                gang=[PodSet(name="worker", replicas=replicas, gpu=gpu, cpu="1", memory="1Gi")],
                capacity=rng.choice(["any", "spot", "on-demand", "spot-then-on-demand"]),
                checkpoint=CheckpointSpec(uri=f"mem://{job_id}") if rng.random() < 0.7 else None,
            )
            self.work_of[job_id] = (
                rng.uniform(300.0, 2400.0) if self.long_work else rng.uniform(3.0, 25.0)
            )
            self.clock.at(rng.uniform(0.0, 45.0), functools.partial(self.client_submit, spec))

    def faulty(self, now: float) -> bool:
        return now < self.fault_until

    def fail(self, what: str) -> None:
        keep = self.config.limits.ended_retention_s
        extra = f" --retention-s {keep:g}" if keep > 0 else ""
        raise SimFailure(
            f"seed {self.seed}: {what} (step {self.steps}, t={self.clock.now - START_AT:.3f}s)\n"
            f"  replay: python -m load.vopr --seed {self.seed}{extra} --verbose"
        )

    def breach(self, kind: str, what: str, n: int = 1) -> None:
        """A broken promise: fatal, unless this run only counts that kind."""
        if kind in self.tolerate:
            self.stats[kind] += n
            return
        self.fail(what)

    def log(self, *parts: object) -> None:
        if self.verbose:
            print(f"{self.clock.now - START_AT:9.3f} {self.steps:6d}", *parts)

    # -- the broker shell ----------------------------------------------------------------
    def client_submit(self, spec: JobSpec) -> None:
        """The client publishes to the JetStream stream: kept until the broker persists it."""
        assert spec.job_id is not None
        self.stream[spec.job_id] = spec
        self._drain_stream()

    def _drain_stream(self) -> None:
        if not self.broker_up:
            return
        for job_id, spec in sorted(self.stream.items()):
            reply, effects = split_reply(self.machine.handle(SubmitJob(spec), self.clock.now))
            if reply.accepted:
                self.accepted.add(job_id)
            else:
                del self.stream[job_id]  # answered and acked: a rejection is final
            self.log("submit", job_id, reply.accepted, reply.error or "")
            if not self.run_effects(effects):
                return
            self.stream.pop(job_id, None)

    def run_effects(self, effects: list[Effect]) -> bool:
        """Carry out effects in order; False when the broker crashed part way."""
        unordered = unordered_dispatches(self.machine, effects)
        if unordered:
            self.fail("; ".join(unordered[:3]))
        inc = self.broker_inc
        # The shell's order (broker/sequencer.py): the records first (deferred ones wait), then
        # the rest in order. A crash may strike after any record written or deferred, or any
        # effect carried out: one draw per record the batch persists, deferred or not, so a
        # seed's faults fall where they fell before writes were deferred.
        now = self.writes.take((effects,), self.clock.now)
        batch = persist_first((effects,))
        ours = {r.job_id for r in batch}
        self._write([r for r in now if r.job_id not in ours])  # other jobs' writes fallen due
        urgent = {r.job_id for r in now}
        for record in batch:
            if record.job_id in urgent:
                self.store[record.job_id] = record_encoder.encode(record)
            if self._crashes():
                return False
        self._wake_for_deferred()
        for eff in effects:
            if not self.broker_up or self.broker_inc != inc:
                return False
            if isinstance(eff, Persist):
                continue  # written above
            if isinstance(eff, Send):
                cmd = eff.command
                if isinstance(cmd, Cancel):
                    self.stats[f"cancel:{cmd.reason}"] += 1
                    if cmd.attempt is not None and is_cluster_lost(cmd.reason):
                        self.lost_cancel.setdefault((cmd.job_id, cmd.attempt), self.clock.now)
                if (
                    isinstance(cmd, Dispatch)
                    and not self.ignore_order
                    and not self.sequencer.dispatch(eff.cluster, cmd, eff.after_cancel_of)
                ):
                    self._log_send(eff.cluster, cmd)  # held behind the Cancel it follows
                else:
                    self._send(eff.cluster, cmd)
            elif isinstance(eff, Forget):
                self._forget(eff)
            elif isinstance(eff, Publish):
                ev = eff.event
                if ev.kind == "preempting" and ev.reason == "reclaimed":
                    self.reclaims[ev.job_id] += 1
            if self._crashes():
                return False
        return True

    def _write(self, records: list[JobRecord]) -> None:
        """Write deferred records fallen due, then wake for the next one."""
        for record in records:
            self.store[record.job_id] = record_encoder.encode(record)
        self._wake_for_deferred()

    def _wake_for_deferred(self) -> None:
        due = self.writes.due_at()
        if due is not None and (self.writes_wake is None or due < self.writes_wake):
            self.writes_wake = due
            inc = self.broker_inc
            self.clock.at(due - self.clock.now, lambda: self._deferred_due(inc, due))

    def _deferred_due(self, inc: int, due: float) -> None:
        """The first deferred record fell due: the shell's pipeline writes it (and any due)."""
        if self.writes_wake == due:
            self.writes_wake = None
        if self.broker_up and self.broker_inc == inc:
            self._write(self.writes.take((), self.clock.now))

    def _forget(self, eff: Forget) -> None:
        """Delete the record, as the shell does: never one that marks a Cancel unheard."""
        data = self.store.pop(eff.job_id, None)
        stored = {eff.job_id: record_decoder.decode(data)} if data is not None else {}
        bad = unsettled_forgets(stored, [eff])
        if bad:
            self.fail("; ".join(bad))
        self.forgotten.add(eff.job_id)
        self.stats["forgotten"] += 1

    def _crashes(self) -> bool:
        """The broker dies right after the step it just took (a seeded draw per step)."""
        if self.faulty(self.clock.now) and self.clock.rng.random() < self.faults.broker_crash:
            self.crash()
            return True
        return False

    def _log_send(self, cluster: str, cmd: Any) -> None:
        self.log(
            "send",
            cluster,
            type(cmd).__name__,
            getattr(cmd, "job_id", ""),
            getattr(cmd, "attempt", ""),
        )

    def _send(self, cluster: str, cmd: Any) -> None:
        self._log_send(cluster, cmd)
        seq = self.sequencer
        self._req_ids += 1
        rid = self._req_ids
        ticket = seq.cancel(cmd) if isinstance(cmd, Cancel) else 0
        self.requests[rid] = _Request(cluster, cmd, seq.attempts(cmd), self.broker_inc, ticket)
        if isinstance(cmd, Dispatch):
            seq.dispatch_sent(cluster, cmd)
        self._try(rid)

    def _try(self, rid: int) -> None:
        """Send the request's next copy and wait for it as long as the sequencer says."""
        req = self.requests.get(rid)
        if req is None or req.done or req.incarnation != self.broker_inc:
            return
        if req.refused is not None:  # refused, and no later copy answered within its wait
            self._answered(rid, req.refused)
            return
        seq = self.sequencer
        cmd = req.cmd
        if req.out and req.copy and isinstance(cmd, Dispatch):  # a busy agent is waited for
            waited, keys = self.clock.now - req.first_at, [(cmd.job_id, cmd.attempt)]
            if seq.still_busy(req.cluster, req.heard, waited, seq.attempts(cmd), keys):
                req.heard = seq.heard(req.cluster)
                self.stats["busy-waits"] += 1
                self._later(rid, seq.ack_wait(req.cluster, req.copy - 1))
                return
        if req.tries <= 0:
            wait = seq.ack_wait(req.cluster, max(req.copy - 1, 0))
            self._answered(rid, seq.silence(req.cluster, wait))
            return
        req.tries -= 1
        copy, cid = req.copy, req.sent
        req.copy += 1
        req.sent += 1
        agent = self.agents.get(req.cluster)
        if agent is not None:
            sent = self.clock.now
            req.out.add(cid)

            def deliver(a: SimAgent = agent) -> None:
                a.on_command(
                    req.cmd,
                    lambda ack: self.net.send(
                        f"ack.{a.cluster}", lambda: self._on_ack(rid, cid, sent, ack)
                    ),
                )

            self.net.send(f"cmd.{req.cluster}", deliver)
        if copy == 0:
            req.first_at = self.clock.now
        req.heard = seq.heard(req.cluster)
        self._later(rid, seq.ack_wait(req.cluster, copy))

    def _later(self, rid: int, delay: float) -> None:
        rnd = self.requests[rid].round
        self.clock.at(delay, lambda: self._retry(rid, rnd))

    def _retry(self, rid: int, rnd: int) -> None:
        req = self.requests.get(rid)
        if req is not None and not req.done and req.round == rnd:
            self._try(rid)

    def _on_ack(self, rid: int, cid: int, sent: float, ack: CommandAck) -> None:
        req = self.requests.get(rid)
        if req is None or req.done or req.incarnation != self.broker_inc or not self.broker_up:
            return
        if cid not in req.out:
            return  # a second reply to one copy (NATS delivered the copy twice): taken once
        req.out.discard(cid)
        self.sequencer.acked(
            req.cluster, self.clock.now - sent, dispatch=isinstance(req.cmd, Dispatch)
        )
        if ack.stale_epoch:
            self.fail(f"an agent refused the leader's epoch {self.epoch}: {ack.error}")
        if self.sequencer.decides(ack, outstanding=bool(req.out)):
            self._answered(rid, ack)
        else:
            req.refused = ack

    def _answered(self, rid: int, ack: CommandAck) -> None:
        """The request's answer (a refusal for silence). A Cancel not heard is asked again
        until heard or its cluster is lost, as the shell does."""
        req = self.requests[rid]
        if isinstance(req.cmd, Cancel) and not ack.ok:
            track = self.machine.agents.get(req.cluster)
            pause = self.sequencer.cancel_again(track.health if track is not None else None)
            if pause is not None:
                req.tries, req.copy, req.refused = self.sequencer.attempts(req.cmd), 0, None
                req.out.clear()
                req.round += 1
                self._later(rid, pause)
                return
            if req.cmd.attempt is not None:  # given up: its cluster is lost
                self.lost_cancel.setdefault((req.cmd.job_id, req.cmd.attempt), self.clock.now)
        self._resolve(rid, ack)

    def _resolve(self, rid: int, ack: CommandAck) -> None:
        req = self.requests.pop(rid)
        req.done = True
        cmd = req.cmd
        if isinstance(cmd, Dispatch):
            self.sequencer.dispatch_answered(cmd)
            self.run_effects(
                self.machine.handle(
                    DispatchAcked(
                        cmd.job_id,
                        cmd.attempt,
                        ack.ok,
                        ack.error,
                        job_only=ack.job_only,
                        resize_refused=ack.resize_refused,
                    ),
                    self.clock.now,
                )
            )
        elif isinstance(cmd, Cancel):
            if cmd.attempt is not None:  # as the shell: the core hears of it, then the held go
                self._count_kept(cmd.job_id)
                ended = ack.ended if ack.ok else None
                if ended is not None and ended.phase == "succeeded":
                    self.success_heard.setdefault((ended.job_id, ended.attempt), self.clock.now)
                settled = CancelSettled(cmd.job_id, cmd.attempt, req.cluster, ended)
                if not self.run_effects(self.machine.handle(settled, self.clock.now)):
                    return
            for held in self.sequencer.settled(cmd, req.ticket):
                self._send(held.cluster, held.command)

    def _count_kept(self, job_id: str) -> None:
        """Counts a Cancel settling for an ended job past its retention: kept for it."""
        keep = self.config.limits.ended_retention_s
        record = self.machine.jobs.get(job_id)
        ended = record.finished_at if record is not None else None
        if keep > 0 and ended is not None and ended + keep < self.clock.now:
            self.stats["kept-past-retention"] += 1

    def broker_batch(self, cluster: str, batch: EventBatch) -> None:
        if not self.broker_up:
            return  # plain NATS: nobody listens
        self.sequencer.carried_out(cluster, batch)
        out = self.machine.handle(AgentBatch(cluster, batch), self.clock.now)
        error = refusal(out)
        if not error and applied(out) is not None:  # not a batch answered with a resync:
            for st in successes(batch):  # the core dropped what it carried, by design
                self.success_heard.setdefault((st.job_id, st.attempt), self.clock.now)
        if error:
            self.stats["batches_refused"] += 1  # a duplicate is a replay: refused, harmless
        # Acknowledged as the shell does (broker/agentio.py): only a batch the core applied in
        # full, and one without outcomes at most every APPLIED_EVERY_S, once it is persisted.
        now = self.clock.now
        ack = acknowledges(out, batch, now, self.applied_at.get(cluster))
        done = self.run_effects(out)
        if done and ack:
            self.applied_at[cluster] = now
            self._send(cluster, Applied(epoch=self.epoch, instance=batch.instance, seq=batch.seq))
        # A batch of heartbeats that asked for nothing changed no job: skip the checks.
        self.after_step(bool(out) or any(not isinstance(e, Heartbeat) for e in batch.events))

    def broker_tick(self) -> None:
        if self.broker_up:
            now = self.clock.now
            effects = self.machine.handle(TICK, now)
            changed = bool(effects)
            if self.run_effects(effects) and self.machine.wants_cycle:
                effects = self.machine.handle(CYCLE, now)
                changed = changed or bool(effects)
                self.run_effects(effects)
            changed = changed or bool(self.stream)
            self._drain_stream()
            self.after_step(changed)
        else:
            self.after_step(False)
        if not self.finished:
            self.clock.at(BROKER_TICK_S, self.broker_tick)

    def crash(self, down_s: float | None = None) -> None:
        self.log("broker crash")
        self.stats["broker_crashes"] += 1
        self.broker_up = False
        self.broker_inc += 1
        self.requests.clear()
        self.sequencer.reset()
        self.stats["deferred_writes_lost"] += self.writes.waiting()
        self.writes.reset()  # deferred records die with the process
        self.writes_wake = None
        if down_s is None:
            down_s = self.clock.rng.uniform(0.5, self.faults.broker_down_s)
        self.clock.at(down_s, self.recover)

    def recover(self) -> None:
        """A new leader: higher epoch, state restored from the persisted records only."""
        self.epoch += 1
        self.broker_inc += 1
        self.machine = Machine(self.config, epoch=self.epoch)
        self.sequencer = Sequencer(self.config.timeouts)  # a new process learns waits anew
        self.applied_at = {}
        records = [record_decoder.decode(b) for b in self.store.values()]
        resend = self.machine.handle(Restore(records), self.clock.now)
        self.broker_up = True
        self.log("broker restored", len(records), "records, epoch", self.epoch)
        self.run_effects(resend)
        for cluster in list(self.machine.agents):
            self._send(cluster, Resync(epoch=self.epoch, reason="new leader"))
        self._drain_stream()

    # -- checks ------------------------------------------------------------------------
    def after_step(self, changed: bool = True) -> None:
        self.steps += 1
        if changed and self.broker_up and self.steps % self.check_every == 0:
            bad = violations(self.machine)
            if bad:
                self.fail("; ".join(bad[:3]))

    def run(self) -> World:
        while self.clock.step():
            now = self.clock.now
            if now > self.fault_until and self.broker_up and self._settled():
                break
            if now > self.horizon:
                break
        self.finished = True
        self.final_checks()
        return self

    def _settled(self) -> bool:
        if self.stream:
            return False
        if any(
            r.incarnation == self.broker_inc and hasattr(r.cmd, "job_id")
            for r in self.requests.values()
        ):
            return False  # a job's command (a Cancel, say) is still on its way to an agent
        jobs = self.machine.jobs
        return all(
            j in self.forgotten or (j in jobs and jobs[j].state in TERMINAL) for j in self.accepted
        )

    def unheard_when_lost(self, job_id: str, attempt: int) -> bool:
        """Whether the attempt succeeded and the broker then gave it up for its cluster's
        silence before any batch carrying that success reached it: the one way a job may run to
        completion twice. (A success after the broker gave it up means its fence did not hold.)"""
        key = (job_id, attempt)
        lost = self.lost_cancel.get(key)
        done = self.succeeded_at.get(key, float("inf"))
        return lost is not None and done <= lost < self.success_heard.get(key, float("inf"))

    def check_completed_once(self) -> None:
        """Each job runs to completion once, except an attempt whose success could not reach
        the broker before it declared the cluster lost and ran the job again (at-least-once
        across cuts longer than `lost_after_s`, docs/operations.md): counted, not fatal."""
        twice: dict[str, list[tuple[str, int]]] = {}
        for job_id, done in self.completed_by.items():
            if len(done) < 2:
                continue
            excused = [d for d in done if self.unheard_when_lost(job_id, d[1])]
            if len(done) - len(excused) > 1 or not excused:
                twice[job_id] = done
            else:
                self.stats["rerun-after-unheard-success"] += len(done) - 1
        if twice:
            self.breach("completed-twice", f"jobs completed more than once: {twice}", len(twice))

    def final_checks(self) -> None:
        if not self.broker_up:
            self.fail("the broker is down at the end")
        jobs = self.machine.jobs
        stuck = sorted(
            j
            for j in self.accepted - self.forgotten
            if j not in jobs or jobs[j].state not in TERMINAL
        )
        if stuck:
            states = {j: jobs[j].state if j in jobs else "lost" for j in stuck[:5]}
            self.fail(f"{len(stuck)} accepted job(s) not terminal at the horizon: {states}")
        self.check_completed_once()
        for j, rec in jobs.items():
            if rec.state == "succeeded" and self.completions[j] == 0:
                self.fail(f"job {j} marked succeeded but no agent ran it to the end")
        sched = self.machine.scheduler
        if sched.allocations():
            self.fail(f"allocations left at the end: {sorted(sched.allocations())[:5]}")
        for name, qs in sched.queue_states().items():
            if any(any(v) for v in qs.usage.values()) or qs.admitted:
                self.fail(f"queue {name} usage not back to zero: {qs.usage} admitted={qs.admitted}")
        for agent in self.agents.values():
            if agent.work:
                self.fail(f"workloads still running on {agent.cluster}: {sorted(agent.work)[:5]}")


# ---------------------------------------------------------------------------- entry


def run_seed(seed: int, **kw: Any) -> World:
    return World(seed, **kw).run()


def long_outage_world(seed: int, **kw: Any) -> World:
    """A seed with outages of minutes (API server, agent, NATS, broker) and the shipped
    windows: still never two live copies, and now also nothing healthy ended by a fence."""
    kw = {
        "faults": LONG,
        "config": long_config(),
        "long_work": True,
        "fault_window_s": 3600.0,
        "horizon_s": 12_000.0,
        **kw,
    }
    return World(seed, **kw).run()


def run_many(
    seeds: range, *, budget_s: float | None = None, long_outages: bool = False, **kw: Any
) -> tuple[int, list[tuple[int, str]], Counter[str]]:
    """Run seeds in order (stopping at the time budget); returns (seeds run, failures, stats).
    `long_outages`: each seed as `long_outage_world` runs it."""
    run = long_outage_world if long_outages else run_seed
    failures: list[tuple[int, str]] = []
    totals: Counter[str] = Counter()
    start = time.monotonic()
    n = 0
    for seed in seeds:
        if budget_s is not None and time.monotonic() - start > budget_s:
            break
        n += 1
        try:
            w = run(seed, **kw)
            totals.update(w.stats)
            totals["steps"] += w.steps
        except SimFailure as exc:
            failures.append((seed, str(exc)))
    return n, failures, totals


app = program()


@app.command(help=summary(__doc__))
def vopr(
    seed: Annotated[int | None, typer.Option(help="run this one seed (replay)")] = None,
    seeds: Annotated[int, typer.Option(min=1, help="how many seeds, from --first")] = 500,
    first: int = 0,
    jobs: Annotated[int, typer.Option(min=1)] = 6,
    budget_s: Annotated[
        float | None, typer.Option(min=0.0, help="stop starting seeds after this")
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose")] = False,
    long_outages: Annotated[
        bool, typer.Option("--long-outages", help="outages of minutes, the shipped windows")
    ] = False,
    retention_s: Annotated[
        float, typer.Option(min=0.0, help="forget ended jobs this long after they end (0: never)")
    ] = 0.0,
) -> None:
    run = long_outage_world if long_outages else run_seed
    kw: dict[str, Any] = {"jobs": jobs}
    if retention_s > 0:
        kw["config"] = retaining(long_config() if long_outages else sim_config(), retention_s)
    if seed is not None:
        try:
            w = run(seed, verbose=verbose, **kw)
        except SimFailure as exc:
            print(exc)
            raise typer.Exit(1) from None
        print(f"seed {seed}: ok, {w.steps} steps, {dict(w.stats)}")
        return
    t0 = time.monotonic()
    n, failures, totals = run_many(
        range(first, first + seeds), budget_s=budget_s, long_outages=long_outages, **kw
    )
    for _, msg in failures[:20]:
        print(msg)
    print(
        f"{n} seeds in {time.monotonic() - t0:.1f}s, {len(failures)} failed; faults: {dict(totals)}"
    )
    raise typer.Exit(1 if failures else 0)


if __name__ == "__main__":
    app(prog_name="python -m load.vopr")
