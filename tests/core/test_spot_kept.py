"""Spot is kept for the spot-only jobs that wait for it: a job that may run on on-demand
(`any`, `spot-then-on-demand`) does not take spot that an earlier queued spot-only job, which
fits that pool, waits for. It takes on-demand instead, and `muster why` says which job it left
the spot to."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core.effects import split_reply
from broker.core.inputs import CYCLE, AgentBatch, CancelJob, SubmitJob
from broker.core.machine import Machine
from broker.core.placement import Waiter, make_gang, spot_kept_for
from broker.core.scheduler import Scheduler
from broker.core.spotwait import order_key
from broker.core.types import GangRequest
from schemas.agent import ClusterSnapshot, EventBatch
from schemas.config import BrokerConfig, QueueConfig
from schemas.job import CapacityPreference, CheckpointSpec
from tests.core.helpers import NOW, config, flavor, gang, nodes
from tests.core.spot_pools import dispatches, spot_job


def _machine(od_nodes: int = 1, a100_spot: int = 0) -> Machine:
    """One cluster: one v100 spot node of 8 GPUs, `od_nodes` v100 on-demand nodes and
    `a100_spot` a100 spot nodes."""
    m = Machine(BrokerConfig(queues=[QueueConfig(name="default")]))
    snap = ClusterSnapshot(
        flavors=[
            flavor("v100-spot", "spot", "v100", 0.9),
            flavor("v100-od", "on-demand", "v100"),
            flavor("a100-spot", "spot", "a100", 1.5),
        ],
        nodes=nodes("spot", "v100-spot", 1)
        + nodes("od", "v100-od", od_nodes)
        + nodes("a", "a100-spot", a100_spot),
    )
    batch = EventBatch(cluster="east", instance="a-1", seq=1, events=[snap])
    m.handle(AgentBatch("east", batch), NOW)
    return m


def _submit(m: Machine, name: str, at: float, **kw: object) -> None:
    if kw.get("capacity") in ("any", "spot-then-on-demand"):
        kw["checkpoint"] = CheckpointSpec(uri=f"s3://ckpt/{name}")  # spot is fine for it
    reply, _ = split_reply(m.handle(SubmitJob(spot_job(name, **kw)), at))  # type: ignore[arg-type]
    assert reply.accepted, reply.error


def _cycle(m: Machine, at: float) -> list[tuple[str, str]]:
    return [(d.job_id, d.flavor) for d in dispatches(m.handle(CYCLE, at))]


def _why(m: Machine, job_id: str, at: float) -> str:
    why = m.views.why(job_id, at)
    assert why is not None
    return " ".join(r.message for r in why.reasons) + f" | {why.waiting_for}"


def _spot_half_taken_and_a_big_spot_job_waiting(od_nodes: int = 1) -> Machine:
    m = _machine(od_nodes)
    _submit(m, "first", NOW + 1, gpu=4)  # spot-only: half the spot node
    assert _cycle(m, NOW + 2) == [("first", "v100-spot")]
    _submit(m, "big", NOW + 3, gpu=8)  # spot-only: needs the whole node, waits
    assert _cycle(m, NOW + 4) == []
    return m


def test_a_flexible_job_leaves_the_spot_to_the_waiting_spot_only_job_and_why_says_so() -> None:
    m = _spot_half_taken_and_a_big_spot_job_waiting()
    _submit(m, "flex", NOW + 10, gpu=4, capacity="any")  # 4 GPUs of spot are free
    assert _cycle(m, NOW + 11) == [("flex", "v100-od")]
    text = _why(m, "flex", NOW + 12)
    assert "skipped spot on east/v100-spot: big, a spot-only job queued earlier" in text, text
    assert m.jobs["big"].state == "queued"


def test_a_spot_first_job_falls_back_at_once_and_says_to_whom() -> None:
    m = _spot_half_taken_and_a_big_spot_job_waiting()
    _submit(m, "stod", NOW + 10, gpu=4, capacity="spot-then-on-demand")
    assert _cycle(m, NOW + 11) == [("stod", "v100-od")]
    record = m.jobs["stod"]
    assert record.spot_exhausted
    assert "skipped spot on east/v100-spot: big" in _why(m, "stod", NOW + 12)


def test_with_on_demand_full_the_flexible_job_waits_for_it_not_for_the_spot() -> None:
    m = _spot_half_taken_and_a_big_spot_job_waiting(od_nodes=0)
    _submit(m, "flex", NOW + 10, gpu=4, capacity="any")
    assert _cycle(m, NOW + 11) == []
    why = m.views.why("flex", NOW + 12)
    assert why is not None
    assert [r.code for r in why.reasons][:1] == ["spot-held"], why.reasons
    assert "kept for an earlier spot-only job" in why.waiting_for


def test_spot_goes_to_the_flexible_job_when_no_earlier_spot_only_job_can_use_it() -> None:
    # The waiter is of lower priority: the flexible job is ahead of it.
    m = _machine()
    _submit(m, "first", NOW + 1, gpu=4)
    _cycle(m, NOW + 2)
    _submit(m, "big", NOW + 3, gpu=8, priority=-5)
    assert _cycle(m, NOW + 4) == []
    _submit(m, "flex", NOW + 10, gpu=4, capacity="any")
    assert _cycle(m, NOW + 11) == [("flex", "v100-spot")]
    # The waiter asks for another GPU type: it never takes this pool.
    m = _machine(a100_spot=1)
    _submit(m, "first", NOW + 1, gpu=4, gpu_types=["v100"])
    _submit(m, "a100-first", NOW + 1, gpu=8, gpu_types=["a100"])
    assert len(_cycle(m, NOW + 2)) == 2
    _submit(m, "a100-only", NOW + 3, gpu=8, gpu_types=["a100"])
    assert _cycle(m, NOW + 4) == []
    _submit(m, "flex", NOW + 10, gpu=4, capacity="any")
    assert _cycle(m, NOW + 11) == [("flex", "v100-spot")]
    # A waiter that left the queue holds nothing.
    m = _spot_half_taken_and_a_big_spot_job_waiting()
    assert m.handle(CancelJob("big", "not needed"), NOW + 5)
    _submit(m, "flex", NOW + 10, gpu=4, capacity="any")
    assert _cycle(m, NOW + 11) == [("flex", "v100-spot")]


def _req(
    job_id: str, order: int, gpus: int, capacity: CapacityPreference, priority: int = 0
) -> GangRequest:
    return gang(job_id, (1, gpus), capacity=capacity, priority=priority, order=order)


def test_only_a_flexible_job_behind_the_waiter_yields_and_only_on_spot() -> None:
    s = Scheduler(config())
    s.apply_snapshot(
        "c",
        [flavor("spot", "spot", "v100", 0.9), flavor("od", gpu_type="v100")],
        nodes("s", "spot", 1) + nodes("o", "od", 1),
        NOW,
    )
    spot = s.cluster_states()["c"].pools["spot"]
    od = s.cluster_states()["c"].pools["od"]
    waiter = _req("w", 1, 8, "spot")
    waiters = [Waiter(order_key(waiter), waiter, make_gang(waiter.podsets))]
    assert spot_kept_for(_req("a", 2, 1, "any"), spot, waiters) is waiter
    assert spot_kept_for(_req("b", 2, 1, "spot-then-on-demand"), spot, waiters) is waiter
    assert spot_kept_for(_req("c", 2, 1, "spot"), spot, waiters) is None  # spot-only: its turn
    assert spot_kept_for(_req("d", 2, 1, "any"), od, waiters) is None  # not spot
    assert spot_kept_for(_req("e", 0, 1, "any"), spot, waiters) is None  # earlier than it
    assert spot_kept_for(_req("f", 2, 1, "any", priority=1), spot, waiters) is None
    big = _req("g", 1, 16, "spot")  # never fits the 8-GPU pool: nothing to wait for there
    kept = spot_kept_for(
        _req("h", 2, 1, "any"), spot, [Waiter(order_key(big), big, make_gang(big.podsets))]
    )
    assert kept is None


_CAPACITIES: list[CapacityPreference] = ["spot", "any", "spot-then-on-demand", "on-demand"]


@settings(max_examples=150, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(st.sampled_from(_CAPACITIES), st.sampled_from([1, 2, 4, 8]), st.integers(0, 2)),
        min_size=1,
        max_size=12,
    ),
    taken=st.lists(st.sampled_from([1, 2, 4]), max_size=4),
    spot_nodes=st.integers(1, 3),
)
def test_a_flexible_job_never_takes_spot_an_earlier_waiting_spot_only_job_fits_in(
    jobs: list[tuple[CapacityPreference, int, int]], taken: list[int], spot_nodes: int
) -> None:
    s = Scheduler(config())
    s.apply_snapshot(
        "c",
        [flavor("spot", "spot", "v100", 0.9), flavor("od", gpu_type="v100")],
        nodes("s", "spot", spot_nodes) + nodes("o", "od", 2),
        NOW,
    )
    # Spot-only jobs already running leave the spot pool fragmented.
    first = [_req(f"t{i}", i, g, "spot") for i, g in enumerate(taken)]
    s.schedule(first, NOW)
    requests = [
        _req(f"j{i}", 100 + i, g, capacity, priority)
        for i, (capacity, g, priority) in enumerate(jobs)
    ]
    result = s.schedule(requests, NOW + 1)
    placed = dict(result.admitted)
    # Every gang here fits an empty spot node, and no job is limited to a GPU type: any
    # spot-only job left waiting for capacity fits the spot pool.
    waiting = [
        (-w.priority, w.order)
        for w in requests
        if w.capacity == "spot"
        and any(x.code == "insufficient-capacity" for x in result.pending.get(w.job_id, ()))
    ]
    for r in requests:
        p = placed.get(r.job_id)
        if p is None or p.flavor != "spot" or r.capacity == "spot":
            continue
        assert not any(w < (-r.priority, r.order) for w in waiting), f"{r.job_id} took held spot"
