"""A job's speed per GPU type, learned from its own checkpoint step rates.

Placement prices work, not GPU-hours (Gavel's heterogeneity-aware policies: Narayanan et al.,
"Heterogeneity-Aware Cluster Scheduling Policies for Deep Learning Workloads", OSDI 2020,
normalise every allocation by the job's throughput on each accelerator type). A pool's expected
cost per hour is divided by the job's relative speed on the pool's GPU type, so a T4 that runs
a job at a third of a V100's pace costs three times its price per unit of work.

Where a speed comes from, first that applies:
1. the job's declared figures (`spec.gpu_speeds`, relative: only their ratios matter);
2. its measured step rates: steps between two checkpoint reports of one attempt over the time
   between them (the first report of an attempt only anchors, so restore and start-up never
   count), summed per GPU type in the job record (one small entry per GPU type it ran on,
   dropped with the record's other bulk when the job ends);
3. the broker's prior per GPU type (`scheduling.gpu_speeds`, defaults
   `schemas.config.DEFAULT_GPU_SPEEDS`; a type it does not list runs at
   `UNKNOWN_SPEED`).
A job's own figures carry information only about ratios between GPU types, so they count once
they cover two types; each is then mapped onto the prior's scale (their sum over the covered
types equals the priors' sum there) and types the job never ran on keep the prior.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import msgspec

UNKNOWN_SPEED = 1.0
# A measured rate counts once this many seconds of one attempt's steps back it.
MIN_MEASURED_S = 120.0
MAX_TYPES = 8  # GPU types whose rates a record keeps (the ones measured longest stay)
# Figures are rounded to steps of this ratio (about 5 %) so that jobs alike share the
# scheduler's per-shape caches and noise does not reorder pools.
_QUANTUM = math.log(1.05)

Figures = tuple[tuple[str, float], ...]
Anchor = tuple[int, int, float]  # (attempt, step, at) of the latest checkpoint


class GpuRate(msgspec.Struct, array_like=True):
    """Steps a job made on one GPU type and the seconds they took (job record, persisted)."""

    gpu_type: str
    steps: float
    seconds: float


def observe(
    rates: list[GpuRate], last: Anchor | None, attempt: int, gpu_type: str, step: int, now: float
) -> None:
    """A checkpoint at `step` of attempt `attempt` (on `gpu_type`) lands at `now`; `last` is
    the job's latest checkpoint before it. Adds the steps since that one to the GPU type's
    rate when both belong to the attempt (so restore and start-up never count)."""
    gpu_type = gpu_type.lower()
    if last is None or last[0] != attempt or not gpu_type:
        return
    steps, secs = step - last[1], now - last[2]
    if steps <= 0 or secs <= 0:
        return
    for r in rates:
        if r.gpu_type == gpu_type:
            r.steps += steps
            r.seconds += secs
            return
    rates.append(GpuRate(gpu_type, float(steps), secs))
    if len(rates) > MAX_TYPES:
        rates.sort(key=lambda r: -r.seconds)
        del rates[MAX_TYPES:]


def job_figures(declared: Mapping[str, float], rates: Sequence[GpuRate]) -> Figures:
    """The job's own relative speeds by GPU type (declared, else measured), normalised to
    the fastest and rounded; empty when they cover fewer than two types."""
    if declared:
        raw = {t.lower(): v for t, v in declared.items()}
    else:
        raw = {r.gpu_type: r.steps / r.seconds for r in rates if r.seconds >= MIN_MEASURED_S}
    if len(raw) < 2:
        return ()
    top = max(raw.values())
    return tuple(sorted((t, _round(v / top)) for t, v in raw.items()))


def _round(x: float) -> float:
    return math.exp(round(math.log(x) / _QUANTUM) * _QUANTUM)


def speed_of(figures: Figures, priors: Mapping[str, float]) -> Callable[[str], float]:
    """The job's relative speed on a GPU type, on the priors' scale."""
    if not figures:
        return lambda gpu_type: priors.get(gpu_type, UNKNOWN_SPEED)
    own = dict(figures)
    scale = sum(priors.get(t, UNKNOWN_SPEED) for t in own) / sum(own.values())
    mapped = {t: v * scale for t, v in own.items()}
    return lambda gpu_type: mapped.get(gpu_type) or priors.get(gpu_type, UNKNOWN_SPEED)


class WorkPrice(NamedTuple):
    """One pool as `muster why` prices the job's work there."""

    cluster: str
    flavor: str
    gpu_type: str
    cost_per_hour: float  # expected, spot risk included (risk.py)
    speed: float  # the job's relative speed there (V100 = 1 with the default priors)
    # chance the whole gang reaches its next checkpoint there (risk.checkpoint_survival)
    survival: float = 1.0

    @property
    def per_work(self) -> float:
        return self.cost_per_hour / self.speed


def work_price_text(
    prices: Sequence[WorkPrice], chosen: tuple[str, str] | None, rates: Sequence[GpuRate]
) -> str | None:
    """The expected cost per unit of work of the chosen pool (the job's current one, else
    the best) and of the next-best one; per step too where the job's step rate there is
    measured, and the chance the gang reaches its next checkpoint where reclaims put it below
    one. None when no pool may host the job."""
    if not prices:
        return None
    found = next((w for w in prices if (w.cluster, w.flavor) == chosen), None)
    first = found or prices[0]
    other = next((w for w in prices if w is not first), None)
    steps = {r.gpu_type: r.steps / r.seconds for r in rates if r.seconds > 0}

    def one(w: WorkPrice) -> str:
        text = (
            f"{w.cluster}/{w.flavor} ${w.per_work:.3g} per unit of work "
            f"({w.gpu_type.upper() or 'GPU'} at {w.speed:.3g}x, ${w.cost_per_hour:.3g}/h"
        )
        rate = steps.get(w.gpu_type)
        if rate:
            text += f", ${w.cost_per_hour / 3600.0 / rate * 1000.0:.3g} per 1000 steps"
        if w.survival < 1.0:
            text += f", reaches its next checkpoint {w.survival:.0%} of the time, redo priced in"
        return text + ")"

    label = "its pool" if found is not None else "best"
    tail = f"; next best {one(other)}" if other is not None else "; no other pool may host it"
    return f"expected cost of work: {label} {one(first)}{tail}"
