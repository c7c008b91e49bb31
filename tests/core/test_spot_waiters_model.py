"""`SpotWaiters` kept by index against the same operations done the plain way: after any
sequence of cycles begun, waits, forgets and settles, the waiters and their order agree, and
so does the waiter each spot pool is kept for (asked of the groups' heads, against a walk of
every earlier waiter)."""

from __future__ import annotations

from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from broker.core.inventory import Pool
from broker.core.placement import make_gang
from broker.core.spotwait import SpotWaiters
from broker.core.types import GangRequest, PoolKey, Reason
from schemas.job import CapacityPreference
from tests.core.helpers import flavor, gang, one_cluster

JOBS = [f"j{i}" for i in range(8)]
CAPACITY = (Reason("insufficient-capacity", "no room"),)
OTHER = (Reason("quota-exceeded", "over quota"),)
# Spot pools of one and two 8-GPU nodes, of two GPU types, and an on-demand one.
POOLS = list(
    one_cluster(
        [
            (flavor("v100-spot", "spot", "v100", 0.9), 1),
            (flavor("a100-spot", "spot", "a100", 1.5), 2),
            (flavor("a100-od", "on-demand", "a100"), 1),
        ]
    )
    .cluster_states()["c"]
    .pools.values()
)
SHAPES = [(1, 1), (1, 8), (2, 8), (1, 16)]  # (replicas, GPUs): the last fits no node
TYPES: list[frozenset[str]] = [frozenset(), frozenset({"v100"}), frozenset({"a100"})]
AVOID: list[frozenset[PoolKey]] = [frozenset(), frozenset({POOLS[0].key})]


def request(
    job: str,
    priority: int,
    order: int,
    shape: tuple[int, int] = (1, 8),
    types: frozenset[str] = frozenset(),
    avoid: frozenset[PoolKey] = frozenset(),
    capacity: CapacityPreference = "spot",
) -> GangRequest:
    return gang(
        job, shape, priority=priority, order=order, gpu_types=types, avoid=avoid, capacity=capacity
    )


def key(r: GangRequest) -> tuple[int, int]:
    return (-r.priority, r.order)


class Plain:
    """The waiters as a list walked for every question."""

    def __init__(self) -> None:
        self.ids: dict[str, None] = {}
        self.active: list[GangRequest] = []

    def begin(self, requests: list[GangRequest]) -> None:
        self.active = sorted(requests, key=key)

    def waits(self, r: GangRequest) -> None:
        self.ids[r.job_id] = None
        if any(w.job_id == r.job_id for w in self.active):
            return
        at = next((i for i, w in enumerate(self.active) if key(w) > key(r)), len(self.active))
        self.active.insert(at, r)

    def forget(self, job: str) -> None:
        self.ids.pop(job, None)
        self.active = [w for w in self.active if w.job_id != job]

    def kept_for(self, req: GangRequest, pool: Pool, running: bool) -> GangRequest | None:
        """The earliest waiter before `req` (after every waiter of its priority when it is
        `running`) that is not `req`, on a spot pool, accepting it and fitting it empty."""
        if pool.capacity_type != "spot" or req.capacity == "spot" or req.spot_exhausted:
            return None
        for w in self.active:
            if running and w.priority < req.priority:
                return None
            if not running and key(w) >= key(req):
                return None
            if w.job_id == req.job_id or pool.key in w.avoid_pools:
                continue
            if w.gpu_types and pool.gpu_type not in w.gpu_types:
                continue
            largest = max(p.gpu for p in w.podsets)
            replicas = sum(p.replicas for p in w.podsets)
            nodes = sum(1 for n in pool.nodes.values())
            if largest <= 8 and replicas * largest <= 8 * nodes:
                return w
        return None

    def settle(
        self, tried: list[GangRequest], pending: dict[str, Any], admitted: list[str]
    ) -> None:
        for job in admitted:
            self.forget(job)
        for r in tried:
            reasons = pending.get(r.job_id)
            if reasons is None:
                continue
            if reasons is CAPACITY:
                self.ids[r.job_id] = None
            else:
                self.forget(r.job_id)


requests = st.builds(
    request,
    st.sampled_from(JOBS),
    st.integers(0, 2),
    st.integers(0, 5),
    st.sampled_from(SHAPES),
    st.sampled_from(TYPES),
    st.sampled_from(AVOID),
)
asks = st.builds(
    request,
    st.sampled_from([*JOBS, "x"]),
    st.integers(0, 2),
    st.integers(0, 5),
    capacity=st.sampled_from(["any", "spot-then-on-demand", "spot"]),
)
waits = st.tuples(st.just("waits"), requests)
forgets = st.tuples(st.just("forget"), st.sampled_from(JOBS))
ops = st.one_of(
    st.tuples(st.just("ask"), asks),
    st.tuples(st.just("begin"), st.lists(requests, max_size=5, unique_by=lambda r: r.job_id)),
    # The next cycle's waiters: some requests of the last begun kept (the same objects, as
    # the machine keeps a parked job's request), and new ones.
    st.tuples(
        st.just("again"),
        st.tuples(
            st.lists(st.booleans(), min_size=5, max_size=5),
            st.lists(requests, max_size=3, unique_by=lambda r: r.job_id),
        ),
    ),
    waits,
    forgets,
    st.tuples(
        st.just("settle"),
        st.lists(
            st.tuples(requests, st.sampled_from(["capacity", "other", "admitted"])), max_size=5
        ),
    ),
)


def _agree(steps: list[tuple[str, Any]]) -> None:
    kept, plain = SpotWaiters(lambda r: make_gang(r.podsets)), Plain()
    begun: list[GangRequest] = []
    for op, arg in steps:
        if op == "again":
            keep, new = arg
            arg = [r for r, k in zip(begun, keep, strict=False) if k]
            arg += [r for r in new if r.job_id not in {a.job_id for a in arg}]
            op = "begin"
        if op == "ask":
            for pool in POOLS:
                for running in (False, True):
                    got = kept.kept_for(arg, pool, running)
                    want = plain.kept_for(arg, pool, running)
                    # Of waiters with equal keys either may be named: spot is kept for one.
                    assert (got and key(got)) == (want and key(want))
        elif op == "begin":
            kept.begin(arg)
            plain.begin(arg)
            begun = arg
        elif op == "waits":
            kept.waits(arg)
            plain.waits(arg)
        elif op == "forget":
            kept.forget(arg)
            plain.forget(arg)
        else:
            tried = [r for r, what in arg if what != "admitted"]
            pending = {
                r.job_id: CAPACITY if what == "capacity" else OTHER
                for r, what in arg
                if what != "admitted"
            }
            admitted = [r.job_id for r, what in arg if what == "admitted"]
            kept.settle(tried, pending, admitted)
            plain.settle(tried, pending, admitted)
        # In queue order; of waiters with equal keys, in any order.
        assert sorted((w.key, w.request.job_id) for w in kept.active) == sorted(
            (key(w), w.job_id) for w in plain.active
        )
        assert [w.key for w in kept.active] == [key(w) for w in plain.active]
        assert list(kept.ids) == list(plain.ids)
        for job in JOBS:
            assert (job in kept) == (job in plain.ids)


@settings(max_examples=400, deadline=None)
@given(st.lists(ops, max_size=30))
def test_the_indexed_waiters_agree_with_the_plain_list(steps: list[tuple[str, Any]]) -> None:
    _agree(steps)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(waits, forgets, st.tuples(st.just("ask"), asks)), max_size=40))
@example(  # a waiter left from behind its group's head and came back in another group
    [
        ("waits", request("j1", 0, 0, (1, 1))),
        ("waits", request("j0", 0, 1, (1, 1))),
        ("forget", "j0"),
        ("waits", request("j0", 0, 5, (1, 8))),
        ("forget", "j1"),
        ("ask", request("x", 0, 3, capacity="any")),
    ]
)
@example(  # the earlier of two waiters alike but for the pools they avoid avoids this one
    [
        ("waits", request("j0", 0, 0, (1, 1), avoid=AVOID[1])),
        ("waits", request("j1", 0, 1, (1, 1))),
        ("ask", request("x", 0, 3, capacity="any")),
    ]
)
@example(  # the earlier of two waiters alike but for their gangs fits no pool
    [
        ("waits", request("j0", 0, 0, (1, 16))),
        ("waits", request("j1", 0, 1, (1, 8))),
        ("ask", request("x", 0, 3, capacity="any")),
    ]
)
@example(  # an earlier waiter heads a group an ask has read
    [
        ("waits", request("j1", 0, 3, (1, 1))),
        ("ask", request("x", 0, 5, capacity="any")),
        ("waits", request("j0", 0, 1, (1, 1))),
        ("ask", request("x", 0, 2, capacity="any")),
    ]
)
def test_a_pool_is_kept_for_the_waiter_a_walk_of_every_waiter_finds(
    steps: list[tuple[str, Any]],
) -> None:
    """Many asks between waits and forgets: the heads each ask reads follow every change."""
    _agree(steps)


@settings(max_examples=300, deadline=None)
@given(st.lists(ops, max_size=30))
def test_heaps_rebuilt_at_every_dead_entry_agree_with_the_plain_list(
    steps: list[tuple[str, Any]],
) -> None:
    """Waiters kept filed between cycles leave dead heap entries behind their groups' heads;
    rebuilt as soon as there is one, the heads and the order are still the plain list's."""
    slack = SpotWaiters.COMPACT_SLACK
    SpotWaiters.COMPACT_SLACK = -(10**9)  # any entry left behind rebuilds the heaps
    try:
        _agree(steps)
    finally:
        SpotWaiters.COMPACT_SLACK = slack


def test_waiters_that_leave_behind_a_head_kept_for_cycles_leave_bounded_heaps() -> None:
    """One group's head stays for many cycles while later waiters come and go: its heap is
    rebuilt of the live entries (filed latest first, so a rebuild that does not re-heap names
    the wrong head), and the pool is kept for the earliest waiter throughout."""
    waiters = SpotWaiters(lambda r: make_gang(r.podsets))
    head = request("head", 0, 0, (1, 1))
    others = [request(f"w{i}", 0, 5000 - i, (1, 1)) for i in range(3000)]
    for r in others:
        waiters.waits(r)
    waiters.waits(head)
    ask = request("x", 0, 9999, capacity="any")
    compacted = 0
    for _ in range(10):
        others = others[250:]  # 250 later waiters left the queue since the last cycle
        staying = [head, *others]
        entries = sum(len(heap) for heap in waiters.heaps)
        waiters.begin(staying)
        filed = sum(len(heap) for heap in waiters.heaps)
        compacted += filed < entries - 250
        for heap in waiters.heaps:  # each group's entries still form a heap
            assert all(heap[(i - 1) // 2][:2] <= heap[i][:2] for i in range(1, len(heap)))
        assert len(waiters.active) == len(staying)
        assert filed <= 2 * len(staying) + SpotWaiters.COMPACT_SLACK
        got = waiters.kept_for(ask, POOLS[0], running=False)
        assert got is not None and got.job_id == "head"
    assert compacted
    waiters.forget("head")
    got = waiters.kept_for(ask, POOLS[0], running=False)
    earliest = min(others, key=key)
    assert got is not None and got.job_id == earliest.job_id
