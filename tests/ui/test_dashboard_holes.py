"""The dashboard's pages have no holes, in headless Chromium against a real broker and fake
clusters: a job never admitted has a page that says why, a full fleet shows 0 free GPUs (not
NaN) and no blank numbers, the queue page says which names are flavor classes, a finished job
says where it ran, and the interruptions page counts what it lists and when the move ran."""

from __future__ import annotations

from typing import Any

from tests.ui.chromium import BROWSER_MARKS
from tests.ui.chromium import page as page  # the fixture, shared
from tests.ui.conftest import Live
from tests.world import sim_job

# Debian's chromium through Playwright, as the other browser tests (skipped without it).
pytestmark = BROWSER_MARKS

LONG = 1_000_000  # steps: runs for the whole test


async def _fill_the_fleet(live: Live) -> list[str]:
    """Both clusters' one 8-GPU node run a long job each."""
    h = live.world.harness
    ids = []
    for i in range(2):
        reply = await h.submit(sim_job(f"hold-{i}", steps=LONG, capacity="spot"))
        assert reply.accepted, reply.error
        ids.append(reply.job_id)
    for job_id in ids:
        await h.wait_event(job_id, "running", timeout=20)
    return ids


async def test_a_job_never_admitted_shows_why(live: Live, page: Any) -> None:
    await _fill_the_fleet(live)
    h = live.world.harness
    reply = await h.submit(sim_job("waiting", steps=LONG, capacity="spot"))
    assert reply.accepted
    machine = h.broker.machine
    assert machine is not None
    await h.wait_for(lambda: machine.views.first_reason(reply.job_id or "") is not None)
    await page.goto(live.url + f"/#/job/{reply.job_id}")
    await page.wait_for_selector("[data-testid=why] li")
    assert await page.locator("[data-testid=job-state]").text_content() == "queued"
    why = await page.locator("[data-testid=why]").text_content() or ""
    assert "insufficient-capacity" in why or "capacity" in why, why
    assert await page.locator("p.error").count() == 0
    assert await page.locator("[data-testid=attempts] tbody tr").count() == 0


async def test_a_full_fleet_shows_zero_free_gpus_and_no_blank_numbers(
    live: Live, page: Any
) -> None:
    await _fill_the_fleet(live)
    await page.goto(live.url + "/#/fleet")
    await page.wait_for_selector("[data-testid=fleet] tbody tr")
    assert await page.locator("[data-testid=free-gpus]").text_content() == "0"
    cells = await page.locator("[data-testid=fleet] td.num").all_text_contents()
    assert cells and all(c.strip() for c in cells), cells
    assert not any("NaN" in c or "undefined" in c for c in cells), cells


async def test_the_queue_page_tells_flavor_classes_from_cluster_flavors(
    live: Live, page: Any
) -> None:
    await _fill_the_fleet(live)
    await page.goto(live.url + "/#/queues")
    await page.wait_for_selector("[data-testid=queues] tbody tr")
    header = await page.locator("[data-testid=queues] thead").text_content() or ""
    assert "flavor class" in header
    flavors = await page.locator("[data-testid=queues] td[data-col=flavor]").all_text_contents()
    # No flavor class is configured: the pools count under their cluster flavor's own name.
    assert "spot (cluster flavor)" in flavors, flavors


async def test_a_finished_job_says_where_it_ran(live: Live, page: Any) -> None:
    h = live.world.harness
    reply = await h.submit(sim_job("short", steps=5, capacity="spot"))
    assert reply.accepted
    await h.wait_event(reply.job_id or "", "succeeded", timeout=30)
    await page.goto(live.url + "/#/jobs?state=succeeded")
    cell = page.locator(f'tr[data-job="{reply.job_id}"] td[data-col=cluster]')
    await cell.wait_for()
    where = await cell.text_content() or ""
    assert where.endswith("/spot") and where.split("/")[0] in ("a", "b"), where


async def test_interruptions_count_what_they_list_and_time_the_move(live: Live, page: Any) -> None:
    h = live.world.harness
    reply = await h.submit(sim_job("moved", steps=LONG, capacity="spot"))
    job_id = reply.job_id or ""
    await h.wait_event(job_id, "checkpointed", timeout=20)
    live.reclaim(job_id)
    await h.wait_for(
        lambda: h.broker.machine is not None and h.broker.machine.jobs[job_id].attempt == 2
    )
    recent = live.dashboard.hub.interruptions.recent
    await h.wait_for(lambda: any(i.job_id == job_id and i.running_at for i in recent))
    await page.goto(live.url + "/#/interruptions")
    row = page.locator(f'[data-testid=interruptions] tr[data-job="{job_id}"]')
    await row.wait_for()
    await page.wait_for_function(
        f"""document.querySelector('[data-testid=interruptions] tr[data-job="{job_id}"]'
              + ' td[data-col=running]')?.textContent.endsWith('s')"""
    )
    running = await row.locator("td[data-col=running]").text_content() or ""
    assert running != "0.0s", running
    summary = await page.locator("[data-testid=interruptions-summary]").text_content() or ""
    assert "1 interruption of a job" in summary and "spot notices on the fleet" in summary


async def test_a_preempted_job_says_who_it_made_room_for(world: Any, page: Any) -> None:
    """Kueue's "Preempted to accommodate a workload ..." is the bar: the victim's page says
    which job took its place, with what priority, and by which rule."""
    import msgspec

    from broker.ui.server import Dashboard
    from schemas.config import SchedulingConfig
    from tests.world import flavor

    h = world.harness
    h.config = msgspec.structs.replace(
        h.config, scheduling=SchedulingConfig(preemption_min_runtime_s=0.0)
    )
    await world.start({"a": [flavor("spot", "spot", nodes=1)]})
    dashboard = Dashboard(h.broker)
    await dashboard.start("127.0.0.1", 0)
    try:
        low = (await h.submit(sim_job("low", steps=LONG, capacity="spot"))).job_id or ""
        await h.wait_event(low, "running", timeout=20)
        high = (await h.submit(sim_job("high", steps=LONG, capacity="spot", priority=100))).job_id
        await h.wait_event(low, "requeued", timeout=60)
        await page.goto(dashboard.url + f"/#/job/{low}")
        reason = page.locator("[data-testid=job-reason]")
        await reason.wait_for()
        text = await reason.text_content() or ""
        assert f"preempted: to accommodate {high} (priority 100)" in text, text
        assert "LowerPriority" in text
    finally:
        await dashboard.stop()
