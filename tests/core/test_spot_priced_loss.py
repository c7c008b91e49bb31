"""A `spot-then-on-demand` job that writes no checkpoint loses its whole run at every reclaim:
it takes spot or on-demand, whichever costs less per unit of work with that loss priced into
spot (risk.py), unless it or its queue says spot is fine. And a spot-only gang of several
nodes waits for the pool where it meets the fewest reclaims per unit of work, not only the
cheapest work."""

from __future__ import annotations

import dataclasses

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core.placement import capacity_rank
from broker.core.risk import expected_cost_per_hour
from broker.core.scheduler import Scheduler
from schemas.agent import FlavorInfo, NodeInfo
from schemas.config import QueueConfig
from schemas.job import CheckpointSpec
from tests.core.harness import OD, SPOT, Sim, run
from tests.core.strategies import CLASSES, fleets, queue_sets, requests

from .helpers import NOW, config, flavor, gang, one_cluster
from .scheduler_model import Model, check_admission, check_state, load_fleet

PRIOR = 0.5  # reclaims per node-hour: a job without checkpoints expects to lose 1 / rate = 2 h


def _fleet(spot_price: float, od_price: float, spot_nodes: int = 2, od_nodes: int = 2) -> Scheduler:
    spot = flavor("spot", "spot", "a100", spot_price)
    od = flavor("od", "on-demand", "a100", od_price)
    return one_cluster([(spot, spot_nodes), (od, od_nodes)], spot_prior_rate=PRIOR)


def _where(
    s: Scheduler,
    spot_ok: bool = True,
    checkpoint_interval_s: float | None = None,
    spot_exhausted: bool = False,
) -> str | None:
    req = gang(
        "j",
        (1, 8),
        capacity="spot-then-on-demand",
        checkpoint_interval_s=checkpoint_interval_s,
        spot_exhausted=spot_exhausted,
    )
    res = s.schedule([dataclasses.replace(req, spot_ok=spot_ok)], NOW)
    return res.admitted[0][1].flavor if res.admitted else None


def test_without_checkpoints_on_demand_wins_when_the_priced_loss_makes_spot_dearer() -> None:
    # spot $1 with a 2 h loss per reclaim at 0.5 per hour: $2 per hour of progress
    assert _where(_fleet(1.0, 1.5), spot_ok=False) == "od"
    assert _where(_fleet(1.0, 2.5), spot_ok=False) == "spot"


def test_a_checkpoint_or_spot_ok_keeps_spot_first_whatever_on_demand_costs() -> None:
    assert _where(_fleet(1.0, 1.5), spot_ok=False, checkpoint_interval_s=600.0) == "spot"
    assert _where(_fleet(1.0, 1.5)) == "spot"  # spot_ok: the label or the queue said so


def test_the_cheaper_capacity_full_the_job_takes_the_other_at_once() -> None:
    s = _fleet(1.0, 1.5, od_nodes=1)
    ((_, p),) = s.schedule([gang("fill", (1, 8), capacity="on-demand")], NOW).admitted
    assert p.flavor == "od"
    assert _where(s, spot_ok=False) == "spot"  # no wait for on-demand
    for ok, where in ((False, "od"), (True, None)):
        s = _fleet(1.0, 3.0, spot_nodes=1)  # spot is the cheaper even with the loss priced in
        ((_, p),) = s.schedule([gang("fill", (1, 8), capacity="spot")], NOW).admitted
        assert p.flavor == "spot"
        # no wait for spot either; one that may go to spot at its price waits for it
        assert _where(s, spot_ok=ok) == where


def test_fallen_back_it_takes_on_demand_only() -> None:
    assert capacity_rank("spot-then-on-demand", True, "spot", spot_ok=False) == -1
    assert _where(_fleet(1.0, 5.0), spot_ok=False, spot_exhausted=True) == "od"


@settings(max_examples=150, deadline=None)
@given(
    spot_price=st.sampled_from([0.3, 0.9, 1.5, 2.5]),
    od_price=st.sampled_from([0.5, 1.2, 2.0, 3.5, 6.0]),
    rate=st.sampled_from([0.0, 0.1, 0.5, 2.0]),
    spot_free=st.booleans(),
    od_free=st.booleans(),
    checkpoint=st.sampled_from([None, 600.0]),
    spot_ok=st.booleans(),
)
def test_the_choice_is_the_rank_then_the_priced_cost_of_the_pools_with_room(
    spot_price: float,
    od_price: float,
    rate: float,
    spot_free: bool,
    od_free: bool,
    checkpoint: float | None,
    spot_ok: bool,
) -> None:
    s = one_cluster(
        [
            (flavor("spot", "spot", "a100", spot_price), 1),
            (flavor("od", "on-demand", "a100", od_price), 1),
        ],
        spot_prior_rate=rate,
    )
    fill = [
        gang(f"fill-{k}", (1, 8), capacity=k)
        for k, free in (("spot", spot_free), ("on-demand", od_free))
        if not free
    ]
    assert len(s.schedule(fill, NOW).admitted) == len(fill)
    req = gang("j", (1, 8), capacity="spot-then-on-demand", checkpoint_interval_s=checkpoint)
    spot_ok = spot_ok or checkpoint is not None  # as records.spot_ok derives it
    req = dataclasses.replace(req, spot_ok=spot_ok)
    got = s.schedule([req], NOW).admitted
    where = got[0][1].flavor if got else None
    room = [f for f, free in (("spot", spot_free), ("od", od_free)) if free]
    if spot_ok:
        # spot first; on-demand only when no spot pool could ever host it (never here)
        assert where == ("spot" if spot_free else None)
        return
    cost = {
        "spot": expected_cost_per_hour(spot_price, 8, rate, 1, None, 1.0),
        "od": od_price * 8,
    }
    if not room:
        assert where is None
        return
    best = min(cost[f] for f in room)
    assert where in room and cost[where] <= best * 1.01 + 1e-9


@settings(max_examples=100, deadline=None)
@given(fleet=fleets(), queues=queue_sets(), data=st.data())
def test_invariants_hold_with_jobs_that_may_not_go_to_spot_at_its_price(
    fleet: dict[str, tuple[list[FlavorInfo], list[NodeInfo]]],
    queues: list,  # type: ignore[type-arg]
    data: st.DataObject,
) -> None:
    """Quotas, whole gangs on one pool of an allowed capacity, per-node capacity."""
    s = Scheduler(config(queues=queues, classes=CLASSES, spot_prior_rate=0.5))
    m = Model()
    load_fleet(s, m, fleet, NOW)
    qnames = [q.name for q in queues]
    reqs = [
        dataclasses.replace(
            r := data.draw(requests(f"j{i}", qnames)),
            spot_ok=r.checkpoint_interval_s is not None or data.draw(st.booleans()),
        )
        for i in range(data.draw(st.integers(1, 8)))
    ]
    res = s.schedule(reqs, NOW)
    by_id = {r.job_id: r for r in reqs}
    for job, p in res.admitted:
        r = by_id[job]
        m.allocs[(job, 1)] = (r, p)
        check_admission(m, r, p)
        kind = m.flavors[p.cluster][p.flavor].capacity_type
        assert capacity_rank(r.capacity, r.spot_exhausted, kind, r.spot_ok) >= 0
    check_state(s, m)


# -- the machine: what `muster why` says, and the queue's say -------------------------------


def _machine(od_price: float, **queue: object) -> Sim:
    from broker.core.machine import Machine
    from schemas.config import BrokerConfig

    w = Sim.empty()
    w.m = Machine(BrokerConfig(queues=[QueueConfig(name="q", **queue)]), epoch=3)  # type: ignore[arg-type]
    w.cluster("s", flavor=SPOT)
    w.cluster("o", flavor=msgspec.structs.replace(OD, price_per_gpu_hour=od_price))
    return w


def _placed_why(w: Sim, job: str) -> str:
    w.cycle()
    record = w.m.jobs[job]
    assert record.current is not None
    run(w, job, record.current.cluster, 1)
    why = w.m.views.why(job, w.now)
    assert why is not None
    (placed,) = why.reasons
    return placed.message


def test_why_names_the_priced_loss_on_either_capacity() -> None:
    # the harness' spot is $1 at the 0.5 prior: $2 per hour of progress without checkpoints
    w = _machine(1.5)
    job = w.submit("plain", capacity="spot-then-on-demand")
    text = _placed_why(w, job)
    assert text.startswith("on o/od (on-demand, A100, $1.5/GPU-h): the job writes no checkpoint")
    assert "spot cost more per unit of work than this pool, or had no room" in text
    w = _machine(3.0)
    job = w.submit("plain", capacity="spot-then-on-demand")
    text = _placed_why(w, job)
    assert text.startswith("on s/spot (spot, A100, $1/GPU-h): the job writes no checkpoint")
    assert text.endswith("spot was still the cheapest work with room")


def test_a_checkpoint_the_label_or_the_queue_keep_spot_first() -> None:
    w = _machine(1.5)
    ckpt = w.submit(
        "ckpt", capacity="spot-then-on-demand", checkpoint=CheckpointSpec(uri="s3://b/c")
    )
    assert _placed_why(w, ckpt).endswith("spot first (capacity spot-then-on-demand)")
    w = _machine(1.5)
    said = w.submit("said", capacity="spot-then-on-demand", labels={"muster.dev/spot-ok": "true"})
    assert _placed_why(w, said).startswith("on s/spot")
    w = _machine(1.5, spot_without_checkpoint=True)
    queued = w.submit("queue-said", capacity="spot-then-on-demand")
    assert _placed_why(w, queued).startswith("on s/spot")
    assert w.m.jobs[queued].spec.labels["muster.dev/spot-ok"] == "queue"


# -- multi-node spot-only gangs: fewest reclaims per unit of work ---------------------------


def _fast_and_slow(fast_nodes: int, rate: float) -> Scheduler:
    """Two spot pools of equal cost per unit of work (the A100 runs 2.2x, at 2.2x the price),
    reclaimed alike per node-hour: the slow one meets 2.2x the reclaims per unit of work."""
    pools = [
        (flavor("fast", "spot", "a100", 2.2), fast_nodes),
        (flavor("slow", "spot", "v100", 1.0), 8),
    ]
    return one_cluster(pools, spot_prior_rate=rate, gpu_speeds={"a100": 2.2, "v100": 1.0})


def test_a_spot_only_gang_waits_for_the_pool_with_fewer_reclaims_per_unit_of_work() -> None:
    s = _fast_and_slow(8, 0.5)
    ((_, filler),) = s.schedule([gang("fill", (8, 8), capacity="spot")], NOW).admitted
    assert filler.flavor == "fast"
    res = s.schedule(
        [
            gang("big", (4, 8), capacity="spot"),
            gang("one", (1, 8), capacity="spot"),
            gang("flex", (4, 8), capacity="spot-then-on-demand", checkpoint_interval_s=600.0),
        ],
        NOW,
    )
    assert sorted((j, p.flavor) for j, p in res.admitted) == [("flex", "slow"), ("one", "slow")]


def test_without_reclaims_or_when_the_quiet_pool_can_never_host_it_the_gang_goes_now() -> None:
    s = _fast_and_slow(8, 0.0)
    s.schedule([gang("fill", (8, 8), capacity="spot")], NOW)
    ((_, p),) = s.schedule([gang("big", (4, 8), capacity="spot")], NOW).admitted
    assert p.flavor == "slow"
    s = _fast_and_slow(2, 0.5)
    ((_, p),) = s.schedule([gang("big", (4, 8), capacity="spot")], NOW).admitted
    assert p.flavor == "slow"
