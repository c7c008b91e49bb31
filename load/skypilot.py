"""SkyPilot's managed-job recovery, as the simulator's `skypilot-like` baselines model it.

Followed from SkyPilot's source (github.com/skypilot-org/skypilot, Apache-2.0), master as of
commit 027bbcdb3c4c8b6ab5510ee9163a05e6a8193a8f (the v0.10/0.11 line):

- `sky/jobs/recovery_strategy.py`: `EAGER_NEXT_REGION` is the default strategy. On a
  preemption it tears the cluster down and relaunches with the previous cloud/region blocked
  (`task.blocked_resources`, one `_launch` of at most 3 tries), then, if that fails, retries
  forever with nothing blocked. `FAILOVER` first relaunches in the same region, then anywhere.
  Launch retries back off from `RETRY_INIT_GAP_SECONDS = 60` (`common_utils.Backoff`: x1.6 per
  retry, capped at 5x the first).
- `sky/jobs/utils.py`: the controller polls its job every `JOB_STATUS_CHECK_GAP_SECONDS = 15`;
  a preemption is found by that poll (SkyPilot does not act on the provider's notice).
- The optimizer places by price: the cheapest feasible resources first, failing over to the
  next ones when a launch finds no capacity. There is no "N preemptions without progress" rule,
  no fall back to on-demand after waiting or after preemptions, and no move back to spot.
- Every (re)launch provisions a fresh VM and runs setup before the job starts; no warm pool.

How that maps onto the simulator, which drives Muster's own core with these settings:

- placement by price alone: `scheduling.risk_weight = 0` (no reclaim-risk term);
- `EAGER_NEXT_REGION`: the pool that lost the job is avoided for `EAGER_BLOCK_S`, the 60 s and
  96 s backoff gaps between the blocked launch's 3 tries; after that any pool, the same one
  included. (Muster avoids the lost pool, not its whole cluster: in the simulated fleets
  each cluster has one spot pool per GPU type, so blocking the region would also block its
  on-demand pools.) `FAILOVER`: nothing avoided, so the cheapest pool with room is taken, the
  lost one first when it still has room;
- spot-then-on-demand jobs take on-demand as soon as no spot fits (`fallback_after_wait_s = 0`:
  the optimizer's failover to the next-cheapest resources), never after a count of
  preemptions, and spot-only jobs retry for ever (`max_preemptions_without_progress = None`);
- each attempt's start-up adds a VM's provisioning and setup, drawn per attempt from
  `PROVISION_S`. This range is an assumption (GPU VMs boot in minutes; SkyPilot's source does
  not state a figure), and the GPUs are paid from the dispatch on;
- the start timeout allows for it (`timeouts.image_pull_s`), so provisioning is never taken for
  a failed start.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from schemas.config import BrokerConfig
from schemas.job import SpotPolicy

SOURCE = (
    "skypilot-org/skypilot @ 027bbcdb3c4c8b6ab5510ee9163a05e6a8193a8f: "
    "sky/jobs/recovery_strategy.py, sky/jobs/utils.py (Apache-2.0)"
)
JOB_STATUS_CHECK_GAP_S = 15.0  # sky/jobs/utils.py JOB_STATUS_CHECK_GAP_SECONDS
RETRY_INIT_GAP_S = 60.0  # StrategyExecutor.RETRY_INIT_GAP_SECONDS
BACKOFF_MULTIPLIER = 1.6  # common_utils.Backoff.MULTIPLIER
BLOCKED_LAUNCH_TRIES = 3  # EagerFailoverStrategyExecutor.recover: _launch(max_retry=3)
# The gaps between the blocked launch's tries: 60 s, then 96 s.
EAGER_BLOCK_S = sum(
    RETRY_INIT_GAP_S * BACKOFF_MULTIPLIER**i for i in range(BLOCKED_LAUNCH_TRIES - 1)
)
PROVISION_S = (180.0, 480.0)  # a fresh GPU VM plus SkyPilot's setup (an assumption)


@dataclass(frozen=True, slots=True)
class Recovery:
    """One of SkyPilot's managed-job recovery strategies."""

    name: str  # as in the task YAML's `job_recovery`
    avoid_lost_pool_s: float


STRATEGIES: dict[str, Recovery] = {
    "EAGER_NEXT_REGION": Recovery("EAGER_NEXT_REGION", EAGER_BLOCK_S),
    "FAILOVER": Recovery("FAILOVER", 0.0),
}

# What a managed job has instead of Muster's spot rules: no fallback after waiting or after
# preemptions beyond the optimizer's failover, and no give-up rule.
SPOT_POLICY = SpotPolicy(
    fallback_after_preemptions=1000,
    fallback_after_wait_s=0.0,
    max_preemptions_without_progress=None,
)


def broker_config(base: BrokerConfig, strategy: str) -> BrokerConfig:
    """The broker's settings that make its placement and recovery SkyPilot's."""
    recovery = STRATEGIES[strategy]
    scheduling = msgspec.structs.replace(
        base.scheduling, risk_weight=0.0, avoid_lost_pool_s=recovery.avoid_lost_pool_s
    )
    timeouts = msgspec.structs.replace(
        base.timeouts, image_pull_s=base.timeouts.image_pull_s + PROVISION_S[1]
    )
    return msgspec.structs.replace(base, scheduling=scheduling, timeouts=timeouts)
