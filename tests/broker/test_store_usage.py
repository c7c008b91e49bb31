"""What each queue's jobs hold in the job bucket (`StoreUsage`), kept by changes, against the
same totals summed from every job's newest record."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.store import StoreUsage
from tests.broker.jobs import record

JOBS = [f"j{i}" for i in range(6)]
QUEUES = ["q0", "q1", "q2"]
STATES = ["queued", "admitted", "running", "succeeded", "failed", "cancelled"]
ACTIVE = {"queued", "admitted", "running"}

note = st.tuples(
    st.just("note"),
    st.sampled_from(JOBS),
    st.sampled_from(QUEUES),
    st.integers(0, 5000),
    st.sampled_from(STATES),
)
forget = st.tuples(st.just("forget"), st.sampled_from(JOBS))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(note, forget), max_size=40))
def test_totals_match_the_newest_record_of_every_job(ops: list[tuple[object, ...]]) -> None:
    usage = StoreUsage()
    newest: dict[str, tuple[str, int, str]] = {}
    for op in ops:
        if op[0] == "note":
            _, job, queue, size, state = op
            r = record(str(job), state=str(state))
            r.queue = str(queue)
            usage.note(r, int(size))  # type: ignore[call-overload]
            newest[str(job)] = (str(queue), int(size), str(state))  # type: ignore[call-overload]
        else:
            usage.forget(str(op[1]))
            newest.pop(str(op[1]), None)
        for queue in QUEUES:
            held = [v for v in newest.values() if v[0] == queue]
            want = (sum(v[1] for v in held), sum(1 for v in held if v[2] in ACTIVE))
            assert usage.of({queue}) == want
        assert usage.of(set(QUEUES)) == (
            sum(v[1] for v in newest.values()),
            sum(1 for v in newest.values() if v[2] in ACTIVE),
        )
