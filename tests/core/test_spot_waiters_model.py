"""`SpotWaiters` kept by index against the same operations done the plain way: after any
sequence of cycles begun, waits, forgets and settles, the waiters and their order agree."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core.spotwait import SpotWaiters
from broker.core.types import GangRequest, PodSetDemand, Reason

JOBS = [f"j{i}" for i in range(8)]
DEMAND = (PodSetDemand(podset="w", replicas=1, gpu=8, cpu_milli=0, memory=0, extended=()),)
CAPACITY = (Reason("insufficient-capacity", "no room"),)
OTHER = (Reason("quota-exceeded", "over quota"),)


def request(job: str, priority: int, order: int) -> GangRequest:
    return GangRequest(
        job_id=job,
        attempt=1,
        queue="q",
        priority=priority,
        order=order,
        podsets=DEMAND,
        capacity="spot",
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


requests = st.builds(request, st.sampled_from(JOBS), st.integers(0, 2), st.integers(0, 5))
ops = st.one_of(
    st.tuples(st.just("begin"), st.lists(requests, max_size=5, unique_by=lambda r: r.job_id)),
    st.tuples(st.just("waits"), requests),
    st.tuples(st.just("forget"), st.sampled_from(JOBS)),
    st.tuples(
        st.just("settle"),
        st.lists(
            st.tuples(requests, st.sampled_from(["capacity", "other", "admitted"])), max_size=5
        ),
    ),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(ops, max_size=30))
def test_the_indexed_waiters_agree_with_the_plain_list(steps: list[tuple[str, Any]]) -> None:
    kept, plain = SpotWaiters(lambda r: None), Plain()  # type: ignore[arg-type, return-value]
    for op, arg in steps:
        if op == "begin":
            kept.begin(arg)
            plain.begin(arg)
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
        assert [w.job_id for w, _ in kept.active] == [w.job_id for w in plain.active]
        assert list(kept.ids) == list(plain.ids)
        for job in JOBS:
            assert (job in kept) == (job in plain.ids)
