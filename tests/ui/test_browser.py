"""The dashboard in headless Chromium (Debian's, driven by Playwright) against a real broker and
fake clusters: a job appears, runs, gets a spot notice and resumes on the other cluster, and the
page follows it live, without a reload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.ui.chromium import BROWSER_MARKS
from tests.ui.chromium import page as page  # the fixture, shared
from tests.ui.conftest import Live
from tests.world import sim_job

pytestmark = BROWSER_MARKS


async def _mark(page: Any) -> None:
    """A value that only survives while the page is never reloaded."""
    await page.evaluate("window.__sameDocument = true")


async def _assert_not_reloaded(page: Any) -> None:
    assert await page.evaluate("window.__sameDocument === true"), "the page was reloaded"


async def test_jobs_page_follows_a_job_through_a_spot_move(
    live: Live, page: Any, tmp_path: Path
) -> None:
    h = live.world.harness
    await page.goto(live.url + "/#/jobs")
    await page.wait_for_selector("#live.on")
    await _mark(page)
    job_id = (await h.submit(sim_job("browser-jobs", steps=4000, capacity="spot"))).job_id
    row = page.locator(f'tr[data-job="{job_id}"]')
    await row.wait_for()
    await page.wait_for_function(
        f"""document.querySelector('tr[data-job="{job_id}"] td[data-col=state]')
            ?.textContent === 'running'"""
    )
    first = live.reclaim(job_id).cluster
    await page.wait_for_function(
        f"""(() => {{
            const r = document.querySelector('tr[data-job="{job_id}"]');
            return r && r.querySelector('td[data-col=attempt]').textContent === '2'
              && r.querySelector('td[data-col=state]').textContent === 'running';
        }})()"""
    )
    where = await row.locator("td[data-col=cluster]").text_content()
    assert where is not None and not where.startswith(first + "/")
    await _assert_not_reloaded(page)
    await page.screenshot(path=str(tmp_path / "jobs.png"), full_page=True)


async def test_job_page_draws_the_timeline_and_interruptions_live(
    live: Live, page: Any, tmp_path: Path
) -> None:
    h = live.world.harness
    job_id = (await h.submit(sim_job("browser-detail", steps=4000, capacity="spot"))).job_id
    await page.goto(live.url + f"/#/job/{job_id}")
    await page.wait_for_selector("#live.on")
    await _mark(page)
    state = page.locator("[data-testid=job-state]")
    await page.wait_for_function(
        "document.querySelector('[data-testid=job-state]')?.textContent === 'running'"
    )
    await h.wait_event(job_id, "checkpointed", timeout=20)
    first = live.reclaim(job_id).cluster
    await page.wait_for_function(
        "document.querySelector('[data-testid=job-attempt]')?.textContent === '2'"
        " && document.querySelector('[data-testid=job-state]')?.textContent === 'running'"
    )
    assert await state.text_content() == "running"
    cluster = await page.locator("[data-testid=job-cluster]").text_content()
    assert cluster and cluster != first
    label = page.locator('[data-testid=timeline] text[data-attempt="2"]')
    assert "resumed from step" in (await label.text_content() or "")
    await page.wait_for_function(
        "document.querySelector('[data-testid=logs]')?.textContent.includes('attempt 2 on')"
    )
    ended = page.locator('[data-testid=attempts] tr[data-attempt="1"]')
    assert "spot-notice" in (await ended.text_content() or "")
    await _assert_not_reloaded(page)
    await page.screenshot(path=str(tmp_path / "job.png"), full_page=True)
    # The interruptions page shows the same move with its notice -> new attempt latency.
    await page.click("nav a[data-page=interruptions]")
    item = page.locator(f'[data-testid=interruptions] tr[data-job="{job_id}"]')
    await item.wait_for()
    text = await item.text_content() or ""
    assert "spot-notice" in text and cluster in text
    await _assert_not_reloaded(page)
    await page.screenshot(path=str(tmp_path / "interruptions.png"), full_page=True)
