"""The inventory's record of changed nodes, and the node check that reads only those.

`nodes_not_overcommitted` re-verifies the nodes changed since its previous call, so the record
must be complete: every node whose usage, free capacity, capacity or schedulability differs
from what it was at the previous drain is in the next drain. The property drives a scheduler
through random event sequences and compares each drain with a from-scratch diff of every
node's state.
"""

from __future__ import annotations

import dataclasses
from operator import attrgetter

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.core.invariants import FULL_SWEEP_EVERY, nodes_not_overcommitted
from broker.core.inventory import Node
from broker.core.machine import Machine
from broker.core.scheduler import Scheduler
from broker.core.types import Placement
from schemas.agent import FlavorInfo, NodeInfo

from .helpers import NOW, config, flavor, gang, nodes
from .strategies import CLASSES, fleets, ops, queue_sets, requests

State = tuple[object, ...]


# Everything the node check reads from a node, and its place in the free-GPU index.
state_of = attrgetter(
    *("used_gpu", "used_cpu", "used_mem", "free_gpu", "free_cpu", "free_mem"),
    *("usable_gpu", "other_gpu", "other_cpu", "other_mem", "ready", "schedulable", "bucket"),
)


def current(s: Scheduler) -> dict[tuple[str, str], tuple[Node, State]]:
    return {
        (cname, name): (n, state_of(n))
        for cname, c in s.cluster_states().items()
        for name, n in c.nodes.items()
    }


def check_drain(s: Scheduler, before: dict[tuple[str, str], tuple[Node, State]]) -> None:
    changed = set(s.changed_nodes())
    now = current(s)
    for key, (node, state) in now.items():
        old = before.get(key)
        if old is None or old[0] is not node or old[1] != state:
            assert node in changed, f"node {key} changed but is not in the drain"
    live = {id(n) for n, _ in now.values()}
    assert all(id(n) in live for n in changed), "a removed node stayed in the record"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet=fleets(), queues=queue_sets(), data=st.data())
def test_the_changed_node_record_equals_a_diff_of_every_node(
    fleet: dict[str, tuple[list[FlavorInfo], list[NodeInfo]]],
    queues: list,  # type: ignore[type-arg]
    data: st.DataObject,
) -> None:
    s = Scheduler(config(queues=queues, classes=CLASSES))
    now = NOW
    check_drain(s, {})
    before = current(s)
    for cname, (flavors, ns) in fleet.items():
        s.apply_snapshot(cname, flavors, ns, now)
    check_drain(s, before)
    infos = {(c, n.name): n for c, (_, ns) in fleet.items() for n in ns}
    admitted: list[tuple[str, int]] = []
    qnames = [q.name for q in queues]
    seq = 0
    for _ in range(data.draw(st.integers(1, 12))):
        before = current(s)
        now += 10
        op = data.draw(ops)
        keys = sorted(infos)
        if op == "schedule":
            count = data.draw(st.integers(1, 5))
            reqs = [data.draw(requests(f"j{seq + i}", qnames)) for i in range(1, count + 1)]
            seq += count
            res = s.schedule(reqs, now)
            admitted.extend((job, 1) for job, _ in res.admitted)
        elif op == "release" and admitted:
            key = data.draw(st.sampled_from(admitted))
            admitted.remove(key)
            s.release(*key)
        elif op == "reserve" and admitted:
            job, attempt = data.draw(st.sampled_from(admitted))
            if (job, attempt + 1) not in admitted:
                req = requests(job, qnames)
                new = dataclasses.replace(data.draw(req), attempt=attempt + 1)
                if isinstance(s.reserve(new, now, replacing_attempt=attempt), Placement):
                    admitted.append((job, attempt + 1))
        elif op == "spot" and keys:
            c, n = data.draw(st.sampled_from(keys))
            s.spot_notice(c, n, now + 120, now)
        elif op == "remove" and keys:
            key = data.draw(st.sampled_from(keys))
            s.remove_node(*key, now)
            del infos[key]
        elif op == "gpu" and keys:
            c, n = data.draw(st.sampled_from(keys))
            s.set_gpu_health(c, n, data.draw(st.integers(0, infos[(c, n)].gpu)), now)
        elif op == "upsert" and keys:
            c, n = data.draw(st.sampled_from(keys))
            info = msgspec.structs.replace(
                infos[(c, n)],
                ready=data.draw(st.booleans()),
                other_gpu=data.draw(st.integers(0, 2)),
            )
            infos[(c, n)] = info
            s.upsert_node(c, info, now)
        elif op == "snapshot":
            c = data.draw(st.sampled_from(sorted(fleet)))
            same = [info for (cc, _), info in sorted(infos.items()) if cc == c]
            s.apply_snapshot(c, fleet[c][0], same, now)
        elif op == "unschedulable":
            s.set_cluster_schedulable(data.draw(st.sampled_from(sorted(fleet))), False)
        check_drain(s, before)


def _machine() -> tuple[Machine, Node]:
    m = Machine(config())
    m.scheduler.apply_snapshot("c1", [flavor("od")], nodes("n", "od", 3), NOW)
    got = m.scheduler.reserve(gang("j1", (1, 8)), NOW)
    assert isinstance(got, Placement)
    node = m.scheduler.cluster_states()["c1"].nodes[next(iter(got.nodes))]
    return m, node


def test_the_node_check_looks_at_a_changed_node_at_once() -> None:
    m, node = _machine()
    assert nodes_not_overcommitted(m) == []  # the first call sweeps every node
    m.scheduler.reserve(gang("j2", (1, 4)), NOW)
    # cpu nothing files, beyond the node's: a tracked change, so seen by the next call
    node.take(0, 200_000, 0)
    out = nodes_not_overcommitted(m)
    assert len(out) == 2 and all(node.name in p for p in out), out
    # A node that failed is looked at again until it passes, though nothing changed it.
    assert nodes_not_overcommitted(m) == out
    node.take(0, -200_000, 0)
    assert nodes_not_overcommitted(m) == []
    assert nodes_not_overcommitted(m) == []


def test_a_change_that_bypasses_the_record_is_caught_by_the_full_sweep() -> None:
    m, node = _machine()
    assert nodes_not_overcommitted(m) == []
    node.used_gpu += 1  # written behind the inventory's back: no record of the change
    seen = [nodes_not_overcommitted(m) for _ in range(FULL_SWEEP_EVERY)]
    assert seen[:-1] == [[]] * (FULL_SWEEP_EVERY - 1)
    assert any(node.name in p for p in seen[-1]), seen[-1]
