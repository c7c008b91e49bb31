"""A spot-then-on-demand job waits for spot only while the wait can get it spot: behind an
earlier job that waits for the same spot with no bigger gang, whatever frees goes there first,
so it takes on-demand at once instead of after `spot.fallback_after_wait_s`."""

from __future__ import annotations

from broker.core.effects import split_reply
from broker.core.inputs import CYCLE, SubmitJob
from broker.core.machine import Machine
from broker.core.placement import futile_spot_waits
from broker.core.types import GangRequest, PodSetDemand
from schemas.job import CapacityPreference
from tests.core.helpers import NOW
from tests.core.spot_pools import SPOT_OK, dispatches, setup, spot_job


def _submit(m: Machine, name: str, at: float, **kw: object) -> None:
    reply, _ = split_reply(m.handle(SubmitJob(spot_job(name, **kw)), at))  # type: ignore[arg-type]
    assert reply.accepted, reply.error


def _cycles(m: Machine, start: float, count: int = 3) -> list[tuple[str, str]]:
    sent = []
    for i in range(count):
        sent += [(d.job_id, d.flavor) for d in dispatches(m.handle(CYCLE, start + i))]
    return sent


def test_behind_a_waiting_spot_job_it_takes_on_demand_at_once_and_why_says_so() -> None:
    m, _ = setup()  # spot emptied, one on-demand node
    _submit(m, "spot-first", NOW + 2)
    assert _cycles(m, NOW + 3) == []  # a spot-only job waits for spot
    _submit(m, "flexible", NOW + 10, capacity="spot-then-on-demand", labels=SPOT_OK)
    assert _cycles(m, NOW + 11) == [("flexible", "v100-od")]  # seconds, not 600 s
    why = m.views.why("flexible", NOW + 20)
    assert why is not None
    text = " ".join(r.message for r in why.reasons)
    assert "stopped waiting for spot: spot-first" in text, text
    assert m.jobs["spot-first"].state == "queued"  # still waiting: spot-only


def test_alone_or_behind_a_bigger_or_lower_priority_job_it_still_waits_for_spot() -> None:
    m, _ = setup()
    _submit(m, "alone", NOW + 2, capacity="spot-then-on-demand", labels=SPOT_OK)
    assert _cycles(m, NOW + 3) == []  # nothing ahead: spot may free within its wait
    m, _ = setup()
    _submit(m, "big", NOW + 2, replicas=2)  # needs both spot nodes; one freed fits the next
    _submit(m, "after-big", NOW + 3, capacity="spot-then-on-demand", labels=SPOT_OK)
    assert _cycles(m, NOW + 4) == []
    m, _ = setup()
    _submit(m, "low", NOW + 2, priority=-5)
    _submit(m, "after-low", NOW + 3, capacity="spot-then-on-demand", labels=SPOT_OK)
    assert _cycles(m, NOW + 4) == []  # it is ahead of the lower-priority job


def _req(
    job_id: str,
    order: int,
    gpus: int = 8,
    capacity: CapacityPreference = "spot",
    gpu_types: frozenset[str] = frozenset(),
    priority: int = 0,
    exhausted: bool = False,
) -> GangRequest:
    return GangRequest(
        job_id=job_id,
        attempt=1,
        queue="q",
        priority=priority,
        order=order,
        podsets=(PodSetDemand("w", 1, gpus, 1000, 1),),
        gpu_types=gpu_types,
        capacity=capacity,
        spot_exhausted=exhausted,
    )


def test_only_an_earlier_waiter_that_wants_what_it_wants_makes_the_wait_futile() -> None:
    flex = "spot-then-on-demand"
    v100, a100 = frozenset({"v100"}), frozenset({"a100"})
    waits = futile_spot_waits(
        [
            _req("later", 5, capacity=flex),
            _req("a100-only", 1, gpu_types=a100),  # wants other pools: says nothing
            _req("on-demand", 0, capacity="on-demand"),  # waits, but not for spot
            _req("fell-back", 2, capacity=flex, exhausted=True),  # no longer on spot
            _req("v100-job", 6, capacity=flex, gpu_types=v100),
            _req("any-type", 3, gpu_types=frozenset()),  # any GPU type: covers v100-job's
            _req("small-first", 7, gpus=16, capacity=flex),
        ]
    )
    assert waits == {"later": "any-type", "v100-job": "any-type", "small-first": "any-type"}
    assert futile_spot_waits([_req("only", 1, capacity=flex)]) == {}
    # A flexible job that still waits holds the ones behind it back as well.
    chain = [_req("big", 1, gpus=16), _req("f1", 2, capacity=flex), _req("f2", 3, capacity=flex)]
    assert futile_spot_waits(chain) == {"f2": "f1"}
    assert futile_spot_waits([_req("s", 1), *chain[1:]]) == {"f1": "s", "f2": "s"}
    # A first waiter restricted to one GPU type leaves a job of any type free to wait.
    assert futile_spot_waits([_req("t", 1, gpu_types=v100), _req("f", 2, capacity=flex)]) == {}
