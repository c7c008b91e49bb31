"""PendingQueue keeps a queue's jobs in admission order under adds, removals and re-adds."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core.pending import PendingQueue


def test_matches_a_sorted_reference_under_random_operations() -> None:
    rng = random.Random(7)
    q = PendingQueue()
    ref: dict[str, tuple[int, int]] = {}
    for step in range(20_000):
        job = f"j{rng.randrange(3000)}"
        if rng.random() < 0.6:
            prio = rng.choice((0, 0, 0, 5, -3))
            order = rng.randrange(100_000)
            q.add(job, prio, order)
            ref[job] = (-prio, order)
        else:
            q.discard(job)
            ref.pop(job, None)
        if step % 2000 == 0:
            want = sorted(ref, key=lambda j: (*ref[j], j))
            assert list(q) == want
            assert len(q) == len(ref)
            for j in want[:50:7]:
                assert q.rank(j) == want.index(j)
            keys = [(*ref[j], j) for j in want]
            assert list(q.entries()) == keys
            for n in (0, 1, 511, 512, 1024, len(keys) - 1, len(keys), len(keys) + 5):
                assert q.nth_key(n) == (keys[n] if 0 <= n < len(keys) else None)
    want = sorted(ref, key=lambda j: (*ref[j], j))
    assert list(q) == want
    assert all(j in q for j in want) and "absent" not in q


def test_heads_skip_jobs_that_are_not_ready_and_stop_at_n() -> None:
    q = PendingQueue()
    for i in range(5000):
        q.add(f"j{i}", 0, i)
    backoff = {f"j{i}" for i in range(0, 5000, 2)}
    heads = q.heads(10, lambda j: j not in backoff)
    assert heads == [f"j{i}" for i in range(1, 20, 2)]
    assert q.heads(0, lambda j: True) == []
    q.add("urgent", 10, 99_999)  # higher priority goes first whatever its order
    assert q.heads(1, lambda j: True) == ["urgent"]
    assert q.rank("urgent") == 0 and q.rank("j0") == 1


@settings(max_examples=200, deadline=None)
@given(
    before=st.lists(st.tuples(st.integers(0, 300), st.integers(-3, 3)), max_size=400),
    batch=st.lists(st.tuples(st.integers(0, 300), st.integers(-3, 3)), max_size=2000),
    after=st.lists(st.tuples(st.booleans(), st.integers(0, 300)), max_size=200),
)
def test_adding_many_at_once_is_adding_each(
    before: list[tuple[int, int]],
    batch: list[tuple[int, int]],
    after: list[tuple[bool, int]],
) -> None:
    """A restore's bulk add leaves the queue as adding each job in turn would (a re-added job
    takes its newest key), and later adds and removals still keep it sorted."""
    one, many = PendingQueue(), PendingQueue()
    for n, (job, prio) in enumerate(before):
        one.add(f"j{job}", prio, n)
        many.add(f"j{job}", prio, n)
    items = [(f"j{job}", prio, 1000 + n) for n, (job, prio) in enumerate(batch)]
    for item in items:
        one.add(*item)
    many.add_many(items)
    for n, (adding, job) in enumerate(after):
        for q in (one, many):
            if adding:
                q.add(f"j{job}", 0, 5000 + n)
            else:
                q.discard(f"j{job}")
        assert list(many) == list(one) and len(many) == len(one)
    assert list(many) == list(one) and len(many) == len(one)
    assert all(many.rank(j) == one.rank(j) for j in list(one)[:20])
    assert many.heads(7, lambda j: j.endswith("1")) == one.heads(7, lambda j: j.endswith("1"))
