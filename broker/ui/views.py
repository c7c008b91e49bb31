"""What each dashboard page shows, built from the machine's read-only views.

Every query parameter is checked here, so the HTTP layer only maps `BadRequest` to a 400.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from broker.core.machine import Machine
from schemas.api import JobState
from schemas.codec import every_field

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
STATES: frozenset[str] = frozenset(JobState.__args__)  # type: ignore[attr-defined]
PAGE_MAX = 200
OFFSET_MAX = 1_000_000


class BadRequest(ValueError):
    """A parameter the dashboard API refuses; the message says how to fix it."""


def _name(params: Mapping[str, str], key: str) -> str | None:
    value = params.get(key)
    if value is None or value == "":
        return None
    if not NAME.match(value):
        raise BadRequest(
            f"{key}={value[:70]!r} is not a valid name: use 1-63 letters, digits, '.', '_' or '-'"
        )
    return value


def int_param(params: Mapping[str, str], key: str, default: int, low: int, high: int) -> int:
    raw = params.get(key)
    if raw is None or raw == "":
        return default
    if not raw.isdigit() or len(raw) > 8:
        raise BadRequest(f"{key}={raw[:20]!r} must be a whole number from {low} to {high}")
    value = int(raw)
    if not low <= value <= high:
        raise BadRequest(f"{key}={value} is out of range: use {low} to {high}")
    return value


def check_params(params: Mapping[str, str], allowed: frozenset[str]) -> None:
    unknown = sorted(set(params) - allowed)
    if unknown:
        known = ", ".join(sorted(allowed)) or "none"
        raise BadRequest(f"unknown parameter {unknown[0]!r}; this endpoint takes: {known}")


def job_id_param(value: str) -> str:
    if not NAME.match(value):
        raise BadRequest(f"{value[:70]!r} is not a job id: 1-63 letters, digits, '.', '_' or '-'")
    return value


JOBS_PARAMS = frozenset({"queue", "state", "cluster", "name", "offset", "limit"})


def jobs_page(machine: Machine, params: Mapping[str, str], now: float) -> dict[str, Any]:
    """One page of the filtered job list, newest first, with each queued job's reason."""
    check_params(params, JOBS_PARAMS)
    state = params.get("state") or None
    if state is not None and state not in STATES:
        raise BadRequest(f"state={state[:20]!r} is not a job state; use one of: {_states()}")
    offset = int_param(params, "offset", 0, 0, OFFSET_MAX)
    limit = int_param(params, "limit", 50, 1, PAGE_MAX)
    total, views = machine.views.jobs_page(
        now,
        queue=_name(params, "queue"),
        state=state,
        cluster=_name(params, "cluster"),
        name=_name(params, "name"),
        offset=offset,
        limit=limit,
    )
    rows = []
    for view in views:
        row = every_field(view)
        _where(row)
        if view.state == "queued":
            row["reason"] = machine.views.first_reason(view.job_id) or view.reason
        rows.append(row)
    return {"total": total, "offset": offset, "limit": limit, "jobs": rows}


def _where(row: dict[str, Any]) -> None:
    """`where`: the current cluster/flavor, else the last attempt's (a finished job ran
    somewhere; the CLI shows it too), else None."""
    if row.get("cluster"):
        row["where"] = f"{row['cluster']}/{row['flavor']}"
        return
    attempts = row.get("attempts") or []
    row["where"] = f"{attempts[-1]['cluster']}/{attempts[-1]['flavor']}" if attempts else None


def _states() -> str:
    return ", ".join(sorted(STATES))


def job_detail(machine: Machine, job_id: str, now: float) -> dict[str, Any] | None:
    view = machine.views.job_view(job_id, now)
    if view is None:
        return None
    why = machine.views.why(job_id, now) if view.state in ("queued", "preempting") else None
    job = every_field(view)
    _where(job)
    return {"job": job, "why": every_field(why) if why is not None else None, "now": now}


def fleet(machine: Machine, now: float) -> dict[str, Any]:
    """Clusters and flavors, with use, spot share and the interruption rate against the prior."""
    prior = machine.config.scheduling.spot_prior_rate
    clusters = []
    gpu_total = gpu_spot = 0
    for view in machine.views.cluster_views(now):
        row = every_field(view)
        row["stale_s"] = view.stale_s  # > 0: the agent's Kubernetes watches are failing
        for flavor in row.get("flavors", []):
            total = flavor.get("gpu_total", 0)
            flavor["gpu_used"] = total - flavor.get("gpu_free", 0)
            spot = flavor.get("capacity_type") == "spot"
            flavor["prior_rate_per_node_hour"] = prior if spot else 0.0
            gpu_total += total
            gpu_spot += total if spot else 0
        clusters.append(row)
    return {
        "now": now,
        "clusters": clusters,
        "gpu_total": gpu_total,
        "spot_share": gpu_spot / gpu_total if gpu_total else 0.0,
    }


def queues(machine: Machine, now: float) -> dict[str, Any]:
    oldest = machine.views.oldest_pending()
    classes = {c.name for c in machine.config.flavors}
    rows = []
    for view in machine.views.queue_views():
        row = every_field(view)
        since = oldest.get(view.name)
        row["oldest_wait_s"] = now - since if since is not None else None
        # A pool that matches no configured flavor class counts under its own flavor's name.
        for usage in row["flavors"]:
            usage["is_class"] = usage["flavor"] in classes
        rows.append(row)
    return {"now": now, "queues": rows}


def fleet_notices(machine: Machine, now: float) -> int:
    """Spot notices the fleet's pools have seen (on idle nodes too), for the interruptions
    page: it lists only the notices that hit a job."""
    return sum(f.interruptions for c in machine.views.cluster_views(now) for f in c.flavors)
