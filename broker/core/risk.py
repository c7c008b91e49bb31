"""Spot risk: each pool's interruption rate and the expected cost of running a gang there.

Rate model (per node-hour). Every pool keeps two exponentially decayed sums with half-life
`scheduling.rate_half_life_s`: notices N and exposure H (node-hours). The rate is the mean of a
gamma-Poisson posterior whose prior is worth `PRIOR_NODE_HOURS` of history at the configured
prior rate (`scheduling.spot_prior_rate` for spot pools, 0 for on-demand ones):

    rate = (N + prior * W) / (H + W),   W = PRIOR_NODE_HOURS

so a new pool reports the prior and a pool with long history reports what it observed. Old
events fade, so a pool that calmed down is trusted again.

Cost model (dollars per hour), for a gang of G GPUs spread over k nodes of a pool:

    cost = price * G * (1 + risk_weight * rate * k * L)

`rate * k` is how often per hour some node of the gang is reclaimed, and each reclaim loses about
L hours of all G GPUs' work, valued at the pool's price. L is half the checkpoint interval when
the job checkpoints. Without checkpoints a reclaim loses the whole run so far; under a
memoryless reclaim process that is about 1 / (rate * k) hours, capped at
`NO_CHECKPOINT_LOSS_H` (the run so far of a typical un-checkpointed job).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PRIOR_NODE_HOURS = 24.0
NO_CHECKPOINT_LOSS_H = 2.0
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
        self.notices, self.exposure_h = self._project(now, half_life_s)
        if self.updated is None or now > self.updated:
            self.updated = now

    def set_nodes(self, nodes: int, now: float, half_life_s: float) -> None:
        self.advance(now, half_life_s)
        self.nodes = nodes

    def record_notice(self, now: float, half_life_s: float) -> None:
        self.advance(now, half_life_s)
        self.notices += 1.0
        self.total_notices += 1

    def rate(self, now: float, half_life_s: float, spot_prior: float) -> float:
        notices, exposure = self._project(now, half_life_s)
        prior = spot_prior if self.spot else 0.0
        return (notices + prior * PRIOR_NODE_HOURS) / (exposure + PRIOR_NODE_HOURS)


def loss_hours(checkpoint_interval_s: float | None, gang_rate_per_h: float) -> float:
    """Expected hours of work lost per interruption (see module docstring)."""
    if checkpoint_interval_s is not None and checkpoint_interval_s > 0:
        return checkpoint_interval_s / 2.0 / 3600.0
    if gang_rate_per_h <= 0.0:
        return NO_CHECKPOINT_LOSS_H
    return min(NO_CHECKPOINT_LOSS_H, 1.0 / gang_rate_per_h)


def expected_cost_per_hour(
    price_per_gpu_hour: float,
    gpus: int,
    rate_per_node_hour: float,
    nodes: int,
    checkpoint_interval_s: float | None,
    risk_weight: float,
) -> float:
    """Price plus the expected value of work lost to interruptions, per hour."""
    gang_rate = rate_per_node_hour * max(1, nodes)
    lost = loss_hours(checkpoint_interval_s, gang_rate)
    return price_per_gpu_hour * gpus * (1.0 + risk_weight * gang_rate * lost)
