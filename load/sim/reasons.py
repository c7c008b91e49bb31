"""How often each wait reason fired in one run (`python -m load.sim --reasons`): every job the
scheduler could not place in a cycle counts once per reason code it gave, and `spot-kept` counts
every job the spot-kept rule turned away from spot (`placement.spot_kept_for`), whether it took
on-demand instead or waits for on-demand (then also counted as `spot-held`).

Read from the machine's cycle observers (`Machine.cycle_observers`): the result is only read,
so a run counts the same figures it would without the counter."""

from __future__ import annotations

from collections import Counter
from typing import Any

from broker.core.machine import Machine
from broker.core.types import CycleResult

SPOT_KEPT = "spot-kept"


def count_reasons(machine: Machine) -> Counter[str]:
    """The counts of `machine`'s cycles from now on, filled in as it runs."""
    counts: Counter[str] = Counter()

    def observe(result: CycleResult) -> None:
        for reasons in result.pending.values():
            counts.update({r.code for r in reasons})
        counts[SPOT_KEPT] += len(result.spot_held)

    machine.cycle_observers.append(observe)
    return counts


def format_reasons(runs: list[dict[str, Any]]) -> str:
    """Per policy, each reason's count summed over its runs, then per run in run order."""
    by_policy: dict[str, list[Counter[str]]] = {}
    for r in runs:
        by_policy.setdefault(r["policy"], []).append(Counter(r["reasons"]))
    lines = ["wait reasons fired (job x cycle), per policy: total, then per run"]
    for policy, counts in by_policy.items():
        lines.append(policy)
        codes = sorted(set().union(*counts) | {SPOT_KEPT, "spot-held"})
        for code in codes:
            per_run = ", ".join(f"{c[code]:,}" for c in counts)
            lines.append(f"  {code:<28} {sum(c[code] for c in counts):>10,}   {per_run}")
    return "\n".join(lines)
