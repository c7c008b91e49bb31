"""The harsh spot world (load/scenarios/harsh.yaml: 4-node spot zones, 30 s notices,
checkpoints that take 60-300 s to write and as long to read back). With a fixed 300 s start
timeout, restoring attempts were killed just before they ran, again and again: one job reached
155 attempts and 1,031 attempts ended by the start timeout in a 300-job run. The start timeout
now grows with the restore, so starts finish."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from broker.core.records import AttemptRecord, JobRecord
from broker.core.spotreturn import SPOT_RETURN
from load.report import returns_reclaimed, summarize
from load.scenario import apply_scenario, load_scenario
from load.sim import Sim
from load.simconfig import SimConfig
from schemas.job import JobSpec, PodSet

HARSH = Path(__file__).resolve().parents[2] / "load" / "scenarios" / "harsh.yaml"


def test_no_job_livelocks_on_its_start_timeout_in_the_harsh_world() -> None:
    cfg = apply_scenario(replace(SimConfig(), jobs=150, seed=1), load_scenario(HARSH))
    assert cfg.ckpt_cost_s == (60.0, 300.0)  # restores longer than start-up alone
    result = Sim(cfg, "muster").run()
    s = summarize(result)
    assert s["violations"] == 0, s["first_violations"]
    assert s["resumed_attempts"] > 50  # restores really happened
    assert s["start_timeouts"] == 0, s["start_timeouts"]
    assert s["attempts_max"] <= 20, s["attempts_max"]


def _attempt(n: int, capacity: str, end: str | None) -> AttemptRecord:
    return AttemptRecord(
        attempt=n,
        cluster="c",
        flavor=capacity,
        flavor_class=capacity,
        assignment=[],
        dispatched_at=float(n),
        capacity_type=capacity,
        ended_at=None if end is None else float(n) + 0.5,
        end_cause=end,
    )


def test_the_report_counts_spot_returns_that_were_reclaimed_again() -> None:
    spec = JobSpec(name="j", gang=[PodSet(name="w", replicas=1, gpu=1)])
    attempts = {
        # returned, reclaimed, returned again, still running there
        "a": ["spot-notice", SPOT_RETURN, "spot-notice", SPOT_RETURN, None],
        # returned and finished there
        "b": [SPOT_RETURN, "succeeded"],
        # never returned
        "c": ["spot-notice", "succeeded"],
    }
    records = {
        job: JobRecord(
            job_id=job,
            spec=spec,
            queue="q",
            order=1,
            submitted_at=0.0,
            attempts=[
                _attempt(i + 1, "on-demand" if end == SPOT_RETURN else "spot", end)
                for i, end in enumerate(ends)
            ],
        )
        for job, ends in attempts.items()
    }
    result: Any = SimpleNamespace(records=records)
    assert returns_reclaimed(result) == (3, 1)
