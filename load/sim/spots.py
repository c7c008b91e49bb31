"""The simulated fleet: nodes named and placed in zones and blocks, spot slots bound to trace
nodes, and reclaims from a looped trace or a Poisson process."""

from __future__ import annotations

import bisect
import random
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agents.fake.trace import TraceEvent
from load import traces
from load.sim.agent import SimAgent
from load.sim.jobs import (
    SimJob,
    cached_trace,
)
from load.sim.policies import Policy
from load.sim.world import (
    NODE_GPUS,
    POISSON,
    RECLAIM,
    SPOT_TRACE,
    AttemptLog,
    Slot,
    SpotPool,
)
from load.simconfig import (
    NOTICE_S,
    AutoscaleSpec,
    PoolSpec,
    SimConfig,
)


@lru_cache(maxsize=16)
def availability(path: Path) -> tuple[list[float], list[int]]:
    """A trace as a step function: the instants (s) its node count changes and the count from
    each on (SkyPilot's counts per tick; a Bamboo trace's live nodes)."""
    times: list[float] = []
    counts: list[int] = []
    live = 0
    for e in cached_trace(path).events:
        live = live + 1 if e.op == "add" else max(0, live - 1)
        if times and times[-1] == e.seconds:
            counts[-1] = live  # every change of one tick: the count after all of them
        else:
            times.append(e.seconds)
            counts.append(live)
    return times, counts


class SpotWorld:
    """The `Sim`'s fleet: node names and places, spot slots bound to trace nodes, reclaims."""

    cfg: SimConfig
    policy: Policy
    pools: tuple[PoolSpec, ...]
    clusters: dict[str, SimAgent]
    spot_pools: list[SpotPool]
    spot_rng: random.Random
    jobs: list[SimJob]
    base: float
    now: float
    node_home: dict[str, tuple[str, str]]
    node_place: dict[str, tuple[str, str]]
    node_spans: dict[str, list[float]]
    spot_notices: int
    notice_log: list[tuple[float, str]]

    if TYPE_CHECKING:  # the loop's (load/sim/loop.py)

        def push(self, t: float, kind: int, payload: Any) -> None: ...

    # -- world setup -------------------------------------------------------------------
    def _build_nodes(self) -> None:
        for p in self.pools:
            cluster = self.clusters[p.cluster]
            spot_driven = (
                p.capacity_type == "spot"
                and self.cfg.spot != "none"
                and not self.policy.on_demand_only
                and p.autoscale is None
            )
            parts = [(p.trace, p.trace_phase_s, p.nodes), *p.zones]
            if not spot_driven:
                i = 0
                for zone, (_, _, nodes) in enumerate(parts):
                    for index in range(nodes):
                        name = f"{p.cluster}-{p.flavor}-{i:03d}"
                        self._place(p, zone, index, name)
                        cluster.add_node(name, p.flavor)
                        i += 1
                continue
            for zone, (trace, phase, nodes) in enumerate(parts):
                pool = SpotPool(p, [Slot(i) for i in range(nodes)], zone, trace, phase)
                self.spot_pools.append(pool)
                if self.cfg.spot == "poisson" or trace is None:
                    for slot in pool.slots:
                        self._slot_up(pool, slot)
                    self._next_poisson(pool)
                else:
                    self._schedule_trace(pool)

    def capacity_spans(self) -> list[tuple[tuple[str, str], int, float, float]]:
        """Every node's ((cluster, flavor), GPUs, up, gone) in seconds from the start: the
        capacity that was really there, for the hindsight bound (load/oracle.py)."""
        return [
            (self.node_home[name], NODE_GPUS, up - self.base, gone - self.base)
            for name, (up, gone) in self.node_spans.items()
        ]

    def _slot_up(self, pool: SpotPool, slot: Slot) -> None:
        slot.generation += 1
        p = pool.spec
        zone = f"z{pool.zone}-" if pool.zone else ""
        name = f"{p.cluster}-{p.flavor}-{zone}{slot.index:03d}-g{slot.generation}"
        slot.node = name
        self._place(p, pool.zone, slot.index, name)
        self.clusters[p.cluster].add_node(name, p.flavor)

    def _place(self, p: PoolSpec, zone: int, index: int, name: str) -> None:
        """Where a node sits: its pool's zone and, where the pool declares blocks of
        `block_nodes`, its block (slot `index` of the zone)."""
        block = f"z{zone}-b{index // p.block_nodes}" if p.block_nodes else ""
        self.node_place[name] = (f"z{zone}", block)

    def note_span(self, log: AttemptLog, nodes: set[str]) -> None:
        """The zones and blocks an attempt's GPU nodes span (what the report's shares read)."""
        places = [self.node_place.get(n, ("", "")) for n in nodes]
        log.gpu_nodes = len(places)
        log.zones = len({z for z, _ in places})
        log.blocks = len({(z, b) for z, b in places}) if all(b for _, b in places) else 0

    def _schedule_trace(self, pool: SpotPool) -> None:
        """Loop the spot trace over the horizon; the state at the phase is the start."""
        assert pool.trace is not None
        path = self._trace_path(pool.trace)
        events, length_ms = cached_trace(traces.require_trace(path.name, path.parent))
        if not events:
            return
        period, phase = self._trace_loop(pool.trace, events, length_ms, pool.phase_s)
        horizon = (self.jobs[-1].arrival if self.jobs else 0.0) + self.cfg.drain_s
        loops = min(1000, int((phase + horizon) / period) + 1)
        for loop in range(loops):
            for e in events:
                pool_t = loop * period + e.seconds
                if pool_t <= phase:
                    self._trace_apply(pool, loop, e, announce=False)
                elif pool_t - phase <= horizon:
                    self.push(self.base + pool_t - phase, SPOT_TRACE, (pool, loop, e))

    def _trace_loop(
        self, name: str, events: list[TraceEvent], length_ms: int | None, phase_s: float
    ) -> tuple[float, float]:
        """(period, phase) of a looped trace: its own length when it records one, and the
        pool's phase plus the run's (`trace_phase_s`, `trace_phase_frac`)."""
        declared = dict(self.cfg.trace_lengths).get(name)
        if declared is None and length_ms is not None:
            declared = length_ms / 1000.0  # a count per tick: the trace's own length
        period = traces.trace_period_s([e.seconds for e in events], declared)
        phase = (phase_s + self.cfg.trace_phase_s + self.cfg.trace_phase_frac * period) % period
        return period, phase

    def available(self, spec: AutoscaleSpec, now: float) -> int | None:
        """How many nodes the pool's availability trace grants at `now` (looped, from its
        phase), or None when the pool has no trace (no cap)."""
        if spec.trace is None:
            return None
        path = self._trace_path(spec.trace)
        path = traces.require_trace(path.name, path.parent)
        events, length_ms = cached_trace(path)
        if not events:
            return 0
        period, phase = self._trace_loop(spec.trace, events, length_ms, spec.trace_phase_s)
        times, counts = availability(path)
        at = (phase + now - self.base) % period
        i = bisect.bisect_right(times, at) - 1
        return counts[i] if i >= 0 else 0

    def _trace_path(self, trace: str) -> Path:
        """A short name (`p3`) is bamboo-p3.csv in the traces folder; else a file path
        (relative: from the traces folder)."""
        if "/" in trace or trace.endswith((".csv", ".json")):
            path = Path(trace)
            return path if path.is_absolute() else self.cfg.traces / path
        return self.cfg.traces / f"bamboo-{trace}.csv"

    def _trace_apply(self, pool: SpotPool, loop: int, e: TraceEvent, *, announce: bool) -> None:
        if loop != pool.loop:
            # A new pass over the trace: nodes still up are re-bound to its first adds.
            pool.loop = loop
            pool.carry = [s.index for s in pool.slots if s.node is not None]
            pool.bound = {}
            for s in pool.slots:
                s.key = None
        key = (loop, e.node)
        if e.op == "add":
            if key in pool.bound:
                return
            if pool.carry:
                idx = pool.carry.pop(0)
                pool.bound[key] = idx
                pool.slots[idx].key = key
                return
            free = next((s for s in pool.slots if s.node is None), None)
            if free is None:
                return  # the pool is smaller than the trace's fleet: this node is not ours
            pool.bound[key] = free.index
            free.key = key
            self._slot_up(pool, free)
            return
        if key not in pool.bound:
            return
        slot = pool.slots[pool.bound.pop(key)]
        slot.key = None
        if slot.node is None:
            return
        if not announce:  # before the start: the first snapshot will not have it
            self.clusters[pool.spec.cluster].remove_node(slot.node, reason="node-removed")
            slot.node = None
            return
        self._notice(pool, slot)

    def _notice(self, pool: SpotPool, slot: Slot) -> None:
        """A reclaim: notice now, node gone at the deadline; the slot is busy until then."""
        assert slot.node is not None
        cluster = self.clusters[pool.spec.cluster]
        node = cluster.model.node_state(slot.node)
        if node is None or node.spot_deadline is not None:
            return
        for key in node.workloads:
            log = cluster.live.get(key)
            if log is not None and log.noticed_at is None:
                log.noticed_at = self.now
        lead = NOTICE_S.get(pool.spec.provider, 120.0)
        deadline = self.now + lead
        cluster.model.spot_notice(slot.node, lead)
        self.spot_notices += 1
        self.notice_log.append((self.now - self.base, slot.node))
        self.push(deadline, RECLAIM, (pool, slot, slot.node))

    def _next_poisson(self, pool: SpotPool) -> None:
        """Reclaim instants at rate x slots; each takes 1-4 live nodes at once (Bamboo-like)."""
        mean_group = 2.0
        rate_per_s = self.cfg.poisson_rate * len(pool.slots) / mean_group / 3600.0
        if rate_per_s <= 0:
            return
        self.push(self.now + self.spot_rng.expovariate(rate_per_s), POISSON, pool)

    def _poisson(self, pool: SpotPool) -> None:
        live = [s for s in pool.slots if s.node is not None]
        k = min(len(live), self.spot_rng.choice((1, 1, 2, 4)))
        for slot in self.spot_rng.sample(live, k):
            self._notice(pool, slot)
        self._next_poisson(pool)
