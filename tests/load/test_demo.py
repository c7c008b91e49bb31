"""`make demo --fast` end to end, in-process: the README's first command must keep working and
keep showing what it claims (a spot notice moves a job, which resumes from its checkpoint)."""

from __future__ import annotations

import io
import time

from rich.console import Console

from load.demo import HARD_CAP_S, DemoOptions, run_demo


async def test_fast_demo_shows_checkpointed_recovery() -> None:
    """At 80 columns, the width of a default terminal, so nothing the summary says is cut."""
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=False)
    started = time.monotonic()
    result = await run_demo(DemoOptions(fast=True, live=False), console)
    elapsed = time.monotonic() - started
    text = out.getvalue()

    assert result.exit_code == 0, text
    assert elapsed < min(HARD_CAP_S, 45), text
    assert result.views and all(v["state"] == "succeeded" for v in result.views.values()), text

    # The spot notice preempted a job; its next attempt resumed from a checkpoint on another
    # pool, and the fake cluster agrees on the step it started from.
    notices = [i for i in result.injections if i.kind == "spot-notice"]
    assert len(notices) == 1, text
    notice = notices[0]
    attempts = result.views[notice.job_id]["attempts"]
    first, second = attempts[notice.attempt - 1], attempts[notice.attempt]
    assert first["end_cause"] == "spot-notice"
    assert second["resume_from_step"] > 0
    assert (second["cluster"], second["flavor"]) != (first["cluster"], first["flavor"])
    history = {r.attempt: r for r in result.histories[notice.job_id]}
    assert history[notice.attempt].end_phase == "cancelled"
    assert history[notice.attempt].last_checkpoint_step == second["resume_from_step"]
    assert history[second["attempt"]].started_from_step == second["resume_from_step"]
    assert history[second["attempt"]].end_phase == "succeeded"
    # The whole summary fits 80 columns: every header word and every attempt line whole.
    summary = text[text.index("Summary (from muster.api.get)") : text.index("What you just saw")]
    assert "…" not in summary, summary
    assert all(len(line) <= 80 for line in summary.splitlines()), summary
    for header in ("pre-", "empted", "GPU-s", "used", "lost", "good-", "put", "cost $"):
        assert header in summary.split("─")[0], summary
    moved = f"#{second['attempt']} {second['cluster']}/{second['flavor']}, from step "
    assert f"{moved}{second['resume_from_step']} → succeeded" in summary, summary
    # "Work lost" is one measure: the paragraph quotes the attempt's GPU-seconds lost, and the
    # summary row of that job (one preemption) shows the same figure.
    lost = f"{float(first['gpu_seconds_lost']):,.0f}"
    assert f"it lost {lost} GPU-seconds" in " ".join(text.split()), text
    row = next(line for line in text.splitlines() if line.strip().startswith(notice.job_id))
    assert lost in row.split(), row

    # The XID failure ended an attempt without warning, and that job still succeeded.
    failures = [i for i in result.injections if i.kind == "gpu-failure"]
    assert len(failures) == 1, text
    assert result.views[failures[0].job_id]["attempts"][0]["end_cause"].startswith("gpu-failure")

    # Never two live copies of a job; everything the demo started was stopped.
    assert result.max_live_copies and max(result.max_live_copies.values()) == 1
    assert result.stray_tasks == []
    assert result.errors == [], result.errors
    assert "What you just saw" in text and "Traceback" not in text
