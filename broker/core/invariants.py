"""Safety checks over the core's state, for tests and the deterministic simulation.

Each check reads the lifecycle machine and its scheduler and returns the violations it found
(empty when the state is sound). They read the scheduler's own records through its read-only
views (`Scheduler.allocations`, `queue_states`, `cluster_states`): the point is to catch a
state the API views would hide. Nothing here changes the machine's or the scheduler's state;
the node check drains the inventory's record of changed nodes (`Scheduler.changed_nodes`),
which only these checks read.

- no node over-committed: Muster's usage on a node equals the sum of the allocations filed
  under it, and usage plus other pods never exceeds what the node has. Checked on the nodes
  changed since the previous call (the inventory files every change of a node's usage,
  capacity or schedulability), the nodes that failed last time, and every node on a full sweep
  each `FULL_SWEEP_EVERY` calls;
- whole gangs only: every allocation places every replica of every podset;
- quota held: each queue's usage is the sum of its charged allocations, each job with
  allocations is charged once, and no queue exceeds nominal plus its borrowing limit;
- at most one live attempt per job, and live jobs hold the allocation of that attempt;
- every job in exactly one state: queued jobs are pending and nothing else, live jobs are
  tracked live and not pending, finished jobs are neither;
- the preemption a record holds is its one source: its state is `preempting` exactly while it
  holds one, the lifecycle's index of preempting jobs lists exactly those records, and every
  make-before-break reservation the scheduler holds is the replacement a record names;
- every record as the state table (states.py) leaves it: a state the table knows, a job has
  ended (`finished_at`) exactly when its state is terminal, a live state was entered by a
  dispatch (the record names its newest attempt), and a running job's attempt has run.

`unordered_dispatches` checks a step's effects rather than the state: every Dispatch names in
`after_cancel_of` the attempt before it and every older one whose Cancel is unacknowledged, so
a shell that honours it never runs two copies. `unsettled_forgets` checks that no record is
deleted while it marks a Cancel unacknowledged: a restored leader would not send it again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from weakref import WeakKeyDictionary

from broker.core.effects import Effect, Forget, Send
from broker.core.inventory import Node
from broker.core.lifecycle import previous_attempt
from broker.core.machine import Machine
from broker.core.quota import RESOURCES
from broker.core.records import JobRecord
from broker.core.scheduler import Scheduler
from broker.core.states import LIVE_STATES, STATES, TERMINAL
from broker.core.types import Vec, add_amounts
from schemas.agent import Dispatch

# A full sweep of every node once in this many calls per scheduler, besides the nodes changed
# since the previous call: it would catch a change that bypassed the inventory's tracking.
FULL_SWEEP_EVERY = 64


class _NodeCheck:
    """What `nodes_not_overcommitted` remembers about one scheduler between calls."""

    __slots__ = ("__weakref__", "calls", "failing")

    def __init__(self) -> None:
        self.calls = 0
        self.failing: dict[Node, None] = {}  # nodes that failed: looked at until they pass


_node_checks: WeakKeyDictionary[Scheduler, _NodeCheck] = WeakKeyDictionary()


def _node_problems(cname: str, node: Node, filed: dict[tuple[str, int], Vec]) -> list[str]:
    out: list[str] = []
    nname = node.name
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
            out.append(f"node {cname}/{nname}: {RESOURCES[r]} used {used[r]} > capacity {limit[r]}")
    return out


def nodes_not_overcommitted(m: Machine) -> list[str]:
    """Every node changed since the previous call (every node on the first call and on every
    `FULL_SWEEP_EVERY`-th), and every node that failed before: a node nothing changed still
    holds what was verified when it last changed."""
    sched = m.scheduler
    clusters = sched.cluster_states()
    changed = sched.changed_nodes()
    state = _node_checks.get(sched)
    if state is None:
        state = _node_checks[sched] = _NodeCheck()
    full = state.calls % FULL_SWEEP_EVERY == 0
    state.calls += 1
    if full:
        nodes: Iterable[Node] = [n for c in clusters.values() for n in c.nodes.values()]
    else:
        nodes = dict.fromkeys([*state.failing, *changed])
    failing: dict[Node, None] = {}
    out: list[str] = []
    for node in nodes:
        cname = node.pool.cluster
        c = clusters.get(cname)
        if c is None or c.nodes.get(node.name) is not node:
            continue  # removed or replaced (a replacement is a changed node of its own)
        problems = _node_problems(cname, node, c.node_allocs.get(node.name, {}))
        if problems:
            failing[node] = None
            out.extend(problems)
    state.failing = failing
    return out


def fabric_not_overcommitted(m: Machine) -> list[str]:
    """Fabric resources per node and per queue, recomputed from the allocations' placements
    and their podsets' demands: equal to what each node and queue counts, within what each
    node offers and each queue's cap."""
    sched = m.scheduler
    clusters = sched.cluster_states()
    if not any(c.node_ext for c in clusters.values()) and not any(
        d.extended for ds in m.registry.all_demands.values() for d in ds
    ):
        return []
    held: dict[tuple[str, str], dict[str, int]] = {}
    charged: dict[tuple[str, str], dict[str, int]] = {}  # (queue, class) -> what it holds
    for (job_id, _), a in sched.allocations().items():
        asks = {d.podset: d.extended for d in m.registry.all_demands.get(job_id, ())}
        for podset, nodes in a.placement.assignment:
            for name in nodes:
                ask = dict(asks.get(podset, ()))
                add_amounts(held.setdefault((a.cluster, name), {}), ask, 1)
                if a.charged:
                    add_amounts(charged.setdefault((a.queue, a.flavor_class), {}), ask, 1)
    out: list[str] = []
    for name, qs in sched.queue_states().items():
        for cls in set(qs.ext_used) | {c for q, c in charged if q == name}:
            want = {k: v for k, v in charged.get((name, cls), {}).items() if v}
            if qs.ext_used.get(cls, {}) != want:
                out.append(f"queue {name}/{cls}: fabric used {qs.ext_used.get(cls)} != {want}")
            for res, amount in want.items():
                cap = qs.ext_caps.get(cls, {}).get(res)
                if cap is not None and amount > cap:
                    out.append(f"queue {name}/{cls}: {res} used {amount} > cap {cap}")
    for cname, c in clusters.items():
        for name, node in c.nodes.items():
            mine = {k: v for k, v in held.get((cname, name), {}).items() if v}
            if mine != node.ext_used:
                out.append(
                    f"node {cname}/{name}: fabric used {node.ext_used} != its allocations {mine}"
                )
            for res, amount in mine.items():
                if amount > node.ext_cap.get(res, 0):
                    out.append(
                        f"node {cname}/{name}: {res} used {amount} > capacity "
                        f"{node.ext_cap.get(res, 0)}"
                    )
    return out


def whole_gangs(m: Machine) -> list[str]:
    out: list[str] = []
    for (job_id, attempt), a in m.scheduler.allocations().items():
        demands = m.registry.all_demands.get(job_id)
        if demands is None:
            out.append(f"allocation {job_id}#{attempt} of an unknown job")
            continue
        placed = {podset: len(nodes) for podset, nodes in a.placement.assignment}
        wanted = {d.podset: d.replicas for d in demands}
        # A podset may run below its size only down to its minimum (partial admission, an
        # elastic shrink), and never above its maximum (`demands_of` asks for the maximum).
        record = m.jobs.get(job_id)
        least = {p.name: p.least for p in record.spec.gang} if record is not None else {}
        if placed.keys() != wanted.keys() or any(
            not least.get(ps, n) <= placed[ps] <= n for ps, n in wanted.items()
        ):
            out.append(f"allocation {job_id}#{attempt}: replicas {placed} != gang {wanted}")
    return out


def quota_held(m: Machine) -> list[str]:
    out: list[str] = []
    queues = m.scheduler.queue_states()
    expect: dict[str, dict[str, list[int]]] = {name: {} for name in queues}
    for job_id, attempts in m.scheduler.allocations_by_job().items():
        charged = [a for a in attempts.values() if a.charged]
        if len(charged) != 1:
            out.append(f"job {job_id}: {len(charged)} charged allocations (expected one)")
        for a in charged:
            per = expect.setdefault(a.queue, {}).setdefault(a.flavor_class, [0, 0, 0])
            for r in range(3):
                per[r] += a.vec[r]
    for name, qs in queues.items():
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
    by_job = m.scheduler.allocations_by_job()
    for job_id, record in m.jobs.items():
        live = [a.attempt for a in record.attempts if a.live]
        if len(live) > 1:
            out.append(f"job {job_id}: {len(live)} live attempts {live}")
            continue
        if live and record.attempts[-1].attempt != live[0]:
            out.append(f"job {job_id}: live attempt {live[0]} is not its newest")
        held = by_job.get(job_id) or {}
        if held:  # most jobs of a long run hold nothing: finished, or waiting
            pre = record.preempting
            allowed = set(live)
            if pre is not None and pre.replacement is not None:
                allowed.add(pre.replacement.attempt)
            if held.keys() - allowed:
                out.append(
                    f"job {job_id}: allocations {sorted(held)} beyond its live {sorted(allowed)}"
                )
        if record.state in LIVE_STATES and live and live[0] not in held:
            out.append(f"job {job_id}: live attempt {live[0]} holds no allocation")
    return out


def one_state(m: Machine) -> list[str]:
    out: list[str] = []
    pending = {j for q in m.backlog.pending.values() for j in q}
    preempting: set[str] = set()
    for job_id, record in m.jobs.items():
        s = record.state
        if record.preempting is not None:
            preempting.add(job_id)
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
        out.extend(f"job {job_id}: {p}" for p in table_problems(record))
    for job_id in pending - set(m.jobs):
        out.append(f"pending job {job_id} has no record")
    indexed = m.lifecycle.preempting_jobs()
    if indexed != preempting:
        out.append(
            f"preempting jobs {sorted(indexed)} as indexed, {sorted(preempting)} in the records"
        )
    for job_id, res in m.scheduler.reservations().items():
        held = m.jobs.get(job_id)
        pre = held.preempting if held is not None else None
        rep = pre.replacement if pre is not None else None
        current = held.current if held is not None else None
        named = (rep.attempt if rep is not None else None, current.attempt if current else None)
        if named != (res.replacement, res.replaced):
            out.append(
                f"job {job_id}: scheduler reserves attempt {res.replacement} for "
                f"{res.replaced}; the record names {named[0]} for {named[1]}"
            )
    return out


def table_problems(record: JobRecord) -> list[str]:
    """How `record` differs from what the state table's transitions leave behind."""
    s = record.state
    if s not in STATES:
        return [f"state {s!r} is not in the state table"]
    out: list[str] = []
    if (s in TERMINAL) != (record.finished_at is not None):
        out.append(f"state {s} with finished_at={record.finished_at}")
    newest = record.attempts[-1].attempt if record.attempts else 0
    if s in LIVE_STATES and (not record.attempts or record.attempt != newest):
        out.append(f"state {s} but attempt {record.attempt} is not the newest ({newest})")
    current = record.current
    if s == "running" and (current is None or current.running_at is None):
        out.append("state running but the live attempt never ran")
    return out


CHECKS = (
    nodes_not_overcommitted,
    fabric_not_overcommitted,
    whole_gangs,
    quota_held,
    one_live_attempt,
    one_state,
)


def violations(m: Machine) -> list[str]:
    """Every safety violation in the machine's state; empty when it is sound."""
    out: list[str] = []
    for check in CHECKS:
        out.extend(check(m))
    return out


def unordered_dispatches(m: Machine, effects: Iterable[Effect]) -> list[str]:
    """Dispatches that do not wait for the Cancels of the job's previous attempt and of every
    older one whose Cancel is unacknowledged."""
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
        before = previous_attempt(record, attempt)
        want = {
            a.attempt
            for a in record.attempts
            if a.attempt < cmd.attempt and (a.cancel_unacked or a.attempt == before)
        }
        missing = sorted(want - set(eff.after_cancel_of))
        if missing:
            out.append(
                f"dispatch {cmd.job_id}#{cmd.attempt} ordered after {list(eff.after_cancel_of)}, "
                f"not after the Cancels of attempts {missing}"
            )
    return out


def unsettled_forgets(records: Mapping[str, JobRecord], effects: Iterable[Effect]) -> list[str]:
    """Forgets of a record that marks a Cancel unacknowledged. `records` are the records as
    the store holds them when the Forget is carried out: the one it deletes is the only
    memory a restored leader would have of a copy that may still run."""
    out: list[str] = []
    for eff in effects:
        if not isinstance(eff, Forget):
            continue
        record = records.get(eff.job_id)
        unheard = [a.attempt for a in record.attempts if a.cancel_unacked] if record else []
        if unheard:
            out.append(f"job {eff.job_id} forgotten with the Cancels of attempts {unheard} unheard")
    return out
