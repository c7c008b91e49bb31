"""Safety checks over the core's state, for tests and the deterministic simulation.

Each check reads the lifecycle machine and its scheduler and returns the violations it found
(empty when the state is sound). They look at internals on purpose: the point is to catch a
state the public views would hide. Nothing here changes state.

- no node over-committed: Muster's usage on a node equals the sum of the allocations filed
  under it, and usage plus other pods never exceeds what the node has;
- whole gangs only: every allocation places every replica of every podset;
- quota held: each queue's usage is the sum of its charged allocations, each job with
  allocations is charged once, and no queue exceeds nominal plus its borrowing limit;
- at most one live attempt per job, and live jobs hold the allocation of that attempt;
- every job in exactly one state: queued jobs are pending and nothing else, live jobs are
  tracked live and not pending, finished jobs are neither.

`unordered_dispatches` checks a step's effects rather than the state: every Dispatch names the
attempt before it in `after_cancel_of`, so a shell that honours it never runs two copies.
"""

from __future__ import annotations

from collections.abc import Iterable

from broker.core.effects import Effect, Send
from broker.core.lifecycle import LIVE_STATES, TERMINAL, previous_attempt
from broker.core.machine import Machine
from broker.core.quota import RESOURCES
from schemas.agent import Dispatch

Vec3 = tuple[int, int, int]


def nodes_not_overcommitted(m: Machine) -> list[str]:
    out: list[str] = []
    inv = m.scheduler._inv
    for cname, c in inv.clusters.items():
        for nname, node in c.nodes.items():
            filed = c.node_allocs.get(nname, {})
            sums = [sum(v[r] for v in filed.values()) for r in range(3)]
            used = [node.used_gpu, node.used_cpu, node.used_mem]
            if sums != used:
                out.append(f"node {cname}/{nname}: usage {used} != its allocations {sums}")
            limit = (
                node.usable_gpu - node.other_gpu,
                node.cpu - node.other_cpu,
                node.mem - node.other_mem,
            )
            for r in range(3):
                if used[r] > limit[r] and not (r == 0 and node.broken):
                    out.append(
                        f"node {cname}/{nname}: {RESOURCES[r]} used {used[r]} > capacity {limit[r]}"
                    )
    return out


def whole_gangs(m: Machine) -> list[str]:
    out: list[str] = []
    for (job_id, attempt), a in m.scheduler._ledger.allocs.items():
        demands = m.registry.all_demands.get(job_id)
        if demands is None:
            out.append(f"allocation {job_id}#{attempt} of an unknown job")
            continue
        placed = {podset: len(nodes) for podset, nodes in a.placement.assignment}
        wanted = {d.podset: d.replicas for d in demands}
        if placed != wanted:
            out.append(f"allocation {job_id}#{attempt}: replicas {placed} != gang {wanted}")
    return out


def quota_held(m: Machine) -> list[str]:
    out: list[str] = []
    book = m.scheduler._book
    ledger = m.scheduler._ledger
    expect: dict[str, dict[str, list[int]]] = {name: {} for name in book.queues}
    for job_id, attempts in ledger.by_job.items():
        charged = [a for a in attempts.values() if a.charged]
        if len(charged) != 1:
            out.append(f"job {job_id}: {len(charged)} charged allocations (expected one)")
        for a in charged:
            per = expect.setdefault(a.queue, {}).setdefault(a.flavor_class, [0, 0, 0])
            for r in range(3):
                per[r] += a.vec[r]
    for name, qs in book.queues.items():
        for cls in set(qs.usage) | set(expect.get(name, {})):
            have = qs.used(cls)
            want = expect.get(name, {}).get(cls, [0, 0, 0])
            if list(have) != want:
                out.append(f"queue {name}/{cls}: usage {list(have)} != charged {want}")
            lims = qs.limits.get(cls) if qs.limits is not None else None
            if lims is None:
                continue
            for r, lim in enumerate(lims):
                if lim is None or lim.borrowing is None:
                    continue
                if have[r] > lim.nominal + lim.borrowing:
                    out.append(
                        f"queue {name}/{cls}: {RESOURCES[r]} used {have[r]} > nominal "
                        f"{lim.nominal} + borrowing limit {lim.borrowing}"
                    )
    return out


def one_live_attempt(m: Machine) -> list[str]:
    out: list[str] = []
    ledger = m.scheduler._ledger
    for job_id, record in m.jobs.items():
        live = [a.attempt for a in record.attempts if a.live]
        if len(live) > 1:
            out.append(f"job {job_id}: {len(live)} live attempts {live}")
            continue
        if live and record.attempts[-1].attempt != live[0]:
            out.append(f"job {job_id}: live attempt {live[0]} is not its newest")
        held = set(ledger.by_job.get(job_id, {}))
        pre = record.preempting
        allowed = set(live)
        if pre is not None and pre.replacement is not None:
            allowed.add(pre.replacement.attempt)
        if held - allowed:
            out.append(
                f"job {job_id}: allocations {sorted(held)} beyond its live {sorted(allowed)}"
            )
        if record.state in LIVE_STATES and live and live[0] not in held:
            out.append(f"job {job_id}: live attempt {live[0]} holds no allocation")
    return out


def one_state(m: Machine) -> list[str]:
    out: list[str] = []
    pending = {j for q in m.backlog.pending.values() for j in q}
    for job_id, record in m.jobs.items():
        s = record.state
        is_pending = job_id in pending
        is_live = m.lifecycle.is_live(job_id)
        if s == "queued":
            ok = is_pending and not is_live and record.current is None
        elif s in LIVE_STATES:
            ok = is_live and not is_pending and record.current is not None
        elif s in TERMINAL:
            ok = not is_live and not is_pending and record.current is None
        else:
            ok = False
        if not ok:
            out.append(
                f"job {job_id}: state {s} but pending={is_pending} live={is_live} "
                f"current={record.current is not None}"
            )
        if (s == "preempting") != (record.preempting is not None):
            out.append(f"job {job_id}: state {s} with preempting={record.preempting is not None}")
    for job_id in pending - set(m.jobs):
        out.append(f"pending job {job_id} has no record")
    return out


CHECKS = (nodes_not_overcommitted, whole_gangs, quota_held, one_live_attempt, one_state)


def violations(m: Machine) -> list[str]:
    """Every safety violation in the machine's state; empty when it is sound."""
    out: list[str] = []
    for check in CHECKS:
        out.extend(check(m))
    return out


def unordered_dispatches(m: Machine, effects: Iterable[Effect]) -> list[str]:
    """Dispatches that do not wait for the Cancel of the job's previous attempt."""
    out: list[str] = []
    for eff in effects:
        if not isinstance(eff, Send) or not isinstance(eff.command, Dispatch):
            continue
        cmd = eff.command
        record = m.jobs.get(cmd.job_id)
        attempt = (
            next((a for a in record.attempts if a.attempt == cmd.attempt), None) if record else None
        )
        if record is None or attempt is None:
            out.append(f"dispatch {cmd.job_id}#{cmd.attempt} of an unknown attempt")
            continue
        want = previous_attempt(record, attempt)
        if eff.after_cancel_of != want:
            out.append(
                f"dispatch {cmd.job_id}#{cmd.attempt} ordered after {eff.after_cancel_of}, "
                f"not after the Cancel of attempt {want}"
            )
    return out
