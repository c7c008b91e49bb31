"""Submit validation: which queue a job goes to, what it is called, and why it is refused.

Pure functions over the config and the job; a refusal is a `SubmitReply` that says what was
wrong and how to fix it, and changes nothing.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

import msgspec

from broker.core.records import SPOT_OK_LABEL
from schemas.api import SubmitReply
from schemas.config import BrokerConfig, QueueConfig
from schemas.job import JobSpec

DEFAULT_QUEUE = "default"  # where a job that names no queue goes, when the config has it
# The priority class a manifest named (broker.manifests sets it; the config maps it).
PRIORITY_CLASS_LABEL = "muster.dev/priority-class"


def reject(error: str) -> SubmitReply:
    return SubmitReply(accepted=False, error=error)


def choose_queue(
    config: BrokerConfig,
    queues: Mapping[str, QueueConfig],
    spec: JobSpec,
    subject_queue: str | None,
) -> str | SubmitReply:
    """The queue the job goes to (aliases resolved), or the refusal. The job may name its
    queue, the subject it was published to may, or neither (then `default`, if configured)."""
    aliases = config.queue_aliases
    if subject_queue is not None:
        subject_queue = aliases.get(subject_queue, subject_queue)
    named = aliases.get(spec.queue, spec.queue) if spec.queue else None
    queue = named or subject_queue
    if named and subject_queue and named != subject_queue:
        return reject(
            f"queue mismatch: the job names queue {spec.queue!r} but was published to "
            f"queue {subject_queue!r}; drop 'queue' from the job or publish to its subject"
        )
    if not queue and DEFAULT_QUEUE in queues:
        queue = DEFAULT_QUEUE  # as Kueue's LocalQueue defaulting does
    if not named and queue in (None, "", DEFAULT_QUEUE) and queue not in queues:
        known = ", ".join(sorted(queues)) or "(none)"
        return reject(
            "the job names no queue and the config has no queue named "
            f"{DEFAULT_QUEUE!r} to take it; name one (--queue, `queue:`); known queues: {known}"
        )
    if queue is None or queue not in queues:
        return reject(unknown_queue_text(queue, queues))
    if not spec.gang:
        return reject("gang: the job has no podsets; give 'gang' or a supported manifest")
    return queue


def unknown_queue_text(queue: str | None, known: Iterable[str]) -> str:
    """The refusal of a queue name no queue has, with the closest known name."""
    names = sorted(known)
    close = difflib.get_close_matches(queue or "", names, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown queue {queue!r}; {hint}known queues: {', '.join(names) or '(none)'}"


def queue_full(queue: str, pending: int, cap: int) -> SubmitReply | None:
    if cap and pending >= cap:
        return reject(
            f"queue {queue!r} is full: {cap} jobs are already pending "
            "(limits.max_pending_per_queue); retry later or submit to another queue"
        )
    return None


def derive_job_id(name: str, token: str) -> str:
    """The id of a job submitted without one: its name and a token, at most 63 characters."""
    suffix = f"-{token}"
    return name[: 63 - len(suffix)].rstrip("-") + suffix


def mark_spot_ok(queue: QueueConfig, spec: JobSpec) -> JobSpec:
    """A queue that lets jobs without checkpoints use spot says so on each such job."""
    if (
        not queue.spot_without_checkpoint
        or spec.checkpoint is not None
        or spec.capacity not in ("any", "spot-then-on-demand")
    ):
        return spec
    if SPOT_OK_LABEL in spec.labels:
        return spec
    return msgspec.structs.replace(spec, labels={**spec.labels, SPOT_OK_LABEL: "queue"})


def check_service_accounts(config: BrokerConfig, spec: JobSpec) -> SubmitReply | None:
    """Refuse a manifest naming a service account the agents would refuse when they create
    its objects: the author hears it now, not as a failed dispatch."""
    allowed = config.workload_service_accounts
    manifest = spec.workload.manifest
    if allowed is None or manifest is None:
        return None
    for path, name in _service_accounts(manifest, ""):
        if name not in allowed:
            return reject(
                f"{path}: service account {name!r} is not one the clusters' agents allow "
                f"(workload_service_accounts: {', '.join(allowed) or 'none'}); drop it, or ask "
                "an operator to allow it in the agents' allowed_service_accounts and the "
                "broker's workload_service_accounts"
            )
    return None


def _service_accounts(value: object, path: str) -> list[tuple[str, str]]:
    """Every `serviceAccountName` (and the older `serviceAccount`) in a manifest, with its
    path; pod specs sit at different depths in every kind."""
    out: list[tuple[str, str]] = []
    if isinstance(value, dict):
        for key, item in value.items():
            at = f"{path}.{key}" if path else str(key)
            if key in ("serviceAccountName", "serviceAccount") and isinstance(item, str) and item:
                out.append((at, item))
            else:
                out.extend(_service_accounts(item, at))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out.extend(_service_accounts(item, f"{path}[{i}]"))
    return out


def resolve_priority(config: BrokerConfig, spec: JobSpec) -> JobSpec | SubmitReply:
    """The job with the priority its priority class means in the config, or the refusal of
    a class the config does not know (a class must never silently mean priority 0)."""
    name = spec.labels.get(PRIORITY_CLASS_LABEL)
    if name is None:
        return spec
    value = config.priority_classes.get(name)
    if value is None:
        known = ", ".join(f"{n} ({v})" for n, v in sorted(config.priority_classes.items()))
        return reject(
            f"unknown priority class {name!r}; known priority classes: {known or '(none)'}. "
            "Declare it under `priority_classes` in the broker config (or import its "
            "PriorityClass / WorkloadPriorityClass), or name a known one"
        )
    return msgspec.structs.replace(spec, priority=value)
