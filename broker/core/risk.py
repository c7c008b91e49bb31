"""Spot risk: each pool's interruption rate and the expected cost of running a gang there.

Rate model (per node-hour). Every pool keeps two exponentially decayed sums with half-life
`scheduling.rate_half_life_s`: notices N and exposure H (node-hours). The rate is the mean of a
gamma-Poisson posterior whose prior is worth `PRIOR_NODE_HOURS` of history at the configured
prior rate (`scheduling.spot_prior_rate` for spot pools, 0 for on-demand ones):

    rate = (N + prior * W) / (H + W),   W = PRIOR_NODE_HOURS

so a new pool reports the prior and a pool with long history reports what it observed. Old
events fade, so a pool that calmed down is trusted again.

Cost model (dollars per hour of useful progress), for a gang of G GPUs spread over k nodes of a
pool, reclaimed at `lam = rate * k` per hour (how often some node of the gang is reclaimed):

    cost = price * G * (1 + risk_weight * (redo - 1))

`redo` is the hours a gang runs per hour of progress it keeps. A job that checkpoints every I
hours keeps a segment's work only when the whole gang survives to the segment's checkpoint:
each node survives I hours with chance exp(-rate * I), the gang with (exp(-rate * I)) ** k =
exp(-x), x = lam * I, and a lost segment is run again from its start. The expected time to get
one segment through is then (exp(x) - 1) / lam (the renewal argument of Daly, "A higher
order estimate of the optimum checkpoint interval for restart dumps", FGCS 2006: a segment's
expected wall time M * exp(R / M) * (exp((tau + delta) / M) - 1), here with the restart R and
the dump delta folded into the interval), so

    redo = (exp(x) - 1) / x  =  1 + x / 2 + x**2 / 6 + ...

To first order that is 1 + lam * I / 2, a loss of half an interval per reclaim, the linear
model this replaced; the higher terms price a big gang on a pool where it rarely reaches a
checkpoint (x = 1: 1.72 against 1.5; x = 3: 6.4 against 2.5), so it prefers a pool where it
does, or a cheaper-looking pool loses to one with fewer reclaims. Pools of equal gang rate
keep the same factor, so their order is price (per unit of work) alone, as before. The
interval a request carries already includes twice the job's restart overhead (restore +
start-up + checkpoint at the move, records.py), so a segment covers what a restart costs
too. Without checkpoints a reclaim loses the whole run so far; under a memoryless reclaim
process that is about 1 / lam hours, capped at `NO_CHECKPOINT_LOSS_H` (the run so far of a
typical un-checkpointed job): redo = 1 + lam * min(NO_CHECKPOINT_LOSS_H, 1 / lam).

Correlated reclaims. A provider reclaims spot capacity of one zone in bursts: one event takes
several nodes at once. Notices of one pool and zone within `BURST_WINDOW_S` of the event's first
one count as one event; the pool keeps a decayed event count E beside N, and its burst size is

    B = (N + PRIOR_EVENTS) / (E + PRIOR_EVENTS)    (1 = independent reclaims, the prior)

Events of a zone of n pool nodes come at rate * n / B per hour, each taking B of them, so a gang
with k of those nodes is hit by one at rate * n / B * (1 - (1 - k / n) ** B): k * rate when
B = 1, down to rate * n / B when one event takes the whole zone. Zones are reclaimed
independently, so the gang's rate is the sum over the zones it spans: a gang kept within one
zone is interrupted once by a burst that takes several of its nodes, one spread over two zones
by each zone's bursts (`gang_reclaim_rate`). Before the nodes are chosen (ranking pools), the
gang's rate is the independent bound `rate * k`; the placement's expected cost uses its zones.

Checkpoint advice (Young/Daly): the interval that minimises checkpoint stalls plus lost work
is sqrt(2 * C * MTBF) for a checkpoint cost C and a mean time between losses MTBF. A notice
whose window fits the checkpoint loses nothing since the last periodic checkpoint, so the
losses that count are the gang's reclaim rate times the share of notices whose checkpoint
cannot land in the pool's observed notice window (all of them when the window is too short
or not seen yet, `NOTICE_MISS` when it fits).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

PRIOR_NODE_HOURS = 24.0
# Share of notices whose checkpoint is lost even though the window fits (a write slower than
# measured, a node that goes early). An assumption, not learned: it keeps advice finite.
NOTICE_MISS = 0.1
NOTICE_MARGIN_S = 10.0  # a notice checkpoint must fit the window with this much to spare
MIN_ADVISED_S = 60.0
MAX_ADVISED_S = 4 * 3600.0
NO_CHECKPOINT_LOSS_H = 2.0
BURST_WINDOW_S = 60.0  # notices of one pool and zone this soon after an event's first: same event
PRIOR_EVENTS = 2.0  # events of one node each that the burst size starts from
MAX_EXPONENT = 30.0  # lam * I beyond this prices the same (a segment that never lands)
_LN2 = math.log(2.0)


@dataclass(slots=True)
class PoolRisk:
    """Decayed interruption statistics of one (cluster, flavor) pool."""

    spot: bool
    notices: float = 0.0  # decayed count
    exposure_h: float = 0.0  # decayed node-hours
    nodes: int = 0
    updated: float | None = None
    total_notices: int = 0  # undecayed, for views
    events: float = 0.0  # decayed count of reclaim events (a zone's burst of notices is one)
    event_start: dict[str, float] = field(default_factory=dict)  # zone -> its last event's start

    def _project(self, now: float, half_life_s: float) -> tuple[float, float]:
        if self.updated is None or now <= self.updated:
            return self.notices, self.exposure_h
        k = _LN2 / half_life_s
        dt = now - self.updated
        f = math.exp(-k * dt)
        exposure = self.exposure_h * f + self.nodes * (1.0 - f) / k / 3600.0
        return self.notices * f, exposure

    def advance(self, now: float, half_life_s: float) -> None:
        """Accrue exposure at the current node count up to `now`."""
        if self.updated is not None and now > self.updated and self.events:
            self.events *= math.exp(-_LN2 / half_life_s * (now - self.updated))
        self.notices, self.exposure_h = self._project(now, half_life_s)
        if self.updated is None or now > self.updated:
            self.updated = now

    def set_nodes(self, nodes: int, now: float, half_life_s: float) -> None:
        self.advance(now, half_life_s)
        self.nodes = nodes

    def record_notice(self, now: float, half_life_s: float, zone: str = "") -> None:
        self.advance(now, half_life_s)
        self.notices += 1.0
        self.total_notices += 1
        start = self.event_start.get(zone)
        if start is None or not 0.0 <= now - start <= BURST_WINDOW_S:
            self.events += 1.0
            self.event_start[zone] = now

    def burst(self) -> float:
        """Nodes one reclaim event takes, on average (1 until bursts are seen; see above)."""
        return (self.notices + PRIOR_EVENTS) / (self.events + PRIOR_EVENTS)

    def rate(self, now: float, half_life_s: float, spot_prior: float) -> float:
        notices, exposure = self._project(now, half_life_s)
        prior = spot_prior if self.spot else 0.0
        return (notices + prior * PRIOR_NODE_HOURS) / (exposure + PRIOR_NODE_HOURS)


def loss_hours(checkpoint_interval_s: float | None, gang_rate_per_h: float) -> float:
    """Expected hours of work lost per interruption, to first order (see module docstring)."""
    if checkpoint_interval_s is not None and checkpoint_interval_s > 0:
        return checkpoint_interval_s / 2.0 / 3600.0
    if gang_rate_per_h <= 0.0:
        return NO_CHECKPOINT_LOSS_H
    return min(NO_CHECKPOINT_LOSS_H, 1.0 / gang_rate_per_h)


def checkpoint_survival(checkpoint_interval_s: float | None, gang_rate_per_h: float) -> float:
    """Chance that no node of the gang is reclaimed before its next checkpoint (a segment of
    the priced interval): the per-node survival to the power of its nodes. 0 without
    checkpoints and a positive rate (no segment is ever kept)."""
    if checkpoint_interval_s is None or checkpoint_interval_s <= 0:
        return 1.0 if gang_rate_per_h <= 0.0 else 0.0
    return math.exp(-gang_rate_per_h * checkpoint_interval_s / 3600.0)


def redo_factor(checkpoint_interval_s: float | None, gang_rate_per_h: float) -> float:
    """Hours run per hour of progress kept, redone segments included (module docstring)."""
    if gang_rate_per_h <= 0.0:
        return 1.0
    if checkpoint_interval_s is None or checkpoint_interval_s <= 0:
        return 1.0 + gang_rate_per_h * loss_hours(None, gang_rate_per_h)
    x = min(gang_rate_per_h * checkpoint_interval_s / 3600.0, MAX_EXPONENT)
    return math.expm1(x) / x


def expected_cost_per_hour(
    price_per_gpu_hour: float,
    gpus: int,
    rate_per_node_hour: float,
    nodes: int,
    checkpoint_interval_s: float | None,
    risk_weight: float,
) -> float:
    """Price plus the expected value of work redone after interruptions, per hour of progress
    (reclaims of the gang's nodes taken as independent: the bound before its nodes are known)."""
    return gang_cost_per_hour(
        price_per_gpu_hour,
        gpus,
        rate_per_node_hour * max(1, nodes),
        checkpoint_interval_s,
        risk_weight,
    )


def gang_cost_per_hour(
    price_per_gpu_hour: float,
    gpus: int,
    gang_rate_per_h: float,
    checkpoint_interval_s: float | None,
    risk_weight: float,
) -> float:
    """Price plus the expected value of work redone at `gang_rate_per_h` interruptions an hour."""
    redo = redo_factor(checkpoint_interval_s, gang_rate_per_h)
    return price_per_gpu_hour * gpus * (1.0 + risk_weight * (redo - 1.0))


def gang_reclaim_rate(
    rate_per_node_hour: float, zones: Iterable[tuple[int, int]], burst: float
) -> float:
    """How often per hour a reclaim event hits some node of a gang that has, per zone, k of
    the pool's n nodes there (`zones`: (k, n) pairs); see "Correlated reclaims" above."""
    total = 0.0
    for k, n in zones:
        b = min(burst, float(n))
        if b <= 1.0 or k >= n:
            total += rate_per_node_hour * (k if b <= 1.0 else n / b)
        else:
            total += rate_per_node_hour * n / b * (1.0 - (1.0 - k / n) ** b)
    return total


def unsaved_share(cost_s: float, window_s: float | None) -> float:
    """Share of reclaims that lose the work since the last periodic checkpoint."""
    if window_s is None or cost_s + NOTICE_MARGIN_S > window_s:
        return 1.0
    return NOTICE_MISS


def young_daly_s(cost_s: float, loss_rate_per_h: float) -> float:
    """sqrt(2 * C * MTBF), kept within [MIN_ADVISED_S, MAX_ADVISED_S]."""
    if loss_rate_per_h <= 0.0:
        return MAX_ADVISED_S
    mtbf_s = 3600.0 / loss_rate_per_h
    return min(MAX_ADVISED_S, max(MIN_ADVISED_S, math.sqrt(2.0 * cost_s * mtbf_s)))


class NoticeWindows:
    """The notice window each pool last gave (deadline - notice time), learned from notices:
    AWS gives 120 s, GCP and Azure 30 s, and a provider may change it."""

    def __init__(self) -> None:
        self._windows: dict[tuple[str, str], float] = {}

    def observe(self, pool: tuple[str, str], window_s: float) -> None:
        if window_s >= 0.0:
            self._windows[pool] = window_s

    def get(self, pool: tuple[str, str]) -> float | None:
        return self._windows.get(pool)
