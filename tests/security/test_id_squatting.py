"""A squatter who could predict the id a victim's submission will get could submit that id
first, and the victim's job would be answered "duplicate" and never exist. Server-derived ids
are keyed with the submit stream's secret, which no client can read, so the victim's id is
known only once the broker answers."""

from __future__ import annotations

import hashlib

from broker.core.submission import derive_job_id
from tests.broker.conftest import Harness
from tests.broker.test_submit import job


def _unkeyed(basis: str) -> str:
    return hashlib.blake2b(basis.encode(), digest_size=6).hexdigest()


async def test_a_squatter_cannot_take_the_id_a_victim_will_get(harness: Harness) -> None:
    h = harness
    broker = await h.start_broker()
    stream = h.subjects.submit_stream
    js = h.nc.jetstream()
    # The squatter knows the scheme and the stream's next sequence numbers, but not the key:
    # it pre-submits every id the next submissions could get without the key.
    info = await js.stream_info(stream)
    nxt = info.state.last_seq + 1
    guesses = [derive_job_id("victim", _unkeyed(f"seq:{nxt + i}:0")) for i in range(1, 4)]
    for guess in guesses:
        assert (await h.submit(job("squat", job_id=guess))).accepted
    replies = [await h.submit(job("victim")) for _ in range(3)]
    assert all(r.accepted and not r.duplicate for r in replies), replies
    ids = [r.job_id for r in replies]
    assert len(set(ids)) == 3 and not set(ids) & set(guesses)
    assert broker.machine is not None
    assert all(broker.machine.jobs[i].spec.name == "victim" for i in ids)
    assert all(broker.machine.jobs[g].spec.name == "squat" for g in guesses)
