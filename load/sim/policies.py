"""The recovery policies the simulator compares: each changes only what the workloads and
job specs do with checkpoints and spot, so the broker under test is the same code every time."""

from __future__ import annotations

from dataclasses import dataclass

from load import skypilot
from schemas.job import (
    CapacityPreference,
)


# ------------------------------------------------------------------------------ policies
@dataclass(frozen=True, slots=True)
class Policy:
    """What a policy changes: only the workloads' use of checkpoints and the spot preference."""

    name: str
    checkpoints: bool  # specs carry a checkpoint location, workloads write checkpoints
    resume: bool  # a new attempt starts from `Dispatch.resume_from`
    capacity_map: tuple[tuple[str, CapacityPreference], ...] = ()
    about: str = ""
    notices: bool = True  # the broker sees spot notices (else only the node's loss)
    detect_s: float = 0.0  # the loss of a node reaches the broker this late (polling)
    on_demand_only: bool = False  # spot slots are on-demand nodes at the on-demand price
    # Hindsight: the workload knew each reclaim was coming, so it writes no periodic
    # checkpoints and its checkpoint at the notice is already written (costs nothing).
    foresight: bool = False
    # The workloads checkpoint at the broker's advised interval (Dispatch.checkpoint_interval_s,
    # MUSTER_CHECKPOINT_INTERVAL_S) instead of their own.
    follows_advice: bool = False
    spot_return: bool = True  # the broker moves on-demand jobs back to spot when it pays
    # the broker moves flexible jobs off spot to on-demand for a waiting spot-only job
    spot_yield: bool = True
    # Multi-replica jobs are elastic (`PodSet.max_replicas`: down to half their replicas):
    # admitted at what fits, shrunk in place on a reclaim when that beats a move, grown back.
    elastic: bool = False
    # SkyPilot's managed-job recovery (load/skypilot.py): the strategy's name; price-ranked
    # placement, no Muster spot rules, a fresh VM provisioned for every attempt.
    skypilot: str | None = None


POLICIES: dict[str, Policy] = {
    "muster": Policy(
        "muster",
        True,
        True,
        about="checkpoint-aware re-dispatch, make-before-break, Young/Daly advice followed, "
        "spot-return, spot yielded to waiting spot-only jobs",
        follows_advice=True,
    ),
    "muster-fixed": Policy(
        "muster-fixed",
        True,
        True,
        about="muster, but workloads keep their own 10 min interval (no advice)",
    ),
    "muster-no-return": Policy(
        "muster-no-return",
        True,
        True,
        about="muster, but jobs that fell back to on-demand stay there",
        follows_advice=True,
        spot_return=False,
    ),
    "scratch": Policy(
        "scratch",
        False,
        False,
        about="restart preempted jobs from step 0 (SkyPilot default, Armada resubmit)",
        spot_return=False,
        spot_yield=False,
    ),
    "spot-only": Policy(
        "spot-only",
        True,
        True,
        (("spot-then-on-demand", "spot"),),
        about="muster, but spot-then-on-demand jobs never fall back",
        follows_advice=True,
    ),
    "fallback": Policy(
        "fallback",
        True,
        True,
        (("spot", "spot-then-on-demand"),),
        about="muster, but spot-only jobs may fall back to on-demand",
        follows_advice=True,
    ),
    "on-demand-only": Policy(
        "on-demand-only",
        True,
        True,
        (("spot", "any"), ("spot-then-on-demand", "any")),
        about="every spot slot is an on-demand node at the on-demand price; nothing is reclaimed",
        on_demand_only=True,
    ),
    "checkpoint-restart": Policy(
        "checkpoint-restart",
        True,
        True,
        about="periodic checkpoints; the broker never sees the notice, only the node's loss",
        notices=False,
        spot_return=False,
        spot_yield=False,
    ),
    "skypilot-like": Policy(
        "skypilot-like",
        True,
        True,
        about="SkyPilot managed jobs, EAGER_NEXT_REGION (load/skypilot.py): no notice, the loss "
        "found by a 15 s poll, relaunched on a fresh VM (minutes) away from the lost pool, "
        "placed by price, resumed from the job's own last checkpoint",
        notices=False,
        detect_s=skypilot.JOB_STATUS_CHECK_GAP_S,
        spot_return=False,
        spot_yield=False,
        skypilot="EAGER_NEXT_REGION",
    ),
    "skypilot-failover": Policy(
        "skypilot-failover",
        True,
        True,
        about="skypilot-like with SkyPilot's FAILOVER recovery: the lost pool is not avoided",
        notices=False,
        detect_s=skypilot.JOB_STATUS_CHECK_GAP_S,
        spot_return=False,
        spot_yield=False,
        skypilot="FAILOVER",
    ),
    "elastic": Policy(
        "elastic",
        True,
        True,
        about="muster, with every multi-replica job elastic between half its replicas and "
        "all of them (speed: linear scaling at 90% efficiency)",
        follows_advice=True,
        elastic=True,
    ),
    "foresight": Policy(
        "foresight",
        True,
        True,
        (("spot", "any"), ("spot-then-on-demand", "any"), ("on-demand", "any")),
        about="Muster's placement with foresight: each workload knew its reclaims in advance, "
        "writes no periodic checkpoints and has its checkpoint ready at every notice; every "
        "job may use any pool. A policy, not a bound (load/oracle.py computes the bound)",
        foresight=True,
    ),
}
BASELINES = ("on-demand-only", "spot-only", "checkpoint-restart", "scratch", "skypilot-like")

COMPARISON = (*BASELINES, "muster")  # each run also gets its hindsight bound (load/oracle.py)
ABLATIONS = ("muster-fixed", "muster-no-return")  # muster without one of its policies
EXTENSIONS = ("elastic",)  # muster with more of the job's cooperation
