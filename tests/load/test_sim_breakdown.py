"""`python -m load.sim --breakdown`: where a run's cost and time went, read from the attempt
logs, adds up to what the run paid and did."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from load.sim import Sim, SimResult, main
from load.sim.breakdown import Breakdown, breakdown, format_breakdown, jct_gap
from tests.load.small_sim import SMALL

CFG = replace(SMALL, jobs=120)


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[Sim, SimResult, Breakdown]]:
    out = {}
    for policy in ("muster", "on-demand-only"):
        sim = Sim(CFG, policy)
        res = sim.run()
        out[policy] = (sim, res, breakdown(res, sim.jobs_by_id))
    return out


def test_paid_per_pool_adds_up_to_what_the_completed_jobs_cost(
    runs: dict[str, tuple[Sim, SimResult, Breakdown]],
) -> None:
    for _, res, b in runs.values():
        end = res.base + res.end
        done = {j for j, r in res.records.items() if r.state == "succeeded"}
        cost = sum(x.gpu_s(end) / 3600 * x.price for j in done for x in res.logs.get(j, []))
        assert sum(b.paid_usd.values()) == pytest.approx(cost)
        useful = sum(j.gpus * j.duration for j in res.jobs if j.job_id in done) / 3600
        assert b.time_h["useful"] == pytest.approx(useful)
        assert 0 < b.time_h["useful"] < b.time_h["paid"]
        assert sum(len(w) for w in b.waits_s.values()) == sum(
            1 for r in res.records.values() if r.attempts
        )


def test_only_reclaims_lose_work_and_the_worst_job_is_named(
    runs: dict[str, tuple[Sim, SimResult, Breakdown]],
) -> None:
    od = runs["on-demand-only"][2]
    assert od.lost_h == {} and not any(f.endswith("spot") for f, _ in od.paid_usd)
    assert od.time_h["later start-up + restore"] == 0.0  # one attempt per job
    _, res, b = runs["muster"]
    assert sum(b.lost_h.values()) > 0  # the traces reclaimed nodes under running gangs
    assert b.time_h["work done again"] == pytest.approx(sum(b.lost_h.values()))
    assert b.worst is not None
    job_id, _, _, per_flavor, _ = b.worst
    assert sum(per_flavor.values()) == max(len(logs) for logs in res.logs.values())
    assert sum(per_flavor.values()) == len(res.logs[job_id])
    text = format_breakdown(b, "muster", {"a100-spot": 1.0})
    assert f"most attempts: {job_id}" in text and "a100-spot 100.0%" in text


def test_the_command_prints_it_and_keeps_it_out_of_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    args = ["--jobs", "30", "--policy", "muster", "--workers", "1", "--max-duration-h", "1"]
    assert main([*args, "--out", "", "--breakdown", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "paid for the completed jobs" in text and "first dispatch, " in text
    assert all("breakdown" not in r for r in json.loads(out.read_text())["runs"])


def test_the_jct_gap_names_each_preference_and_is_nil_against_itself(
    runs: dict[str, tuple[Sim, SimResult, Breakdown]],
) -> None:
    od, muster = runs["on-demand-only"][2], runs["muster"][2]
    assert len(od.jobs) == len(muster.jobs) == CFG.jobs
    same = jct_gap(od, od)
    assert ": 1.00x" in same and "by a slower run 0, by a wait 0" in same
    assert same.count(" 1.00x") == 1 + len({j[0] for j in od.jobs.values()})
    text = jct_gap(muster, od)
    for pref in {j[0] for j in muster.jobs.values()}:
        assert f"{pref} " in text.splitlines()[1]


def test_the_jct_gap_puts_the_gap_on_the_preference_that_makes_it() -> None:
    """Five jobs of 1 h on on-demand-only; here the three spot ones waited and took 3 h."""
    base, run = Breakdown("on-demand-only"), Breakdown("muster")
    for i, pref in enumerate(["spot", "spot", "spot", "any", "on-demand"]):
        base.jobs[f"j{i}"] = (pref, 1.0, 0.0, "A100")
        slow = pref == "spot"
        run.jobs[f"j{i}"] = (pref, 3.0 if slow else 1.0, 100.0 if slow else 0.0, "V100")
    lines = jct_gap(run, base).splitlines()
    assert lines[0].endswith(": 3.00x")
    assert lines[1].endswith("any 3.00x, on-demand 3.00x, spot 1.00x")
    assert "near the median: 5; over 1.2x as long by a slower run 0, by a wait 3" in lines[2]
    assert "{'V100': 5} (on-demand-only: {'A100': 5})" in lines[2]
