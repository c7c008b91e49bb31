"""A real broker behind the generated authorization: each team acts through its own NATS
user, and whatever it tries against another team's queue or job is refused with nothing
changed; an admin can do all of it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from broker.client import MusterError
from broker.service import Broker
from schemas.job import JobSpec, PodSet
from tests.security.conftest import AuthNats, client_as

SPEC = JobSpec(name="train", gang=[PodSet(name="worker", replicas=1, gpu=1)])


async def test_teams_touch_only_their_own_jobs(auth_nats: AuthNats, broker: Broker) -> None:
    alpha = await client_as(auth_nats, "team-alpha", "alpha")
    beta = await client_as(auth_nats, "team-beta", "beta")
    admin = await client_as(auth_nats, "admin")
    try:
        spec = SPEC
        mine = (await alpha.submit(spec, queue="vision")).job_id
        theirs = (await beta.submit(spec, queue="speech")).job_id
        # Another team's queue: NATS refuses the publish, so nothing is ever queued.
        with pytest.raises(MusterError):
            await beta.submit(spec, queue="vision", timeout=1)
        with pytest.raises(MusterError):
            await alpha.submit(spec, queue="ops", timeout=1)
        # Another team's job: unknown to it, for every verb; nothing changes.
        for call in (beta.cancel, beta.get, beta.why):
            with pytest.raises(MusterError, match="unknown job"):
                await call(mine)
        with pytest.raises(MusterError, match="not team 'beta'"):
            await beta.list(queue="vision")
        assert [j.job_id for j in await beta.list()] == [theirs]
        assert [j.job_id for j in await alpha.list()] == [mine]
        everything = await admin.list()
        assert sorted(j.job_id for j in everything) == sorted([mine, theirs])
        assert {j.job_id: j.state for j in everything}[mine] == "queued"
        # The owner hears its own job's events on its team subject and may cancel it.
        heard: list[Any] = []

        async def on_event(msg: Any) -> None:
            heard.append(msg)

        await alpha.nc.subscribe(f"muster.events.team.alpha.{mine}", cb=on_event)
        await alpha.nc.flush()
        assert (await alpha.cancel(mine)).state == "cancelled"
        for _ in range(200):
            if heard:
                break
            await asyncio.sleep(0.01)
        assert heard and b'"cancelled"' in heard[0].data
        # An admin acts on every team's jobs.
        assert (await admin.cancel(theirs)).state == "cancelled"
        assert (await admin.get(mine)).state == "cancelled"
    finally:
        for c in (alpha, beta, admin):
            await c.close()
