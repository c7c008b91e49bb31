"""PendingQueue keeps a queue's jobs in admission order under adds, removals and re-adds."""

from __future__ import annotations

import random

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
