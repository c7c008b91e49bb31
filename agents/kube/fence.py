"""The cluster-side fence of an attempt on Kubernetes: the batch Job's activeDeadlineSeconds.

A broker-granted fence says "this attempt must be stopped by `until` unless extended again".
On Kubernetes the Job controller enforces `.spec.activeDeadlineSeconds` of a batch/v1 Job by
itself: once `status.startTime + activeDeadlineSeconds` has passed it marks the Job Failed
(reason DeadlineExceeded) and deletes its running pods. The field is mutable on a Job, so the
healthy agent moves it forward as the broker extends the fence, and a hung or dead agent
simply stops moving it: the cluster ends the pods without the agent.

Why a Job's field and not the pod's: a pod's `spec.activeDeadlineSeconds` may only be set or
lowered once the pod exists (the API server answers 422 "must be less than or equal to
previous value" to a raise), and a Job's pod template is immutable, so a pod-level deadline
cannot follow a fence that keeps moving. Kinds whose pods an operator creates from its own
templates (Kubeflow jobs, JobSet, RayJob, TrainJob, Volcano) have no extendable field the
agent could use for this. For them (and for every kind) the agent also writes the fence as
an absolute deadline in the annotation `muster.dev/fence-until` and moves it forward; a
separate watchdog (agents/kube/watchdog.py) deletes any object whose annotation has lapsed, so
the operators end the pods without the agent (docs/kubernetes.md).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from agents.kube.decode import parse_time
from kinds.base import DOMAIN
from kinds.batch import ANN_FENCE_AFTER, ANN_FENCE_DEADLINE, BATCH_JOB

# A fence is re-patched only once it has grown this much, so a healthy agent makes one
# PATCH per Job per step instead of one per broker acknowledgement (every 0.5 s).
PATCH_STEP_S = 5.0

Key = tuple[str, int]  # (job_id, attempt)
Item = tuple[str, str]  # (collection, name)

# The fence as an absolute deadline (unix seconds) on every workload object Muster creates:
# what the fence watchdog enforces without the agent.
ANN_FENCE_UNTIL = f"{DOMAIN}/fence-until"


class _Started(msgspec.Struct):
    startTime: str | None = None


_started = msgspec.json.Decoder(_Started | None)


def job_start(status: msgspec.Raw) -> float | None:
    """A batch Job's `status.startTime` (unix seconds), None while unset or unreadable."""
    try:
        st = _started.decode(status)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    return None if st is None else parse_time(st.startTime)


def annotated_deadline(annotations: dict[str, str]) -> tuple[float, int] | None:
    """(fence window, current activeDeadlineSeconds) from a fenced Job's annotations."""
    try:
        return float(annotations[ANN_FENCE_AFTER]), int(annotations[ANN_FENCE_DEADLINE])
    except (KeyError, ValueError):
        return None


def is_batch_job(collection: str) -> bool:
    return collection.startswith(f"/apis/{BATCH_JOB.api_version}/") and collection.endswith(
        f"/{BATCH_JOB.plural}"
    )


class JobDeadlines:
    """Per attempt, per Job: its start (unix seconds) once known and its current deadline."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._jobs: dict[Key, dict[str, tuple[float | None, int]]] = {}

    def created(self, key: Key, name: str, deadline: int, start: float | None = None) -> None:
        jobs = self._jobs.setdefault(key, {})
        if name not in jobs:
            jobs[name] = (start, deadline)

    def forget(self, job_id: str, keep: Callable[[int], bool] = lambda _: False) -> None:
        for key in [k for k in self._jobs if k[0] == job_id and not keep(k[1])]:
            del self._jobs[key]

    def fenced(self, key: Key) -> bool:
        return bool(self._jobs.get(key))

    def due(
        self, key: Key, until: float, start_of: Callable[[str], float | None]
    ) -> list[tuple[str, int]]:
        """(Job name, new activeDeadlineSeconds) for each Job whose fence should move to
        `until`: floored, so the Job ends no later than the fence; never for a Job whose
        deadline has already passed (a lapsed fence must not revive anything), nor for one
        whose start is not known yet (it keeps the deadline it was created with)."""
        now = self._clock()
        out: list[tuple[str, int]] = []
        for name, (start, current) in self._jobs.get(key, {}).items():
            if start is None:
                start = start_of(name)
                if start is None:
                    continue
                self._jobs[key][name] = (start, current)
            if start + current <= now:
                continue  # lapsed: the Job controller ends it, or already has
            seconds = int(until - start)
            if seconds < current + PATCH_STEP_S:
                continue
            out.append((name, seconds))
        return out

    def patched(self, key: Key, name: str, seconds: int) -> None:
        start, _ = self._jobs[key][name]
        self._jobs[key][name] = (start, seconds)

    @staticmethod
    def patch(seconds: int) -> dict[str, object]:
        """The merge patch that moves a Job's fence (the annotation follows the field)."""
        return {
            "metadata": {"annotations": {ANN_FENCE_DEADLINE: str(seconds)}},
            "spec": {"activeDeadlineSeconds": seconds},
        }


def fence_until(annotations: dict[str, str]) -> float | None:
    """The deadline an object's fence annotation holds; None without one (never fenced)."""
    try:
        return float(annotations[ANN_FENCE_UNTIL])
    except (KeyError, ValueError):
        return None


class FenceUntils:
    """Per attempt, per object: the fence deadline its annotation holds, as last written."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._objects: dict[Key, dict[Item, float]] = {}

    def created(self, key: Key, item: Item, until: float) -> None:
        self._objects.setdefault(key, {}).setdefault(item, until)

    def forget(self, job_id: str, keep: Callable[[int], bool] = lambda _: False) -> None:
        for key in [k for k in self._objects if k[0] == job_id and not keep(k[1])]:
            del self._objects[key]

    def fenced(self, key: Key) -> bool:
        return bool(self._objects.get(key))

    def due(self, key: Key, until: float) -> list[Item]:
        """The objects whose annotation should move to `until`: once it grew a step, and
        never for one already lapsed (the watchdog ends it; nothing may revive it)."""
        now = self._clock()
        return [
            item
            for item, current in self._objects.get(key, {}).items()
            if current > now and until >= current + PATCH_STEP_S
        ]

    def patched(self, key: Key, item: Item, until: float) -> None:
        self._objects[key][item] = until

    @staticmethod
    def patch(until: float) -> dict[str, object]:
        """The merge patch that moves an object's fence annotation (allowed on every kind)."""
        return {"metadata": {"annotations": {ANN_FENCE_UNTIL: format_until(until)}}}


def format_until(until: float) -> str:
    return f"{until:.3f}"
