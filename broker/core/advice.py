"""Checkpoint-interval advice: the Young/Daly interval for the pool an attempt runs on.

The broker knows what the workload does not: how often the pool is reclaimed (risk.py's
learned rate) and how long its notices are (risk.NoticeWindows). With the job's measured
checkpoint cost it advises sqrt(2 * C * MTBF) per attempt; the agent passes it to the
workload as `MUSTER_CHECKPOINT_INTERVAL_S` and the SDK as `advised_interval_s()`. Each new
attempt gets the advice for its own pool, so the advice changes when the job moves.
"""

from __future__ import annotations

from broker.core.risk import unsaved_share, young_daly_s
from schemas.job import JobSpec


def advised_interval_s(
    spec: JobSpec, rate_per_node_hour: float, nodes: int, window_s: float | None
) -> float | None:
    """The interval for a gang of `nodes` nodes on a pool with this reclaim rate and notice
    window; None when the job does not checkpoint or did not say what a checkpoint costs."""
    ck = spec.checkpoint
    if ck is None or ck.cost_s is None:
        return None
    loss_rate = rate_per_node_hour * max(1, nodes) * unsaved_share(ck.cost_s, window_s)
    return round(young_daly_s(ck.cost_s, loss_rate), 1)
