"""Spot policies that read a job's record and decide; the machine calls them from small hooks.

Give up on spot without progress: a job preempted on spot again and again without writing a
new checkpoint burns GPU-hours forever (a long job that never checkpoints is the usual case).
After `spec.spot.max_preemptions_without_progress` such losses in a row, a
`spot-then-on-demand` job falls back to on-demand at once and a `spot`-only job fails with a
reason that says why and what to change. `any` and `on-demand` jobs are left alone (the
former may already run on on-demand; its budget is `restart.max_preemptions`).
"""

from __future__ import annotations

from typing import Literal

from broker.core.records import JobRecord

Verdict = Literal["fall-back", "fail"]


def spot_losses_without_progress(record: JobRecord) -> int:
    """Spot attempts lost since the newest checkpoint was written (all of them if none)."""
    ckpt = record.latest_checkpoint
    since = ckpt.attempt if ckpt is not None else 0
    return sum(
        1
        for a in record.attempts
        if a.attempt > since
        and a.ended_at is not None
        and a.capacity_type == "spot"
        and a.end_cause != "succeeded"
    )


def no_progress_verdict(record: JobRecord) -> Verdict | None:
    """What to do after a spot loss, or None to keep trying spot."""
    spec = record.spec
    limit = spec.spot.max_preemptions_without_progress
    if limit is None or spec.capacity not in ("spot", "spot-then-on-demand"):
        return None
    if spot_losses_without_progress(record) < limit:
        return None
    return "fall-back" if spec.capacity == "spot-then-on-demand" else "fail"


def no_progress_reason(record: JobRecord) -> str:
    n = spot_losses_without_progress(record)
    return (
        f"no progress on spot: {n} spot preemptions in a row without a new checkpoint "
        f"(spot.max_preemptions_without_progress="
        f"{record.spec.spot.max_preemptions_without_progress}); write checkpoints more often, "
        "raise the limit, or use capacity spot-then-on-demand"
    )
