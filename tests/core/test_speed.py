"""Placement by cost per unit of work: a job's speed per GPU type is learned from its own
checkpoint step rates (within one attempt), a declared figure wins, the broker's priors fill
the rest; pools are ranked by expected cost / speed, and equal speeds rank as before."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core.placement import build_candidates
from broker.core.records import compact
from broker.core.scheduler import Scheduler
from broker.core.speed import (
    MAX_TYPES,
    GpuRate,
    WorkPrice,
    job_figures,
    observe,
    speed_of,
    work_price_text,
)
from broker.core.types import GangRequest
from schemas.agent import CheckpointReport, FlavorInfo, NodeInfo, WorkloadStatus
from schemas.job import CheckpointSpec
from tests.core.harness import Sim, run
from tests.core.strategies import CLASSES, fleets, queue_sets, requests

from .helpers import NOW, config, flavor, gang, nodes, one_cluster
from .scheduler_model import Model, check_admission, check_state, load_fleet

PRIORS = {"v100": 1.0, "a100": 2.2, "t4": 0.3}


def _rates(**per_type: tuple[int, float]) -> list[GpuRate]:
    """GPU type -> (steps, seconds), learned through `observe` one attempt at a time."""
    rates: list[GpuRate] = []
    for attempt, (t, (steps, secs)) in enumerate(per_type.items(), start=1):
        observe(rates, (attempt - 1, 0, 0.0), attempt, t, 5, 10.0)  # first report: anchor only
        observe(rates, (attempt, 5, 10.0), attempt, t, 5 + steps, 10.0 + secs)
    return rates


def test_only_steps_within_one_attempt_count() -> None:
    rates: list[GpuRate] = []
    observe(rates, None, 1, "T4", 100, 50.0)  # no earlier checkpoint
    observe(rates, (1, 100, 50.0), 2, "t4", 400, 900.0)  # across a restart: restore gap
    assert rates == []
    observe(rates, (2, 400, 900.0), 2, "T4", 700, 1200.0)
    observe(rates, (2, 700, 1200.0), 2, "t4", 700, 1300.0)  # no new step: nothing
    assert rates == [GpuRate("t4", 300.0, 300.0)]


def test_memory_is_one_entry_per_gpu_type_and_bounded() -> None:
    rates: list[GpuRate] = []
    for i in range(MAX_TYPES + 5):
        for _ in range(2):
            observe(rates, (1, 0, 0.0), 1, f"g{i}", 10, 10.0 + i)
    assert len(rates) == MAX_TYPES
    assert len({r.gpu_type for r in rates}) == MAX_TYPES
    assert min(r.seconds for r in rates) >= 10.0 + 5  # the longest measured stay


def test_one_measured_type_says_nothing_and_two_set_the_ratio() -> None:
    assert job_figures({}, _rates(a100=(4000, 1000.0))) == ()
    assert speed_of((), PRIORS)("t4") == 0.3
    assert speed_of((), PRIORS)("h100") == 1.0  # not in the priors
    figures = job_figures({}, _rates(a100=(4000, 1000.0), t4=(1000, 1000.0)))
    speed = speed_of(figures, PRIORS)
    assert abs(speed("a100") / speed("t4") - 4.0) < 0.25
    assert abs(speed("a100") + speed("t4") - 2.5) < 1e-9  # on the priors' scale
    assert speed("v100") == 1.0  # never ran there: the prior
    # too short a stay on T4 to count yet
    assert job_figures({}, _rates(a100=(4000, 1000.0), t4=(10, 60.0))) == ()


@given(
    rates=st.dictionaries(
        st.sampled_from(["a100", "v100", "t4", "h100"]),
        st.floats(0.01, 1000.0),
        min_size=2,
    ),
    k=st.floats(0.01, 100.0),
)
def test_own_figures_are_ratios_on_the_priors_scale(rates: dict[str, float], k: float) -> None:
    """Only ratios count: scaling every rate leaves the speeds alone; the speeds of the types
    the job ran on sum to their priors' sum, and every speed is positive."""

    def measured(scale: float) -> list[GpuRate]:
        return [GpuRate(t, r * scale * 1000.0, 1000.0) for t, r in rates.items()]

    speed = speed_of(job_figures({}, measured(1.0)), PRIORS)
    scaled = speed_of(job_figures({}, measured(k)), PRIORS)
    assert all(abs(scaled(t) / speed(t) - 1.0) < 0.051 for t in rates)  # at most one 5 % step
    own = sum(speed(t) for t in rates)
    assert abs(own - sum(PRIORS.get(t, 1.0) for t in rates)) < 1e-6 * own
    assert all(speed(t) > 0 for t in ("a100", "v100", "t4", "h100", "x"))
    fastest = max(rates, key=lambda t: rates[t])
    assert all(speed(fastest) >= speed(t) * 0.95 for t in rates)  # rounding: 5 % steps


def test_a_declared_figure_wins_over_measurement() -> None:
    measured = _rates(a100=(4000, 1000.0), t4=(1000, 1000.0))
    figures = job_figures({"A100": 1.0, "T4": 1.0}, measured)
    assert speed_of(figures, PRIORS)("a100") == speed_of(figures, PRIORS)("t4")


def test_the_record_learns_from_its_checkpoints_and_drops_it_when_it_ends() -> None:
    w = Sim.empty()
    w.cluster("a", flavor=FlavorInfo("t4", "on-demand", "T4", 1.0))
    job = w.submit(checkpoint=CheckpointSpec(uri="s3://ckpt/j"))
    w.cycle()
    run(w, job, "a", 1)
    for step in (100, 400):
        w.now += 300.0
        w.send("a", CheckpointReport(job_id=job, attempt=1, step=step, uri=f"s3://ckpt/j/{step}"))
    record = w.m.jobs[job]
    assert record.speeds == [GpuRate("t4", 300.0, 300.0)]
    w.cluster("b", flavor=FlavorInfo("t4", "on-demand", "T4", 1.0))
    w.send("a", WorkloadStatus(job_id=job, attempt=1, phase="evicted", reason="node drained"))
    w.cycle()
    assert record.current is not None and record.current.cluster == "b"
    run(w, job, "b", 2)
    w.now += 900.0  # restore and start-up, then 300 steps: only anchors attempt 2
    w.send("b", CheckpointReport(job_id=job, attempt=2, step=700, uri="s3://ckpt/j/attempt-2/7"))
    assert record.speeds == [GpuRate("t4", 300.0, 300.0)]
    w.now += 100.0
    w.send("b", CheckpointReport(job_id=job, attempt=2, step=800, uri="s3://ckpt/j/attempt-2/8"))
    assert record.speeds == [GpuRate("t4", 400.0, 400.0)]
    assert compact(record) and record.speeds == []


def _fleet(a100_price: float, t4_price: float, **sched: object) -> Scheduler:
    """The T4 pool's cluster sorts first, so a tie in cost alone would go to it."""
    s = Scheduler(config(**sched))
    s.apply_snapshot("c2", [flavor("a", "on-demand", "a100", a100_price)], nodes("a", "a", 2), NOW)
    s.apply_snapshot("c1", [flavor("t", "on-demand", "t4", t4_price)], nodes("t", "t", 2), NOW)
    return s


@settings(max_examples=40, deadline=None)
@given(ratio=st.sampled_from([1.0, 2.0, 3.0, 3.5, 3.8, 4.2, 4.5, 5.0, 6.0, 7.0]))
def test_a_job_measured_4x_faster_on_a100_goes_there_while_it_is_under_4x_the_price(
    ratio: float,
) -> None:
    """The priors (A100 7.3x a T4) would take the A100 up to 7.3x; the job's own rates win."""
    figures = job_figures({}, _rates(a100=(4000, 1000.0), t4=(1000, 1000.0)))
    req = dataclasses.replace(gang("j", (1, 8)), speeds=figures)
    res = _fleet(0.5 * ratio, 0.5).schedule([req], NOW)
    ((_, placement),) = res.admitted
    assert placement.flavor == ("a" if ratio < 4.0 else "t")


def test_by_price_alone_the_t4_would_win_but_per_work_the_a100_does() -> None:
    res = _fleet(2.0, 0.5).schedule([gang("j", (1, 8))], NOW)
    assert res.admitted[0][1].flavor == "a"  # 2.0 / 2.2 < 0.5 / 0.3
    same = {"a100": 1.0, "t4": 1.0}
    res = _fleet(2.0, 0.5, gpu_speeds=same).schedule([gang("j", (1, 8))], NOW)
    assert res.admitted[0][1].flavor == "t"


def test_at_equal_cost_per_work_the_faster_gpu_comes_first() -> None:
    res = _fleet(2.2, 0.3).schedule([gang("j", (1, 8))], NOW)
    assert res.admitted[0][1].flavor == "a"


def _names(groups: list[list[object]]) -> list[list[str]]:
    return [[f"{p.cluster}/{p.name}" for p in g] for g in groups]  # type: ignore[attr-defined]


@settings(max_examples=150, deadline=None)
@given(
    fleet=fleets(),
    data=st.data(),
    same=st.sampled_from([0.3, 1.0, 2.2]),
)
def test_equal_speeds_rank_pools_exactly_as_price_alone(
    fleet: dict[str, tuple[list[FlavorInfo], list[NodeInfo]]],
    data: st.DataObject,
    same: float,
) -> None:
    s = Scheduler(config())
    for cname, (flavors, ns) in fleet.items():
        s.apply_snapshot(cname, flavors, ns, NOW)
    inv = s.snapshot(NOW).inv  # what `assign` places against
    req = data.draw(requests("j", ["q0"]))
    risk = data.draw(st.sampled_from([0.0, 1.0, 5.0]))

    def rate_of(key: tuple[str, str]) -> float:
        return 0.5 if inv.clusters[key[0]].pools[key[1]].capacity_type == "spot" else 0.0

    old = build_candidates(inv, req, req.total_gpu, rate_of, risk)
    new = build_candidates(inv, req, req.total_gpu, rate_of, risk, (), lambda _t: same)
    assert _names(new.groups) == _names(old.groups)  # type: ignore[arg-type]
    assert new.ranks == old.ranks


@settings(max_examples=150, deadline=None)
@given(fleet=fleets(), data=st.data(), gang_rate=st.sampled_from([0.05, 0.6, 2.4, 9.0]))
def test_pools_of_equal_gang_risk_rank_exactly_as_without_risk(
    fleet: dict[str, tuple[list[FlavorInfo], list[NodeInfo]]],
    data: st.DataObject,
    gang_rate: float,
) -> None:
    """Every pool reclaims the gang equally often (its per-node rate times the gang's nodes
    there): the redo factor is common, so the order is price per unit of work alone."""
    s = Scheduler(config())
    for cname, (flavors, ns) in fleet.items():
        s.apply_snapshot(cname, flavors, ns, NOW)
    inv = s.snapshot(NOW).inv
    req = data.draw(requests("j", ["q0"]))
    risk = data.draw(st.sampled_from([1.0, 5.0]))
    speed = data.draw(st.sampled_from([None, lambda t: {"a": 2.2, "b": 0.3}.get(t, 1.0)]))
    gpus = req.total_gpu

    def equal_risk(key: tuple[str, str]) -> float:
        node_gpu = inv.clusters[key[0]].pools[key[1]].node_gpu or 1
        return gang_rate / max(1, -(-gpus // node_gpu))

    old = build_candidates(inv, req, gpus, lambda _k: 0.0, risk, (), speed)
    new = build_candidates(inv, req, gpus, equal_risk, risk, (), speed)
    assert _names(new.groups) == _names(old.groups)  # type: ignore[arg-type]
    assert new.ranks == old.ranks


def test_a_big_gang_takes_the_dearer_pool_where_it_reaches_its_checkpoints() -> None:
    """Two spot pools, one 55 % cheaper but reclaiming 0.6 nodes per node-hour: per-node
    survival to the 4th power makes it dearer for a 4-node gang (a half-interval loss per
    reclaim would not: 0.45 x 1.9 < 1), not for a 1-node one."""
    s = Scheduler(config(spot_prior_rate=0.0))
    cheap = flavor("cheap", "spot", "a", 0.45)
    calm = flavor("calm", "spot", "a", 1.0)
    s.apply_snapshot("c", [cheap, calm], nodes("ch", "cheap", 8) + nodes("ca", "calm", 8), NOW)
    rates = {("c", "cheap"): 0.6, ("c", "calm"): 0.0}
    inv = s.snapshot(NOW).inv

    def order(req: GangRequest) -> list[str]:
        c = build_candidates(inv, req, req.total_gpu, rates.__getitem__, 1.0)
        return [p.name for g in c.groups for p in g]

    big = gang("big", (4, 8), checkpoint_interval_s=2700.0)
    small = gang("small", (1, 8), checkpoint_interval_s=2700.0)
    assert order(big) == ["calm", "cheap"]  # 0.45 x (e^1.8 - 1) / 1.8 = 1.26 > 1
    assert order(small) == ["cheap", "calm"]  # 0.45 x 1.26 = 0.57 < 1


@settings(max_examples=100, deadline=None)
@given(
    fleet=fleets(),
    queues=queue_sets(),
    data=st.data(),
    speeds=st.fixed_dictionaries({"a": st.sampled_from([0.3, 1.0, 4.0]), "b": st.just(1.0)}),
)
def test_invariants_hold_when_placement_prices_work(
    fleet: dict[str, tuple[list[FlavorInfo], list[NodeInfo]]],
    queues: list,  # type: ignore[type-arg]
    data: st.DataObject,
    speeds: dict[str, float],
) -> None:
    """Quotas, whole gangs on one pool, per-node capacity: as with price alone."""
    s = Scheduler(config(queues=queues, classes=CLASSES, gpu_speeds=speeds))
    m = Model()
    load_fleet(s, m, fleet, NOW)
    qnames = [q.name for q in queues]
    own = st.sampled_from([(), (("a", 1.0), ("b", 0.25)), (("a", 0.2), ("b", 1.0))])
    reqs = [
        dataclasses.replace(data.draw(requests(f"j{i}", qnames)), speeds=data.draw(own))
        for i in range(data.draw(st.integers(1, 8)))
    ]
    res = s.schedule(reqs, NOW)
    by_id = {r.job_id: r for r in reqs}
    for job, p in res.admitted:
        m.allocs[(job, 1)] = (by_id[job], p)
        check_admission(m, by_id[job], p)
    check_state(s, m)


def test_why_names_the_cost_of_work_of_the_pool_and_the_next_best() -> None:
    prices = [
        WorkPrice("c1", "a", "a100", 17.6, 2.2),
        WorkPrice("c2", "t", "t4", 4.0, 0.3),
    ]
    text = work_price_text(prices, ("c2", "t"), [GpuRate("t4", 1000.0, 1000.0)])
    assert text == (
        "expected cost of work: its pool c2/t $13.3 per unit of work (T4 at 0.3x, $4/h, "
        "$1.11 per 1000 steps); next best c1/a $8 per unit of work (A100 at 2.2x, $17.6/h)"
    )
    assert work_price_text(prices[:1], None, []) == (
        "expected cost of work: best c1/a $8 per unit of work (A100 at 2.2x, $17.6/h); "
        "no other pool may host it"
    )
    assert work_price_text([], None, []) is None


def test_why_shows_the_cost_of_work_of_a_placed_and_of_a_queued_job() -> None:
    w = Sim.empty()
    w.cluster("a", flavor=FlavorInfo("a100", "on-demand", "A100", 4.4))
    w.cluster("t", flavor=FlavorInfo("t4", "on-demand", "T4", 0.9))
    placed = w.submit("placed")
    w.cycle()
    why = w.m.views.why(placed, w.now)
    assert why is not None and why.work_price is not None
    assert why.work_price.startswith("expected cost of work: its pool a/a100 $16 per unit")
    assert "next best t/t4 $24 per unit of work (T4 at 0.3x, $7.2/h)" in why.work_price
    w.submit("second")  # takes the T4 node
    w.cycle()
    queued = w.submit("queued")  # no room left
    w.cycle()
    why = w.m.views.why(queued, w.now)
    assert why is not None and why.state == "queued" and why.work_price is not None
    assert why.work_price.startswith("expected cost of work: best a/a100 $16 per unit")


def test_why_says_how_often_a_gang_reaches_its_next_checkpoint_on_spot() -> None:
    s = Scheduler(config(spot_prior_rate=0.6))
    s.apply_snapshot(
        "c",
        [flavor("spot", "spot", "a", 1.0), flavor("od", "on-demand", "a", 3.0)],
        nodes("s", "spot", 8) + nodes("o", "od", 8),
        NOW,
    )
    req = gang("big", (4, 8), checkpoint_interval_s=2700.0)
    prices = s.work_prices(req, NOW)
    assert [(w.flavor, round(w.survival, 3)) for w in prices] == [("spot", 0.165), ("od", 1.0)]
    text = work_price_text(prices, None, [])
    assert text is not None
    assert "best c/spot $89.8 per unit of work (A at 1x, $89.8/h, " in text
    assert "reaches its next checkpoint 17% of the time, redo priced in)" in text
    assert text.endswith("next best c/od $96 per unit of work (A at 1x, $96/h)")


def _two_spot_pools(cheap_nodes: int) -> Scheduler:
    pools = [
        (flavor("cheap", "spot", "a", 1.0), cheap_nodes),
        (flavor("dear", "spot", "a", 1.6), 8),
    ]
    return one_cluster(pools, spot_prior_rate=0.0)


def test_a_spot_only_gang_waits_for_the_pool_where_work_costs_less() -> None:
    """The cheap pool is full: a 4-node spot-only gang waits for it rather than pay 1.6x per
    unit of work; a 1-node one, and a gang that may fall back, take the dear pool now."""
    s = _two_spot_pools(8)
    ((_, filler),) = s.schedule([gang("fill", (8, 8), capacity="spot")], NOW).admitted
    assert filler.flavor == "cheap"
    res = s.schedule(
        [
            gang("big", (4, 8), capacity="spot"),
            gang("one", (1, 8), capacity="spot"),
            gang("flex", (4, 8), capacity="spot-then-on-demand"),
        ],
        NOW,
    )
    assert sorted((j, p.flavor) for j, p in res.admitted) == [("flex", "dear"), ("one", "dear")]


def test_a_spot_only_gang_takes_the_dear_pool_when_the_cheap_one_can_never_host_it() -> None:
    s = _two_spot_pools(2)
    ((_, p),) = s.schedule([gang("big", (4, 8), capacity="spot")], NOW).admitted
    assert p.flavor == "dear"
