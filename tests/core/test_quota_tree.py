"""The quota book with hierarchical cohorts (Kueue's Cohort tree, Koordinator parent quotas,
Volcano parent queues): borrowing walks up the tree and every limit bounds its subtree."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core.quota import Cohort, QueueState, QuotaBook
from schemas.config import CohortConfig, FlavorQuota, QueueConfig, ResourceQuota

CLS = "any"


def quota(
    nominal: int, borrowing: int | None = None, lending: int | None = None
) -> list[FlavorQuota]:
    rq = ResourceQuota(nominal=nominal, borrowing_limit=borrowing, lending_limit=lending)
    return [FlavorQuota(flavor=CLS, resources={"gpu": rq})]


def gpus(n: int) -> tuple[int, int, int]:
    return (n, 0, 0)


def test_borrowing_walks_up_two_levels() -> None:
    # root holds 10 of its own; org (borrowing limit 4) holds team-a (2) and team-b (2)
    book = QuotaBook(
        [
            QueueConfig(name="team-a", cohort="org", quotas=quota(2)),
            QueueConfig(name="team-b", cohort="org", quotas=quota(2)),
        ],
        [
            CohortConfig(name="root", quotas=quota(10)),
            CohortConfig(name="org", parent="root", quotas=quota(0, borrowing=4)),
        ],
    )
    a, b = book.queues["team-a"], book.queues["team-b"]
    # the subtree (4 of its own) may take 4 more from root: 8 in all
    assert book.check(a, CLS, gpus(8)) is None
    assert book.check(a, CLS, gpus(9)) is not None
    book.charge(a, CLS, gpus(6), 1)
    assert book.check(b, CLS, gpus(2)) is None
    assert book.check(b, CLS, gpus(3)) is not None
    assert book.view(a, 0, (16, 0, 0)).cohort == "root/org"  # `muster queues` shows the path
    book.charge(a, CLS, gpus(6), -1)
    assert book.cohorts["org"].borrowed[CLS] == [0, 0, 0]
    assert book.cohorts["root"].borrowed[CLS] == [0, 0, 0]


def test_lending_limit_keeps_the_rest_of_a_cohort_in_its_subtree() -> None:
    book = QuotaBook(
        [
            QueueConfig(name="inside", cohort="org", quotas=quota(0)),
            QueueConfig(name="outside", cohort="root", quotas=quota(0)),
        ],
        [
            CohortConfig(name="root"),
            CohortConfig(name="org", parent="root", quotas=quota(6, lending=2)),
        ],
    )
    assert book.check(book.queues["inside"], CLS, gpus(6)) is None
    assert book.check(book.queues["outside"], CLS, gpus(2)) is None
    assert book.check(book.queues["outside"], CLS, gpus(3)) is not None


def test_quota_messages_speak_cores() -> None:
    book = QuotaBook(
        [
            QueueConfig(
                name="q",
                quotas=[FlavorQuota(flavor=CLS, resources={"cpu": ResourceQuota(nominal=9000)})],
            )
        ]
    )
    refused = book.check(book.queues["q"], CLS, (0, 9500, 0))
    assert refused is not None
    assert "needs 9.5 cpu" in refused[1] and "nominal 9," in refused[1]


# -- properties ---------------------------------------------------------------------------


@st.composite
def trees(draw: st.DrawFn) -> tuple[list[QueueConfig], list[CohortConfig]]:
    n_cohorts = draw(st.integers(1, 5))
    cohorts: list[CohortConfig] = []
    for i in range(n_cohorts):
        parent = draw(st.sampled_from([None, *[f"c{j}" for j in range(i)]]))
        nominal = draw(st.integers(0, 6))
        borrowing = draw(st.none() | st.integers(0, 6))
        lending = draw(st.none() | st.integers(0, 6))
        cohorts.append(
            CohortConfig(name=f"c{i}", parent=parent, quotas=quota(nominal, borrowing, lending))
        )
    queues: list[QueueConfig] = []
    for i in range(draw(st.integers(1, 6))):
        nominal = draw(st.integers(0, 8))
        borrowing = draw(st.none() | st.integers(0, 8))
        lending = draw(st.none() | st.integers(0, nominal))
        cohort = draw(st.sampled_from([f"c{j}" for j in range(n_cohorts)]))
        queues.append(
            QueueConfig(name=f"q{i}", cohort=cohort, quotas=quota(nominal, borrowing, lending))
        )
    return queues, cohorts


def _limit(node: QueueState | Cohort) -> Any:
    lims = node.limits.get(CLS) if node.limits is not None else None
    return lims[0] if lims is not None else None


def _guaranteed(node: QueueState | Cohort, subtree: int) -> int:
    lim = _limit(node)
    if lim is None or lim.lending is None:
        return 0
    return max(0, subtree - lim.lending)


def _check_tree(book: QuotaBook) -> None:
    """Recompute every cohort's subtree quota and usage from the leaves, and check that no
    node exceeds what its limits allow."""
    usage: dict[str, int] = {}
    quota_of: dict[str, int] = {}

    def walk(co: Cohort) -> tuple[int, int]:
        lim = _limit(co)
        s = lim.nominal if lim is not None else 0
        u = 0
        for q in co.members:
            ql = _limit(q)
            g = _guaranteed(q, ql.nominal)
            s += ql.nominal - g
            u += max(0, q.used(CLS)[0] - g)
        for child in co.children:
            cs, cu = walk(child)
            g = _guaranteed(child, cs)
            s += cs - g
            u += max(0, cu - g)
        quota_of[co.name], usage[co.name] = s, u
        return s, u

    for co in book.cohorts.values():
        if co.parent is None:
            walk(co)
    for co in book.cohorts.values():
        assert co.lendable.get(CLS, [0])[0] == quota_of[co.name]
        assert co.borrowed.get(CLS, [0])[0] == usage[co.name]
        s, u = quota_of[co.name], usage[co.name]
        lim = _limit(co)
        if co.parent is None:
            assert u <= s, f"root {co.name} uses {u} of {s}"
        elif lim is not None and lim.borrowing is not None:
            g = _guaranteed(co, s)
            assert max(0, u - g) <= s - g + lim.borrowing, f"{co.name} over its limits"
    for q in book.queues.values():
        lim = _limit(q)
        if lim.borrowing is not None:
            assert q.used(CLS)[0] <= lim.nominal + lim.borrowing


@settings(max_examples=200, deadline=None)
@given(
    tree=trees(),
    ops=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6)), max_size=40),
    data=st.data(),
)
def test_no_subtree_exceeds_its_limits_and_releases_return_to_zero(
    tree: tuple[list[QueueConfig], list[CohortConfig]],
    ops: list[tuple[int, int]],
    data: st.DataObject,
) -> None:
    queues, cohorts = tree
    book = QuotaBook(queues, cohorts)
    held: list[tuple[QueueState, int]] = []
    for qi, amount in ops:
        q = book.queues[queues[qi % len(queues)].name]
        if held and data.draw(st.booleans()):
            victim, n = held.pop(data.draw(st.integers(0, len(held) - 1)))
            book.charge(victim, CLS, gpus(n), -1)
        elif book.check(q, CLS, gpus(amount)) is None:
            book.charge(q, CLS, gpus(amount), 1)
            held.append((q, amount))
        _check_tree(book)
    for q, n in held:
        book.charge(q, CLS, gpus(n), -1)
    _check_tree(book)
    assert all(q.used(CLS) == [0, 0, 0] for q in book.queues.values())
    assert all(co.borrowed.get(CLS, [0, 0, 0]) == [0, 0, 0] for co in book.cohorts.values())
