"""Spot yielded to the spot-only jobs that wait for it: a running job that may use on-demand
moves there, make-before-break, when a queued spot-only job of equal or higher priority needs
its room and the move pays; a spot notice's reservation keeps that spot too; the scheduler
keeps the one list of waiters."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core.effects import split_reply
from broker.core.inputs import CancelJob, Checkpoint, Cycle, SubmitJob, Tick
from broker.core.invariants import violations
from broker.core.machine import Machine
from broker.core.placement import estimate, make_gang
from broker.core.scheduler import Scheduler
from broker.core.spotyield import MIN_RUN_S, freeing
from schemas.agent import (
    Cancel,
    CheckpointNow,
    CheckpointReport,
    ClusterSnapshot,
    Dispatch,
    FlavorInfo,
    Heartbeat,
    NodeInfo,
    SpotNotice,
)
from schemas.config import BrokerConfig, QueueConfig
from schemas.job import CheckpointSpec, JobSpec
from tests.core.helpers import NOW, config, flavor, gang, nodes
from tests.core.spot_pools import Agent, dispatches, live_attempts, running, sends, spot_job

CKPT = CheckpointSpec(uri="s3://b/ck", interval_s=600, cost_s=30)


def _world(
    spot_nodes: int = 1, od_nodes: int = 1, od_gpu: str = "a100", od_price: float = 2.2
) -> tuple[Machine, Agent]:
    """One cluster: `spot_nodes` V100 spot nodes ($0.9) and `od_nodes` on-demand nodes, by
    default A100s at $2.2: $1.0 per V100-hour of work (an A100 runs 2.2x a V100), a little
    above the spot's $0.9."""
    return _cluster(
        [flavor("v100-spot", "spot", "v100", 0.9), flavor("od", "on-demand", od_gpu, od_price)],
        nodes("spot", "v100-spot", spot_nodes) + nodes("od", "od", od_nodes),
    )


def _cluster(flavors: list[FlavorInfo], node_list: list[NodeInfo]) -> tuple[Machine, Agent]:
    """A machine whose one cluster, "east", reported these pools and nodes."""
    m = Machine(BrokerConfig(queues=[QueueConfig(name="default")]))
    agent = Agent(m, "east")
    agent.send(ClusterSnapshot(flavors=flavors, nodes=node_list))
    return m, agent


def _submit(m: Machine, spec: JobSpec, at: float) -> None:
    reply, _ = split_reply(m.handle(SubmitJob(spec), at))
    assert reply.accepted, reply.error


def _tick(m: Machine, agent: Agent, at: float) -> list[object]:
    agent.send(Heartbeat(), now=at)
    return list(m.handle(Tick(), at))


def _flex_on_spot_and_a_spot_only_job_waiting(m: Machine, agent: Agent, **flex: object) -> Dispatch:
    """`flex` (any, checkpoints unless told otherwise) runs on spot; `spotty` waits for it."""
    spec = spot_job("flex", capacity="any", **({"checkpoint": CKPT} | flex))
    _submit(m, spec, NOW + 1)
    (d,) = dispatches(m.handle(Cycle(), NOW + 2))
    assert d.flavor == "v100-spot"
    running(agent, d, NOW + 60)
    _submit(m, spot_job("spotty"), NOW + 100)
    assert dispatches(m.handle(Cycle(), NOW + 101)) == []
    assert "spotty" in m.scheduler.spot_waiters
    return d


def test_a_flexible_job_moves_to_on_demand_make_before_break_for_a_waiting_spot_only_job() -> None:
    m, agent = _world()
    d = _flex_on_spot_and_a_spot_only_job_waiting(m, agent)
    # Too early: the flexible job has not run long enough for the move to pay.
    effects = _tick(m, agent, NOW + 60 + MIN_RUN_S / 2)
    assert sends(effects, CheckpointNow) == []  # type: ignore[arg-type]

    now = NOW + 60 + 3 * MIN_RUN_S
    effects = _tick(m, agent, now)
    record = m.jobs["flex"]
    # Make: on-demand is reserved and a checkpoint asked for; nothing cancelled yet.
    assert [c.attempt for c in sends(effects, CheckpointNow)] == [d.attempt]  # type: ignore[arg-type, attr-defined]
    assert sends(effects, Cancel) == [] and sends(effects, Dispatch) == []  # type: ignore[arg-type]
    assert record.preempting is not None and record.preempting.replacement is not None
    assert record.preempting.replacement.flavor == "od"
    assert live_attempts(m, "flex") == 1
    assert violations(m) == []

    # Break: the checkpoint lands; the spot attempt is cancelled before the on-demand one goes.
    report = CheckpointReport(job_id="flex", attempt=d.attempt, step=900, uri="s3://b/ck/900")
    effects = m.handle(Checkpoint(report), now + 30)
    kinds = [type(e.command).__name__ for e in effects if hasattr(e, "command")]
    assert kinds.index("Cancel") < kinds.index("Dispatch")
    (new,) = sends(effects, Dispatch)  # type: ignore[arg-type]
    assert isinstance(new, Dispatch) and new.flavor == "od"
    assert new.resume_from is not None and new.resume_from.step == 900
    assert record.preemptions == 0  # a move by choice, not a loss
    why = m.views.why("flex", now + 30)
    assert why is not None
    text = " ".join(r.message for r in why.reasons)
    assert "moved to on-demand: spotty, a spot-only job, waits for its spot" in text, text
    assert violations(m) == []

    # The spot-only job takes the spot it waited for.
    (spotty,) = dispatches(m.handle(Cycle(), now + 31))
    assert spotty.job_id == "spotty" and spotty.flavor == "v100-spot"
    assert "spotty" not in m.scheduler.spot_waiters
    assert violations(m) == []


def test_no_move_for_a_lower_priority_waiter_without_checkpoints_or_on_demand() -> None:
    # The waiter is of lower priority than the job on spot.
    m, agent = _world()
    spec = spot_job("flex", capacity="any", checkpoint=CKPT, priority=5)
    _submit(m, spec, NOW + 1)
    (d,) = dispatches(m.handle(Cycle(), NOW + 2))
    running(agent, d, NOW + 60)
    _submit(m, spot_job("spotty"), NOW + 100)
    assert dispatches(m.handle(Cycle(), NOW + 101)) == []
    assert sends(_tick(m, agent, NOW + 60 + 3 * MIN_RUN_S), CheckpointNow) == []  # type: ignore[arg-type]
    assert m.jobs["flex"].preempting is None

    # On-demand is full: nothing is reserved, nothing moves, nothing is left held.
    m, agent = _world(od_nodes=0)
    _flex_on_spot_and_a_spot_only_job_waiting(m, agent)
    assert sends(_tick(m, agent, NOW + 60 + 3 * MIN_RUN_S), CheckpointNow) == []  # type: ignore[arg-type]
    assert sorted(k[0] for k in m.scheduler.allocations()) == ["flex"]
    assert m.scheduler.reservations() == {}


def test_a_move_to_dear_on_demand_pays_only_for_a_waiter_bigger_than_the_mover() -> None:
    # V100 on-demand at $3.0 against $0.9 spot: 8 GPUs of waiter gain less than 8 GPUs of
    # mover pay more.
    m, agent = _world(od_gpu="v100", od_price=3.0)
    _flex_on_spot_and_a_spot_only_job_waiting(m, agent)
    assert sends(_tick(m, agent, NOW + 60 + 3 * MIN_RUN_S), CheckpointNow) == []  # type: ignore[arg-type]
    assert m.scheduler.reservations() == {}
    # The A100 on-demand booked for it costs about what spot does per unit of work, but what it
    # takes there a later job pays for on the V100 on-demand beside it: priced at that.
    m, agent = _cluster(
        [
            flavor("v100-spot", "spot", "v100", 0.9),
            flavor("od", "on-demand", "a100", 2.2),
            flavor("v100-od", "on-demand", "v100", 3.0),
        ],
        nodes("spot", "v100-spot", 1) + nodes("od", "od", 1) + nodes("v", "v100-od", 1),
    )
    _flex_on_spot_and_a_spot_only_job_waiting(m, agent)
    assert sends(_tick(m, agent, NOW + 60 + 3 * MIN_RUN_S), CheckpointNow) == []  # type: ignore[arg-type]
    assert m.scheduler.reservations() == {}
    # A 2-GPU mover for an 8-GPU waiter: 8 x 0.9 gained against 2 x (3.0 - 0.9) paid.
    m, agent = _world(od_gpu="v100", od_price=3.0)
    d = _flex_on_spot_and_a_spot_only_job_waiting(m, agent, gpu=2)
    effects = _tick(m, agent, NOW + 60 + 3 * MIN_RUN_S)
    assert [c.attempt for c in sends(effects, CheckpointNow)] == [d.attempt]  # type: ignore[arg-type, attr-defined]


def test_no_move_for_a_job_that_writes_no_checkpoint() -> None:
    # The move that pays for a job that checkpoints (above), but this one writes none.
    m, agent = _world(od_gpu="v100", od_price=3.0)
    spot_ok = {"muster.dev/spot-ok": "true"}
    d = _flex_on_spot_and_a_spot_only_job_waiting(m, agent, gpu=2, checkpoint=None, labels=spot_ok)
    effects = _tick(m, agent, NOW + 60 + 3 * MIN_RUN_S)
    assert sends(effects, Cancel) == [] and sends(effects, Dispatch) == []  # type: ignore[arg-type]
    record = m.jobs["flex"]
    assert record.state == "running" and record.current is not None
    assert record.current.attempt == d.attempt and record.current.flavor == "v100-spot"


def test_a_notice_reservation_leaves_a_waiters_spot_and_books_on_demand() -> None:
    """`flex` (4 GPUs, any) runs on A100 spot. `big` (spot-only, 8 V100s) waits for V100 spot,
    where `half` holds 4 of the 8 GPUs. A notice on flex's node would reserve those 4 free
    V100 spot GPUs (the lost pool is avoided), which big waits for: it books on-demand."""
    m, agent = _cluster(
        [
            flavor("v100-spot", "spot", "v100", 0.9),
            flavor("a100-spot", "spot", "a100", 1.5),
            flavor("v100-od", "on-demand", "v100"),
        ],
        nodes("v", "v100-spot", 1) + nodes("a", "a100-spot", 1) + nodes("od", "v100-od", 1),
    )
    _submit(m, spot_job("half", gpu=4, gpu_types=["v100"]), NOW + 1)
    _submit(m, spot_job("flex", gpu=4, capacity="any", checkpoint=CKPT), NOW + 2)
    placed = {d.job_id: d for d in dispatches(m.handle(Cycle(), NOW + 3))}
    assert placed["flex"].flavor == "a100-spot" and placed["half"].flavor == "v100-spot"
    running(agent, placed["flex"], NOW + 60)
    _submit(m, spot_job("big", gpu_types=["v100"]), NOW + 100)
    assert dispatches(m.handle(Cycle(), NOW + 101)) == []
    assert "big" in m.scheduler.spot_waiters
    agent.send(SpotNotice(node="a-0", deadline=NOW + 320), now=NOW + 200)
    record = m.jobs["flex"]
    assert record.preempting is not None and record.preempting.replacement is not None
    assert record.preempting.replacement.flavor == "v100-od"
    assert record.spot_fallback is not None
    assert record.spot_fallback.startswith("skipped spot on east/v100-spot: big"), (
        record.spot_fallback
    )
    assert violations(m) == []


def test_the_waiter_list_has_one_owner_and_forgets_jobs_that_left_the_queue() -> None:
    m, _ = _world(spot_nodes=1, od_nodes=0)
    _submit(m, spot_job("first"), NOW + 1)
    assert len(dispatches(m.handle(Cycle(), NOW + 2))) == 1
    _submit(m, spot_job("second"), NOW + 3)
    m.handle(Cycle(), NOW + 4)
    assert list(m.scheduler.spot_waiters.ids) == ["second"]
    assert not hasattr(m, "_spot_waiters")
    m.handle(CancelJob("second", "not needed"), NOW + 5)
    assert list(m.scheduler.spot_waiters.ids) == []
    assert m.scheduler.spot_waiters.active == []


@settings(max_examples=200, deadline=None)
@given(
    taken=st.lists(st.sampled_from([1, 2, 4, 8]), max_size=8),
    spot_nodes=st.integers(1, 3),
    want=st.tuples(st.integers(1, 2), st.sampled_from([2, 4, 8])),
    data=st.data(),
)
def test_freeing_moves_the_fewest_in_order_that_make_room_for_the_waiter(
    taken: list[int], spot_nodes: int, want: tuple[int, int], data: st.DataObject
) -> None:
    s = Scheduler(config())
    s.apply_snapshot(
        "c", [flavor("spot", "spot", "v100", 0.9)], nodes("s", "spot", spot_nodes), NOW
    )
    s.schedule([gang(f"t{i}", (1, g), capacity="spot", order=i) for i, g in enumerate(taken)], NOW)
    pool = s.cluster_states()["c"].pools["spot"]
    movable = data.draw(st.permutations(s.allocations_on(pool.key)))
    waiter = gang("w", want, capacity="spot", order=100)
    g = make_gang(waiter.podsets)
    chosen = freeing(pool, g, [], movable)
    if chosen is None:
        if estimate(pool, g) is None:
            for a in movable:  # not even moving every job makes room
                s.release(a.job_id, a.key[1])
            assert estimate(pool, g) is None
        return
    order = [movable.index(a) for a in chosen]
    assert order == sorted(order)  # in the order given
    for a in chosen[:-1]:
        s.release(a.job_id, a.key[1])
    assert estimate(pool, g) is None  # one fewer is not enough
    s.release(chosen[-1].job_id, chosen[-1].key[1])
    result = s.schedule([waiter], NOW + 1)
    assert [p.flavor for _, p in result.admitted] == ["spot"]
