"""The cluster-side fence on Kubernetes: one `coordination.k8s.io/v1` Lease per cluster.

A broker-granted fence says "what runs here must be stopped by `until` unless renewed". The
agent proves it is alive and heard by the broker with ONE object per cluster, the Lease
`muster-fence` in the workload namespace: it renews the Lease each time the broker
acknowledges a batch (`renewTime` = when that batch left, `leaseDurationSeconds` = the fence
window, and the exact deadline in the annotation `muster.dev/fence-until`). Its writes are at
most one merge patch per `step_s`, whatever the number of running attempts.

What reads it:
* the fence watchdog (agents/kube/watchdog.py), which deletes every fenced workload object of
  the namespace once the Lease has lapsed (by more than its skew allowance), so the operators
  and the Job controller end the pods without the agent;
* the in-pod self-fence of the SDK (`agents/sdk.py`), which stops a workload that can no
  longer see a live Lease.

Every object the agent creates for a fenced attempt carries the annotation
`muster.dev/fenced: "cluster"` (written once, at creation): the watchdog deletes only those,
and a restarted agent adopts every kind by it and by the attempt labels, with the window the
Lease itself records. Nothing per object ever moves, so a restart, an API-server outage or
an agent rollout shorter than the window costs nothing (docs/kubernetes.md, "Fencing").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import msgspec

from agents.kube.decode import parse_time
from kinds.base import DOMAIN

LEASE_NAME = "muster-fence"
LEASE_API = "coordination.k8s.io/v1"
# The exact fence deadline (unix seconds) on the Lease; renewTime + leaseDurationSeconds is
# the same within a second, for tools that read only the Lease's own fields.
ANN_FENCE_UNTIL = f"{DOMAIN}/fence-until"
# On every workload object of a fenced attempt: what the watchdog may delete.
ANN_FENCED = f"{DOMAIN}/fenced"
FENCED_VALUE = "cluster"
# The smallest and largest renewal step: a Lease is re-patched only once its deadline would
# grow this much (a fortieth of the window), so a healthy agent writes a few times a minute.
MIN_STEP_S = 5.0
MAX_STEP_S = 30.0


def lease_collection(namespace: str) -> str:
    return f"/apis/{LEASE_API}/namespaces/{namespace}/leases"


def lease_path(namespace: str) -> str:
    return f"{lease_collection(namespace)}/{LEASE_NAME}"


class LeaseSpec(msgspec.Struct):
    holderIdentity: str | None = None
    leaseDurationSeconds: int | None = None
    renewTime: str | None = None


class LeaseMeta(msgspec.Struct):
    name: str = ""
    annotations: dict[str, str] = {}


class KLease(msgspec.Struct):
    metadata: LeaseMeta = msgspec.field(default_factory=LeaseMeta)
    spec: LeaseSpec = msgspec.field(default_factory=LeaseSpec)


_lease = msgspec.json.Decoder(KLease)


def decode_lease(data: bytes) -> KLease | None:
    """The Lease as the API server returned it; None when it does not decode."""
    try:
        return _lease.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def lease_until(lease: KLease) -> float | None:
    """The fence deadline a Lease holds (unix seconds); None when it holds none."""
    try:
        return float(lease.metadata.annotations[ANN_FENCE_UNTIL])
    except (KeyError, ValueError):
        pass
    renewed = _micro_time(lease.spec.renewTime)
    duration = lease.spec.leaseDurationSeconds
    if renewed is None or duration is None:
        return None
    return renewed + duration


def lease_window(lease: KLease) -> float:
    return float(lease.spec.leaseDurationSeconds or 0)


def _micro_time(text: str | None) -> float | None:
    """A MicroTime ("2026-01-02T03:04:05.123456Z") as unix seconds; None when unreadable."""
    if not text:
        return None
    whole, _, frac = text.rstrip("Z").partition(".")
    base = parse_time(whole + "Z")
    if base is None:
        return None
    try:
        return base + (float(f"0.{frac}") if frac else 0.0)
    except ValueError:
        return base


def micro_time(unix: float) -> str:
    micros = min(999_999, int((unix - math.floor(unix)) * 1e6))
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(math.floor(unix))) + f".{micros:06d}Z"


def format_until(until: float) -> str:
    return f"{until:.3f}"


def lease_body(namespace: str, holder: str, renewed: float, window_s: float) -> dict[str, Any]:
    """The whole Lease, as created (and as a merge patch, its moving parts)."""
    return {
        "apiVersion": LEASE_API,
        "kind": "Lease",
        "metadata": {
            "name": LEASE_NAME,
            "namespace": namespace,
            "annotations": {ANN_FENCE_UNTIL: format_until(renewed + window_s)},
        },
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": max(1, math.ceil(window_s)),
            "renewTime": micro_time(renewed),
        },
    }


def renewal_patch(holder: str, renewed: float, window_s: float) -> dict[str, Any]:
    body = lease_body("", holder, renewed, window_s)
    return {"metadata": {"annotations": body["metadata"]["annotations"]}, "spec": body["spec"]}


class ClusterFence:
    """What the agent knows of its cluster's Lease: the window it renews with (from the
    broker's dispatches, or adopted from the Lease an earlier agent left) and the deadline
    last written. Pure: the backend does the requests."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.window_s = 0.0
        self.until: float | None = None  # as written (or adopted); None: no Lease yet
        self.writes = 0

    def adopt(self, lease: KLease) -> None:
        """Take up the Lease an earlier agent of this cluster kept."""
        if self.window_s <= 0:
            self.window_s = lease_window(lease)
        if self.until is None:
            self.until = lease_until(lease)

    def granted(self, window_s: float) -> None:
        """A dispatch carried this window: renew with it from now on."""
        if window_s > 0:
            self.window_s = window_s

    @property
    def step_s(self) -> float:
        return min(MAX_STEP_S, max(MIN_STEP_S, self.window_s / 40))

    def due(self, since: float) -> float | None:
        """The deadline to write for a renewal that the broker heard at `since`, or None when
        the Lease needs no write (no window, or it would grow less than a step)."""
        if self.window_s <= 0:
            return None
        until = since + self.window_s
        if self.until is not None and until < self.until + self.step_s:
            return None
        return until

    def written(self, until: float) -> None:
        self.until = until
        self.writes += 1

    def lapsed(self) -> bool:
        return self.until is not None and self.until <= self._clock()
