"""The discrete-event loop: one heap and one virtual clock feeding the pure `Machine` and
carrying out its effects on the simulated clusters, in the order the broker shell's own
sequencer (`broker/sequencer.py`) gives: persist first, a Dispatch held behind the Cancels it
is ordered after, the core told of each Cancel heard (`CancelSettled`) as the shell tells it."""

from __future__ import annotations

import hashlib
import heapq
import random
import sys
import time
from pathlib import Path
from typing import Any

from agents.fake.model import (
    ManualClock,
    provider_delays,
)
from broker.core.effects import Effect, Publish, Send, refusal, split_reply
from broker.core.inputs import AgentBatch, CancelSettled, Cycle, DispatchAcked, SubmitJob, Tick
from broker.core.invariants import unordered_dispatches
from broker.core.machine import Machine
from broker.core.states import TERMINAL
from broker.sequencer import Sequencer, persist_first
from load.sim.agent import (
    SimAgent,
)
from load.sim.checks import Checks
from load.sim.jobs import (
    SimJob,
    broker_config,
    job_spec,
    make_jobs,
)
from load.sim.policies import (
    POLICIES,
    Policy,
)
from load.sim.reasons import count_reasons
from load.sim.spots import SpotWorld
from load.sim.world import (
    ACK,
    ARRIVAL,
    CANCEL_ARRIVES,
    CLUSTER_DUE,
    CYCLE,
    HEARTBEAT,
    NODE_GONE_SEEN,
    NODE_UP,
    POISSON,
    RECLAIM,
    RECLAIMED,
    SAMPLE,
    SLOT_RETURN,
    SPOT_TRACE,
    TICK,
    AttemptLog,
    Sample,
    SimResult,
    SpotPool,
    Violation,
)
from load.simconfig import (
    PoolSpec,
    SimConfig,
    on_demand_pools,
)
from schemas.agent import (
    Cancel,
    Dispatch,
    Heartbeat,
    Provision,
)
from schemas.api import JobEvent

MAX_PUMP_ROUNDS = 64  # agent <-> broker exchanges per step before we call it a livelock


class Sim(SpotWorld, Checks):
    """The discrete-event loop: one heap, one virtual clock, the Machine, the clusters."""

    def __init__(self, cfg: SimConfig, policy: Policy | str = "muster") -> None:
        self.cfg = cfg
        self.policy = POLICIES[policy] if isinstance(policy, str) else policy
        self.spot_rng = random.Random(f"spot-{cfg.seed}")
        self.speed = dict(cfg.gpu_speed)
        self.jobs = make_jobs(cfg)
        self.jobs_by_id = {j.job_id: j for j in self.jobs}
        self.base = 1.5e9  # unix seconds at virtual zero (Philly time is not kept)
        self.now = self.base
        # The clusters' clock: the models count unix seconds too, so due times need no
        # conversion on the way to and from this heap.
        self.clock = ManualClock(t=self.base, unix0=0.0)
        config = broker_config(cfg, self.policy)
        self.machine = Machine(config)
        self.machine.spot_return = self.policy.spot_return
        self.machine.moves.spot_yield = self.policy.spot_yield
        self.reasons = count_reasons(self.machine)  # read only (`--reasons` prints them)
        self.heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.logs: dict[str, list[AttemptLog]] = {}
        self.live_copies: dict[str, tuple[str, int]] = {}
        # The shell's barrier: Cancels on their way and the dispatches ordered after them
        self.sequencer = Sequencer(config.timeouts)
        self.node_home: dict[str, tuple[str, str]] = {}
        self.node_place: dict[str, tuple[str, str]] = {}  # node -> (zone, block or "")
        self.node_spans: dict[str, list[float]] = {}  # node -> [up, gone] (unix s): capacity log
        self.violations: list[Violation] = []
        self.batch_errors: list[str] = []
        self.state: dict[str, str] = {}
        self.first_admit: dict[str, float] = {}
        self.samples: list[Sample] = []
        self.spot_notices = 0
        self.notice_log: list[tuple[float, str]] = []  # (virtual s, node): for tests/plots
        self.reclaim_log: list[tuple[float, str]] = []
        self.checks = 0
        self.steps = 0
        self._cycle_pending = False
        self._done_count = 0
        self._touched: set[str] = set()
        self._open: set[str] = set()  # jobs not yet terminal: what a full sweep reads
        self._claims: dict[str, dict[str, int]] = {}
        self._usage: dict[str, int] = {}
        self.pools = on_demand_pools(cfg.pools) if self.policy.on_demand_only else cfg.pools
        # autoscaled pools: asks answered, nodes brought up, stockouts, and what every node
        # present cost (idle or not), summed at each sample
        self.provision_rng = random.Random(f"provision-{cfg.seed}")
        self._asked: set[tuple[str, str, str, float]] = set()
        self.provision_asks = self.provisioned = self.stockouts = 0
        self.capacity_cost = 0.0
        self._sampled_at = self.base
        by_cluster: dict[str, list[PoolSpec]] = {}
        for p in self.pools:
            by_cluster.setdefault(p.cluster, []).append(p)
        self.clusters = {c: SimAgent(self, c, ps) for c, ps in by_cluster.items()}
        self.spot_pools: list[SpotPool] = []
        self._build_nodes()
        for agent in self.clusters.values():
            agent.start()

    # -- heap --------------------------------------------------------------------------
    def push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, self._seq, kind, payload))

    def draw(self, job_id: str, attempt: int, what: str) -> float:
        """A uniform [0, 1) number fixed by (seed, job, attempt, what): the same attempt gets
        the same start-up delay whatever order the machine happened to emit effects in."""
        key = f"{self.cfg.seed}:{job_id}:{attempt}:{what}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2**64

    def violation(self, now: float, kind: str, detail: str) -> None:
        if len(self.violations) < 1000:
            self.violations.append(Violation(now - self.base, kind, detail))

    # -- the loop ----------------------------------------------------------------------
    def run(self) -> SimResult:
        started = time.perf_counter()
        cfg = self.cfg
        for job in self.jobs:
            self.push(self.base + job.arrival, ARRIVAL, job)
        for c in self.clusters.values():
            self.push(self.base + _stagger(c.name), HEARTBEAT, c)
        self.push(self.base, TICK, None)
        self.push(self.base, SAMPLE, None)
        self._pump()  # initial snapshots
        end_at = self.base + (self.jobs[-1].arrival if self.jobs else 0.0) + cfg.drain_s
        arrived = 0
        next_report = started + cfg.progress_s
        while self.heap and self.steps < cfg.max_steps:
            t, _, kind, payload = heapq.heappop(self.heap)
            if t > end_at:
                break
            if kind == CLUSTER_DUE and not payload.due(t):
                continue
            self.now = max(self.now, t)
            self.clock.t = self.now
            self.steps += 1
            if kind == ARRIVAL:
                arrived += 1
            self._handle(kind, payload)
            self._pump()
            self._check_touched()
            if self.steps % cfg.full_check_every == 0:
                self.check_all(everything=False)
                if cfg.progress_s > 0 and time.perf_counter() >= next_report:
                    next_report = time.perf_counter() + cfg.progress_s
                    self._progress(started, arrived)
            if arrived == len(self.jobs) and self._all_done():
                break
        self.check_all()
        self._sample()
        return SimResult(
            policy=self.policy.name,
            config=_config_dict(cfg),
            jobs=self.jobs,
            records=self.machine.jobs,
            logs=self.logs,
            samples=self.samples,
            violations=self.violations,
            checks=self.checks,
            steps=self.steps,
            base=self.base,
            end=self.now - self.base,
            wall_s=time.perf_counter() - started,
            spot_notices=self.spot_notices,
            batch_errors=self.batch_errors,
            first_admit=self.first_admit,
            capacity_cost_usd=self.capacity_cost,
            provision_asks=self.provision_asks,
            provisioned=self.provisioned,
            stockouts=self.stockouts,
        )

    def _progress(self, started: float, arrived: int) -> None:
        """One line on stderr: virtual time, jobs done, queue, and how fast time passes."""
        wall = time.perf_counter() - started
        virtual_h = (self.now - self.base) / 3600.0
        views = self.machine.views
        print(
            f"[{self.policy.name} seed {self.cfg.seed}] virtual {virtual_h:7.1f} h | "
            f"arrived {arrived:,}/{len(self.jobs):,} done {self._done_count:,} | "
            f"queued {views.pending_count():,} live {views.live_count():,} | "
            f"wall {wall:6.0f} s, {virtual_h / 24 / max(wall, 1e-9):.2f} virtual days/s, "
            f"{self.steps / max(wall, 1e-9):,.0f} steps/s",
            file=sys.stderr,
            flush=True,
        )

    def _all_done(self) -> bool:
        return self._done_count == len(self.jobs)

    def _handle(self, kind: int, payload: Any) -> None:
        now = self.now
        m = self.machine
        if kind == ARRIVAL:
            job: SimJob = payload
            reply, effects = split_reply(m.handle(SubmitJob(job_spec(job, self.policy)), now))
            if not reply.accepted:
                # Not an invariant: a gang this fleet can never hold (e.g. 16 nodes of
                # on-demand for an on-demand job) is refused at submit, as it should be.
                self.batch_errors.append(f"rejected {job.job_id}: {reply.error}")
                self.state[job.job_id] = "failed"
                self._done_count += 1
            self._execute(effects)
        elif kind == ACK:
            job_id, attempt, ok, error = payload
            self._touched.add(job_id)
            self._execute(m.handle(DispatchAcked(job_id, attempt, ok, error), now))
        elif kind == CLUSTER_DUE:
            payload.advance()
        elif kind == SPOT_TRACE:
            pool, loop, e = payload
            self._trace_apply(pool, loop, e, announce=True)
        elif kind == RECLAIM:
            pool, slot, name = payload
            # (The model reclaims the node at its deadline too; whichever comes first.)
            self.clusters[pool.spec.cluster].remove_node(name, reason=RECLAIMED)
            self.reclaim_log.append((now - self.base, name))
            if slot.node == name:
                slot.node = None
                if self.cfg.spot == "poisson" or pool.spec.trace is None:
                    self.push(
                        now + self.spot_rng.expovariate(1.0 / self.cfg.poisson_down_s),
                        SLOT_RETURN,
                        (pool, slot),
                    )
        elif kind == POISSON:
            self._poisson(payload)
        elif kind == CANCEL_ARRIVES:
            target, cmd, ticket = payload
            target.command(cmd, now)
            self._cancel_heard([cmd])
            for held in self.sequencer.settled(cmd, ticket):
                self.clusters[held.cluster].command(held.command, now)
        elif kind == NODE_GONE_SEEN:
            gone_from, name, found = payload
            gone_from.unreported.discard(name)
            gone_from.outbox.extend(found)
        elif kind == SLOT_RETURN:
            pool, slot = payload
            if slot.node is None:
                self._slot_up(pool, slot)
        elif kind == TICK:
            effects = m.handle(Tick(), now)
            if m.wants_cycle:
                effects.extend(m.handle(Cycle(), now))
                self._cycle_pending = False
            self._execute(effects)
            busy = m.views.pending_count() > 0 or m.views.live_count() > 0
            self.push(now + (self.cfg.tick_s if busy else self.cfg.idle_tick_s), TICK, None)
        elif kind == CYCLE:
            self._cycle_pending = False
            self._execute(m.handle(Cycle(), now))
        elif kind == HEARTBEAT:
            cluster: SimAgent = payload
            cluster.outbox.append(Heartbeat(at=now))
            self.push(now + self.cfg.heartbeat_s, HEARTBEAT, cluster)
        elif kind == SAMPLE:
            self._sample()
            for agent in self.clusters.values():
                agent.consolidate(now)
            self.push(now + self.cfg.sample_s, SAMPLE, None)
        elif kind == NODE_UP:
            agent, flavor = payload
            self.provisioned += 1
            agent.add_node(f"{agent.name}-{flavor}-as{self.provisioned}", flavor)

    def _pump(self) -> None:
        """Deliver every cluster's outbox to the machine until nothing more is said."""
        for _ in range(MAX_PUMP_ROUNDS):
            said = False
            for cluster in self.clusters.values():
                if not cluster.outbox and not cluster.snapshot_due:
                    continue
                for batch in cluster.take_batches(self.now):
                    said = True
                    for e in batch.events:
                        jid = getattr(e, "job_id", None)
                        if jid is not None:
                            self._touched.add(jid)
                    out = self.machine.handle(AgentBatch(cluster.name, batch), self.now)
                    error = refusal(out)
                    if error is not None:
                        self.batch_errors.append(error)
                    self._execute(out)
            if not said:
                break
        else:
            self.violation(self.now, "livelock", "agents and broker kept answering each other")
        if self.machine.wants_cycle and not self._cycle_pending:
            self._cycle_pending = True
            self.push(self.now + self.cfg.cycle_delay_s, CYCLE, None)

    def _cancel_heard(self, cancels: list[Cancel]) -> None:
        """The agents took these Cancels: the core hears it, as from the shell."""
        for cmd in cancels:
            if cmd.attempt is not None:
                self._execute(self.machine.handle(CancelSettled(cmd.job_id, cmd.attempt), self.now))

    def _execute(self, effects: list[Effect]) -> None:
        heard: list[Cancel] = []
        for problem in unordered_dispatches(self.machine, effects):
            self.violation(self.now, "unordered-dispatch", problem)
        for record in persist_first((effects,)):
            self._touched.add(record.job_id)
        for eff in effects:
            if isinstance(eff, Send):
                cluster = self.clusters.get(eff.cluster)
                cmd = eff.command
                jid = getattr(cmd, "job_id", None)
                if jid is not None:
                    self._touched.add(jid)
                if cluster is None:
                    self.violation(self.now, "unknown-cluster", eff.cluster)
                    continue
                if isinstance(cmd, Cancel) and self.cfg.cancel_latency_s > 0:
                    ticket = self.sequencer.cancel(cmd)
                    arrives = self.now + self.cfg.cancel_latency_s
                    self.push(arrives, CANCEL_ARRIVES, (cluster, cmd, ticket))
                    continue
                if (
                    isinstance(cmd, Dispatch)
                    and self.cfg.keep_order
                    and not self.sequencer.dispatch(eff.cluster, cmd, eff.after_cancel_of)
                ):
                    continue  # held behind the Cancel it is ordered after
                cluster.command(cmd, self.now)
                if isinstance(cmd, Cancel):
                    heard.append(cmd)
            elif isinstance(eff, Publish):
                self._on_event(eff.event)
        self._cancel_heard(heard)

    def _on_event(self, event: JobEvent) -> None:
        jid = event.job_id
        self._touched.add(jid)
        before = self.state.get(jid)
        self.state[jid] = event.state
        if event.kind == "admitted" and jid not in self.first_admit:
            self.first_admit[jid] = event.at
        if event.state in TERMINAL and before not in TERMINAL:
            self._done_count += 1
            self._open.discard(jid)
        elif event.state not in TERMINAL:
            self._open.add(jid)

    def provision(self, agent: SimAgent, cmd: Provision, now: float) -> None:
        """The pool's provider: each node comes after a seeded log-normal delay, or none does
        when the ask stocks out; a pool with an availability trace gets at most what the
        trace grants now (none: a stockout). An ask is answered once (the broker may resend
        it)."""
        spec = agent.pools[cmd.flavor].autoscale
        key = (agent.name, cmd.job_id, cmd.flavor, cmd.deadline)
        if spec is None or key in self._asked:
            return
        self._asked.add(key)
        self.provision_asks += 1
        granted = self.available(spec, now)
        count = cmd.nodes if granted is None else min(cmd.nodes, granted)
        delays = provider_delays(
            self.provision_rng, count, spec.ready_s, spec.spread, spec.stockout_p
        )
        if not delays:
            self.stockouts += 1
        for delay in delays:
            self.push(now + delay, NODE_UP, (agent, cmd.flavor))

    def _sample(self) -> None:
        cap = spot = alloc = running = 0
        dt_h = (self.now - self._sampled_at) / 3600.0
        self._sampled_at = self.now
        for c in self.clusters.values():
            for node in c.model.node_states():
                self.capacity_cost += node.gpu * c.pools[node.flavor].price * dt_h
                cap += node.gpu
                if c.pools[node.flavor].capacity_type == "spot":
                    spot += node.gpu
            for log in c.live.values():
                alloc += log.gpus
                if log.running_at is not None:
                    running += log.gpus
        self.samples.append(
            Sample(
                t=(self.now - self.base) / 3600.0,
                capacity=cap,
                allocated=alloc,
                running=running,
                spot_capacity=spot,
                pending=self.machine.views.pending_count(),
                live=self.machine.views.live_count(),
            )
        )


def _stagger(name: str) -> float:
    """Spread heartbeats of different clusters over a second, deterministically."""
    return (sum(name.encode()) % 100) / 100.0


def _config_dict(cfg: SimConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in cfg.__dataclass_fields__:
        v = getattr(cfg, k)
        if k == "pools":
            v = [p.flavor + "@" + p.cluster + f"x{p.nodes}" for p in v]
        elif isinstance(v, Path):
            v = v.name
        elif isinstance(v, tuple):
            v = list(v)
        out[k] = v
    return out
