"""`python -m load.sim --reasons`: how often each wait reason fired, counted by reading the
scheduler's results, without changing the run."""

from __future__ import annotations

from dataclasses import replace

from load.report import summarize
from load.sim import Sim, SimResult
from load.sim.reasons import SPOT_KEPT, format_reasons
from tests.load.small_sim import SMALL

# One node per pool: jobs queue, so there are reasons to count.
CFG = replace(SMALL, jobs=120, pools=tuple(replace(p, nodes=1) for p in SMALL.pools))


def figures(result: SimResult) -> dict[str, str]:
    """A run's summary but its wall time, as text (NaN equals itself there)."""
    return {k: repr(v) for k, v in summarize(result).items() if k != "wall_s"}


def test_counting_reasons_leaves_the_run_as_it_was() -> None:
    counted = Sim(CFG, "muster")
    plain = Sim(CFG, "muster")
    plain.machine.cycle_observers.clear()  # nothing counted
    a, b = counted.run(), plain.run()
    assert figures(a) == figures(b)
    assert counted.reasons["insufficient-capacity"] > 0
    assert sum(plain.reasons.values()) == 0


def test_the_table_lists_every_reason_per_policy_and_per_run() -> None:
    runs = [
        {"policy": "muster", "reasons": {"insufficient-capacity": 1200, SPOT_KEPT: 3}},
        {"policy": "muster", "reasons": {"insufficient-capacity": 34}},
        {"policy": "on-demand-only", "reasons": {}},
    ]
    lines = format_reasons(runs).splitlines()
    assert lines[1:] == [
        "muster",
        "  insufficient-capacity             1,234   1,200, 34",
        "  spot-held                             0   0, 0",
        "  spot-kept                             3   3, 0",
        "on-demand-only",
        "  spot-held                             0   0",
        "  spot-kept                             0   0",
    ]
