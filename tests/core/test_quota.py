"""Queues and quotas: Kueue's ClusterQueue semantics (nominal, borrowing and lending limits in a
cohort), weighted DRF between queues, StrictFIFO vs BestEffortFIFO, and the cycle budget."""

from __future__ import annotations

from broker.core.scheduler import Scheduler
from schemas.config import FlavorClass

from .helpers import GI, NOW, codes, config, flavor, gang, nodes, queue

# The seed's Kueue example (section 11): flavor classes gpu-a100 (on-demand A100) and
# gpu-t4-spot (spot T4); ClusterQueue ml-cluster-queue in cohort ml-team-cohort.
KUEUE_CLASSES = [
    FlavorClass(name="gpu-a100", capacity_type="on-demand", gpu_type="nvidia-tesla-a100"),
    FlavorClass(name="gpu-t4-spot", capacity_type="spot", gpu_type="nvidia-tesla-t4"),
]
KUEUE_QUOTAS = {
    "gpu-a100": {"cpu": (64_000, None, None), "memory": (256 * GI, None, None), "gpu": (8, 4, 2)},
    "gpu-t4-spot": {
        "cpu": (128_000, None, None),
        "memory": (512 * GI, None, None),
        "gpu": (16, None, None),
    },
}


def kueue_fleet(*queues: object) -> Scheduler:
    s = Scheduler(config(queues=queues, classes=KUEUE_CLASSES))  # type: ignore[arg-type]
    s.apply_snapshot(
        "gke-1",
        [
            flavor("a100-od", "on-demand", "nvidia-tesla-a100", 3.67),
            flavor("t4-spot", "spot", "nvidia-tesla-t4", 0.11),
        ],
        [*nodes("a100", "a100-od", 4), *nodes("t4", "t4-spot", 8)],
        NOW,
    )
    return s


def a100_jobs(prefix: str, count: int, q: str) -> list:  # type: ignore[type-arg]
    return [
        gang(f"{prefix}{i}", (1, 1), queue=q, capacity="on-demand", gpu_types={"nvidia-tesla-a100"})
        for i in range(count)
    ]


def test_flavor_classes_map_cluster_flavors() -> None:
    s = kueue_fleet(queue("ml", "ml-team-cohort", KUEUE_QUOTAS))
    classes = {v.name: v.flavor_class for v in s.flavor_views("gke-1", NOW)}
    assert classes == {"a100-od": "gpu-a100", "t4-spot": "gpu-t4-spot"}


def test_queue_lends_at_most_its_lending_limit() -> None:
    # Both queues have the example quota: each lends at most 2 A100s of its nominal 8.
    s = kueue_fleet(
        queue("ml", "ml-team-cohort", KUEUE_QUOTAS), queue("other", "ml-team-cohort", KUEUE_QUOTAS)
    )
    res = s.schedule(a100_jobs("a", 14, "ml"), NOW)
    assert len(res.admitted) == 10  # 8 nominal + 2 lent by "other"
    assert codes(res.pending["a10"]) == ["cohort-exhausted"]
    view = {v.name: v for v in s.queue_views({"ml": 4})}
    gpu = next(r for r in view["ml"].flavors[0].resources if r.resource == "gpu")
    assert (gpu.used, gpu.borrowed, gpu.nominal, gpu.borrowing_limit, gpu.lending_limit) == (
        10,
        2,
        8,
        4,
        2,
    )
    other = next(r for r in view["other"].flavors[0].resources if r.resource == "gpu")
    assert other.lent == 2
    # "other" still gets its guaranteed 6 (8 nominal - 2 lendable), and the 2 it lent only
    # when "ml" gives them back.
    res = s.schedule(a100_jobs("b", 8, "other"), NOW)
    assert len(res.admitted) == 6
    for i in range(2):
        s.release(f"a{i}", 1)
    res = s.schedule(a100_jobs("c", 2, "other"), NOW)
    assert len(res.admitted) == 2


def test_borrowing_stops_at_the_borrowing_limit() -> None:
    # The lender has no lending limit, so only the borrower's limit of 4 binds.
    lender = {"gpu-a100": {"gpu": (8, None, None)}, "gpu-t4-spot": {"gpu": (16, None, None)}}
    s = kueue_fleet(
        queue("ml", "ml-team-cohort", KUEUE_QUOTAS), queue("lender", "ml-team-cohort", lender)
    )
    res = s.schedule(a100_jobs("a", 16, "ml"), NOW)
    assert len(res.admitted) == 12  # 8 nominal + 4 borrowing limit
    assert codes(res.pending["a12"]) == ["quota-exceeded"]
    # and the lender, with "ml" idle, may borrow "ml"'s lendable 2 on top of its own 8
    s2 = kueue_fleet(
        queue("ml", "ml-team-cohort", KUEUE_QUOTAS), queue("lender", "ml-team-cohort", lender)
    )
    res = s2.schedule(a100_jobs("b", 16, "lender"), NOW)
    assert len(res.admitted) == 10


def test_queue_without_cohort_stops_at_nominal_and_unlisted_class_is_closed() -> None:
    s = kueue_fleet(queue("solo", None, {"gpu-a100": {"gpu": (3, None, None)}}))
    res = s.schedule(a100_jobs("a", 5, "solo"), NOW)
    assert len(res.admitted) == 3
    assert codes(res.pending["a3"]) == ["quota-exceeded"]
    res = s.schedule([gang("t", (1, 1), queue="solo", capacity="spot")], NOW)
    assert codes(res.pending["t"]) == ["quota-exceeded"]
    assert "no quota" in res.pending["t"][0].message


def test_cpu_and_memory_quota_count_too() -> None:
    s = kueue_fleet(queue("ml", None, KUEUE_QUOTAS))
    res = s.schedule([gang("fat", (1, 1), queue="ml", capacity="on-demand", cpu=65_000)], NOW)
    assert codes(res.pending["fat"]) == ["quota-exceeded"]
    assert "cpu" in res.pending["fat"][0].message


def test_weighted_drf_between_queues() -> None:
    s = Scheduler(config(queues=[queue("light", weight=1.0), queue("heavy", weight=3.0)]))
    s.apply_snapshot("c1", [flavor("od")], nodes("c1", "od", 1), NOW)
    jobs = [gang(f"l{i}", (1, 1), queue="light") for i in range(8)]
    jobs += [gang(f"h{i}", (1, 1), queue="heavy") for i in range(8)]
    res = s.schedule(jobs, NOW)
    got = [j[0] for j, _ in res.admitted]
    assert got.count("l") == 2 and got.count("h") == 6
    views = {v.name: v for v in s.queue_views({})}
    assert abs(views["light"].dominant_share - 0.25) < 1e-9
    assert abs(views["heavy"].dominant_share - 0.25) < 1e-9


def test_priority_then_order_inside_a_queue() -> None:
    s = Scheduler(config())
    s.apply_snapshot("c1", [flavor("od")], nodes("c1", "od", 1, gpu=2), NOW)
    res = s.schedule(
        [
            gang("first", (1, 1), order=1),
            gang("urgent", (1, 1), order=3, priority=10),
            gang("second", (1, 1), order=2),
        ],
        NOW,
    )
    assert [j for j, _ in res.admitted] == ["urgent", "first"]


def test_strict_fifo_never_admits_past_a_blocked_head() -> None:
    for strategy, expect in (("StrictFIFO", []), ("BestEffortFIFO", ["small"])):
        s = Scheduler(config(queues=[queue("q", strategy=strategy)]))
        s.apply_snapshot("c1", [flavor("od")], nodes("c1", "od", 1), NOW)
        s.schedule([gang("x", (1, 1), queue="q")], NOW)
        res = s.schedule(
            [gang("head", (1, 8), queue="q", order=1), gang("small", (1, 2), queue="q", order=2)],
            NOW,
        )
        assert [j for j, _ in res.admitted] == expect, strategy
        assert codes(res.pending["head"]) == ["insufficient-capacity"]
        if strategy == "StrictFIFO":
            assert codes(res.pending["small"]) == ["strict-fifo-blocked"]


def test_unknown_queue_and_max_admissions() -> None:
    s = Scheduler(config(max_admissions_per_cycle=2))
    s.apply_snapshot("c1", [flavor("od")], nodes("c1", "od", 1), NOW)
    res = s.schedule(
        [gang("lost", (1, 1), queue="nope")] + [gang(f"j{i}", (1, 1)) for i in range(5)], NOW
    )
    assert codes(res.pending["lost"]) == ["unknown-queue"]
    assert len(res.admitted) == 2
    assert sorted(j for j, r in res.pending.items() if codes(r) == ["max-admissions"]) == [
        "j2",
        "j3",
        "j4",
    ]
