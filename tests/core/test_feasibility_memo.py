"""`Scheduler.check_feasible` answers alike submissions from a memo: whatever the fleet did in
between (nodes added, replaced, removed, healed, noticed; clusters reported or lost), the
memoised answer is the one a fresh computation gives."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.core.scheduler import Scheduler
from broker.core.types import GangRequest
from tests.core.fleet_changes import apply, changes
from tests.core.helpers import config, gang, queue

QUEUES = [
    queue("default"),
    queue("capped", quotas={"od": {"gpu": (8, 4, None)}}),
]


@st.composite
def requests(draw: st.DrawFn) -> GangRequest:
    sets = draw(
        st.lists(
            st.tuples(st.integers(1, 4), st.sampled_from([0, 1, 2, 4, 8])), min_size=1, max_size=2
        )
    )
    req = gang(
        "j",
        *sets,
        cpu=draw(st.sampled_from([1000, 64_000])),
        capacity=draw(st.sampled_from(["any", "on-demand", "spot", "spot-then-on-demand"])),
        gpu_types=draw(st.sampled_from([(), ("a100",), ("t4",)])),
        spot_exhausted=draw(st.booleans()),
        order=1,
    )
    if draw(st.booleans()):
        req = dataclasses.replace(req, min_replicas={"p0": 1})
    return req


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.one_of(changes, requests()), min_size=1, max_size=30))
def test_memoised_feasibility_equals_a_fresh_computation(steps: list[object]) -> None:
    s = Scheduler(config(QUEUES))
    asked: list[GangRequest] = []
    for step in steps:
        if isinstance(step, GangRequest):
            asked.append(step)
        else:
            apply(s, step)  # type: ignore[arg-type]
        # every submission so far asked again, in each queue: repeated shapes come from the
        # memo, and a shape alike in two queues may be admissible in one only
        for req in asked:
            for name in ("default", "capped"):
                alike = dataclasses.replace(req, queue=name)
                assert s.check_feasible(alike) == s.check_feasible_fresh(alike)
