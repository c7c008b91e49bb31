"""The hindsight bound (load/oracle.py): exact on worlds small enough to solve by hand, and
never beaten by a simulated run, whatever the policy, on small seeded worlds."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from load.oracle import (
    BoundError,
    BoundJob,
    BoundPool,
    bound_summary,
    hindsight_bound,
    presence,
    slot_capacity,
)
from load.report import summarize
from load.scenario import apply_scenario, load_scenario
from load.sim import Sim, bound_for
from load.simconfig import DEFAULT_POOLS, SimConfig

SPOT = BoundPool(("c", "spot"), "spot", 1.0, 1.0)
OD = BoundPool(("c", "od"), "on-demand", 3.0, 1.0)
FAST_OD = BoundPool(("c", "fast"), "on-demand", 4.0, 2.0)
HOUR = 3600.0


def caps(spot_slots: set[int], slots: int = 8, gpus: int = 8) -> dict[tuple[str, str], list[float]]:
    """8 GPUs of on-demand all the time; 8 spot GPUs in the given 900 s slots."""
    return {
        ("c", "spot"): [gpus * 900.0 if t in spot_slots else 0.0 for t in range(slots)],
        ("c", "od"): [gpus * 900.0] * slots,
        ("c", "fast"): [gpus * 900.0] * slots,
    }


def test_the_gang_caps_what_a_short_spot_window_can_take() -> None:
    # 2 GPUs x 1 h of work; spot only in slot 1: at most 2 GPUs x 900 s there, the rest
    # on-demand. (Without the gang's cap all of it would fit on spot's 8 GPUs.)
    job = BoundJob(arrival=0.0, gpus=2, work=2 * HOUR, capacity="spot-then-on-demand")
    b = hindsight_bound([job], [SPOT, OD], caps({1}), end=8 * 900.0)
    assert b.cost_usd == pytest.approx(1800 / HOUR * 1.0 + 5400 / HOUR * 3.0)
    assert b.useful_gpu_h == pytest.approx(2.0)
    assert b.work_by_pool[("c", "spot")] == pytest.approx(0.5)
    assert b.work_by_pool[("c", "od")] == pytest.approx(1.5)


def test_preferences_and_arrivals_are_kept() -> None:
    # Arriving after the spot window, a flexible job pays on-demand; on-demand-only jobs
    # never touch spot, even when it is there.
    late = BoundJob(arrival=2 * 900.0, gpus=1, work=900.0, capacity="any")
    assert hindsight_bound([late], [SPOT, OD], caps({1}), end=8 * 900.0).cost_usd == (
        pytest.approx(900 / HOUR * 3.0)
    )
    od = BoundJob(arrival=0.0, gpus=1, work=900.0, capacity="on-demand")
    assert hindsight_bound([od], [SPOT, OD], caps(set(range(8))), end=8 * 900.0).cost_usd == (
        pytest.approx(900 / HOUR * 3.0)
    )


def test_a_job_due_before_the_spot_window_pays_on_demand() -> None:
    # Timed to the run's own finish: done by the end of slot 0, so slot 1's spot is too late.
    free = BoundJob(arrival=0.0, gpus=1, work=900.0, capacity="any")
    due = BoundJob(arrival=0.0, gpus=1, work=900.0, capacity="any", finish=900.0)
    world = ([SPOT, OD], caps({1}))
    assert hindsight_bound([free], *world, end=8 * 900.0).cost_usd == pytest.approx(0.25)
    assert hindsight_bound([due], *world, end=8 * 900.0).cost_usd == pytest.approx(0.75)


def test_work_is_priced_at_the_gpus_speed() -> None:
    # The fast pool does 2 V100-seconds per GPU-second at $4/h: $2 per V100-hour, cheaper
    # per unit of work than the $3/h plain one.
    job = BoundJob(arrival=0.0, gpus=1, work=900.0, capacity="on-demand")
    b = hindsight_bound([job], [OD, FAST_OD], caps(set()), end=8 * 900.0)
    assert b.cost_usd == pytest.approx(450 / HOUR * 4.0)


def test_spot_only_work_beyond_the_spot_there_was_has_no_schedule() -> None:
    job = BoundJob(arrival=0.0, gpus=8, work=3 * 8 * 900.0, capacity="spot")
    with pytest.raises(BoundError, match="no schedule"):
        hindsight_bound([job], [SPOT, OD], caps({1, 2}), end=8 * 900.0)


def test_capacity_comes_from_node_spans_split_over_slots() -> None:
    spans = [(("c", "spot"), 8, 450.0, 1350.0), (("c", "spot"), 8, 2000.0, math.inf)]
    assert slot_capacity(spans, end=2700.0, slot_s=900.0)[("c", "spot")] == [
        8 * 450.0,
        8 * 450.0,
        8 * 700.0,
    ]


def test_a_whole_gang_uses_a_pool_only_while_it_holds_the_gang() -> None:
    # Spot: a 4-GPU node through slot 1 and another for its first half; on-demand 8 GPUs.
    # An 8-GPU gang fits on spot only while both are there (450 s); a 4-GPU one all slot.
    spans = [(("c", "spot"), 4, 900.0, 1800.0), (("c", "spot"), 4, 900.0, 1350.0)]
    spans += [(("c", "od"), 8, 0.0, math.inf)]
    present = presence(spans)
    assert present[("c", "spot")].seconds(8, 0.0, 2700.0) == 450.0
    assert present[("c", "spot")].seconds(4, 0.0, 2700.0) == 900.0
    assert present[("c", "spot")].seconds(4, 1000.0, 1200.0) == 200.0
    assert present[("c", "spot")].seconds(9, 0.0, 2700.0) == 0.0
    capacity = slot_capacity(spans, end=2700.0, slot_s=900.0)
    whole = BoundJob(arrival=900.0, gpus=8, work=8 * 900.0, capacity="any", whole_gpus=8)
    loose = replace(whole, whole_gpus=0)
    # Loose: 5,400 GPU-s of spot at $1/h, 1,800 on-demand at $3/h. Whole: 3,600 and 3,600.
    assert hindsight_bound([loose], [SPOT, OD], capacity, 2700.0, present=present).cost_usd == (
        pytest.approx(1.5 + 1.5)
    )
    assert hindsight_bound([whole], [SPOT, OD], capacity, 2700.0, present=present).cost_usd == (
        pytest.approx(1.0 + 3.0)
    )
    # A gang of 4 at least (an elastic minimum) may run on the one node all slot long.
    half = replace(whole, gpus=4, work=4 * 900.0, whole_gpus=4)
    assert hindsight_bound([half], [SPOT, OD], capacity, 2700.0, present=present).cost_usd == (
        pytest.approx(1.0)
    )


SMALL = SimConfig(
    jobs=80,
    max_duration_s=2 * HOUR,
    drain_s=86_400.0,
    pools=tuple(replace(p, trace_phase_s=0.0) for p in DEFAULT_POOLS),
)
SCENARIOS = Path(__file__).resolve().parents[2] / "load" / "scenarios"


@pytest.mark.parametrize(
    ("world", "seed"),
    [("default", 1), ("default", 2), ("spot-traces-16node", 1), ("spot-traces-4node", 3)],
)
def test_no_run_beats_its_hindsight_bound(world: str, seed: int) -> None:
    cfg = replace(SMALL, seed=seed, trace_phase_frac=(seed - 1) * 0.618 % 1.0)
    if world != "default":
        cfg = replace(apply_scenario(cfg, load_scenario(SCENARIOS / f"{world}.yaml")), jobs=80)
    for policy in ("muster", "checkpoint-restart", "foresight", "on-demand-only"):
        sim = Sim(cfg, policy)
        result = sim.run()
        summary = summarize(result)
        assert summary["completed"] > 0, policy
        timed = bound_for(sim, result, timed=True)
        figures = bound_summary(bound_for(sim, result), summary, timed)
        assert figures["bound_cost_usd"] > 0
        # Matching the run's finish times can only cost more than finishing by the end.
        assert figures["bound_timed_cost_usd"] >= figures["bound_cost_usd"] - 1e-6
        assert figures["vs_bound_timed"] >= 1.0, (world, seed, policy, figures)


def greedy_cost(
    jobs: list[BoundJob],
    pools: list[BoundPool],
    capacity: dict[tuple[str, str], list[float]],
    end: float,
) -> tuple[list[BoundJob], float]:
    """A feasible schedule (jobs in arrival order, cheapest work first): the jobs it finishes
    and what it paid. The bound for those jobs can be no dearer."""
    left = {k: list(v) for k, v in capacity.items()}
    slots = len(next(iter(left.values())))
    done: list[BoundJob] = []
    total = 0.0
    for j in sorted(jobs, key=lambda j: j.arrival):
        usable = sorted(
            (p for p in pools if p.capacity_type in allowed(j.capacity)),
            key=lambda p: p.price / p.speed,
        )
        work, cost = j.work, 0.0
        plan: list[tuple[tuple[str, str], int, float]] = []
        for t in range(int(j.arrival // 900.0), slots):
            room = j.gpus * max(0.0, min(end, (t + 1) * 900.0) - max(j.arrival, t * 900.0))
            for p in usable:
                take = min(room, left[p.key][t], work / p.speed)
                if take <= 0:
                    continue
                plan.append((p.key, t, take))
                left[p.key][t] -= take
                room -= take
                work -= take * p.speed
                cost += take * p.price / HOUR
            if work <= 1e-6:
                break
        if work <= 1e-6:
            done.append(j)
            total += cost
        else:  # not finished: give its capacity back
            for key, t, take in plan:
                left[key][t] += take
    return done, total


def allowed(pref: str) -> set[str]:
    return {"spot": {"spot"}, "on-demand": {"on-demand"}}.get(pref, {"spot", "on-demand"})


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 7 * 900),
            st.sampled_from([1, 2, 4, 8, 16]),
            st.floats(60.0, 4 * HOUR),
            st.sampled_from(["spot", "on-demand", "spot-then-on-demand", "any"]),
        ),
        min_size=1,
        max_size=12,
    ),
    st.lists(st.integers(0, 16), min_size=8, max_size=8),
)
def test_the_bound_lies_between_cheapest_work_and_a_feasible_schedule(
    rows: list[tuple[int, int, float, str]], spot_gpus: list[int]
) -> None:
    pools = [SPOT, OD, FAST_OD]
    capacity = caps(set())
    capacity[("c", "spot")] = [g * 900.0 for g in spot_gpus]
    end = 8 * 900.0
    jobs = [BoundJob(float(a), g, g * d, pref) for a, g, d, pref in rows]
    done, paid = greedy_cost(jobs, pools, capacity, end)
    assume(done)
    bound = hindsight_bound(done, pools, capacity, end)
    floor = sum(
        j.work * min(p.price / p.speed for p in pools if p.capacity_type in allowed(j.capacity))
        for j in done
    )
    assert floor / HOUR - 1e-6 <= bound.cost_usd <= paid + 1e-6
