"""Metrics and plots for `load.sim` runs.

Ground truth comes from the simulated clusters' attempt logs (what the GPUs really did), not
from the broker's own accounting, so a bug in the broker's bookkeeping cannot flatter it. The
broker's figure for lost GPU-hours is kept beside it as a cross-check.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from broker.core.records import JobRecord
from broker.core.spotreturn import SPOT_RETURN
from broker.core.states import PLANNED_MOVES

# What the report reads of a run, as the simulator's types provide it (load/sim/ AttemptLog,
# SimJob, Violation, SimResult): stated here so the report does not import the simulator that
# imports it.


class AttemptLog(Protocol):
    """Ground truth for one attempt, from the simulated cluster."""

    @property
    def gpus(self) -> int: ...
    @property
    def price(self) -> float: ...
    @property
    def capacity_type(self) -> str: ...
    @property
    def speed(self) -> float: ...
    @property
    def gpu_type(self) -> str: ...
    @property
    def dispatched_at(self) -> float: ...
    @property
    def running_at(self) -> float | None: ...
    @property
    def ended_at(self) -> float | None: ...
    @property
    def noticed_at(self) -> float | None: ...
    @property
    def start_step(self) -> int: ...
    @property
    def ckpt_steps(self) -> Sequence[int]: ...
    @property
    def ckpt_times(self) -> Sequence[float]: ...
    @property
    def cause(self) -> str: ...
    @property
    def succeeded(self) -> bool: ...
    @property
    def gpu_nodes(self) -> int: ...
    @property
    def zones(self) -> int: ...
    @property
    def blocks(self) -> int: ...
    def held_s(self, now: float) -> float: ...
    def gpu_s(self, now: float) -> float: ...


class _Job(Protocol):
    @property
    def job_id(self) -> str: ...
    @property
    def gpus(self) -> int: ...
    @property
    def duration(self) -> int: ...


class _Violation(Protocol):
    @property
    def at(self) -> float: ...
    @property
    def kind(self) -> str: ...
    @property
    def detail(self) -> str: ...


class SimResult(Protocol):
    """One simulation run: the jobs, the broker's records and the clusters' attempt logs."""

    @property
    def policy(self) -> str: ...
    @property
    def jobs(self) -> Sequence[_Job]: ...
    @property
    def records(self) -> Mapping[str, JobRecord]: ...
    @property
    def logs(self) -> Mapping[str, Sequence[AttemptLog]]: ...
    @property
    def violations(self) -> Sequence[_Violation]: ...
    @property
    def checks(self) -> int: ...
    @property
    def steps(self) -> int: ...
    @property
    def base(self) -> float: ...
    @property
    def end(self) -> float: ...
    @property
    def wall_s(self) -> float: ...
    @property
    def spot_notices(self) -> int: ...
    @property
    def batch_errors(self) -> Sequence[str]: ...


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no values (so an empty policy shows as such)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, math.ceil(q / 100.0 * len(ordered)) - 1))
    return ordered[k]


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _share(part: int, whole: int) -> float:
    return part / whole if whole else float("nan")


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# Attempts the broker ended on purpose to move the job (broker/core/spotreturn.py): the work
# is checkpointed first, so they are not preemptions.
PLANNED_CAUSES = frozenset(f"cancel: {cause}" for cause in PLANNED_MOVES)


def attempt_losses(logs: Sequence[AttemptLog], end: float) -> list[float]:
    """GPU-seconds each attempt lost: time held minus the time that produced what a later
    attempt kept.

    An attempt that did not succeed keeps only the progress the next attempt resumed from:
    the time from its gang running to the moment that checkpoint was written (computing and
    writing the checkpoints before it included). Everything else it held (start-up, work
    after that checkpoint) is lost. A live attempt at the end of the run has lost nothing yet.
    """
    out: list[float] = []
    for i, log in enumerate(logs):
        if log.succeeded or log.ended_at is None:
            out.append(0.0)
            continue
        target = logs[i + 1].start_step if i + 1 < len(logs) else None
        if target is None and log.ckpt_steps:
            target = log.ckpt_steps[-1]
        kept = 0.0
        if target is not None and target > log.start_step and log.running_at is not None:
            for step, at in zip(log.ckpt_steps, log.ckpt_times, strict=True):
                if step == target:
                    kept = at - log.running_at
                    break
        held = log.held_s(end)  # an elastic attempt's sizes weigh by their time
        out.append(log.gpu_s(end) * max(0.0, held - kept) / held if held > 0 else 0.0)
    return out


def lost_by_job(result: SimResult) -> list[float]:
    """GPU-hours lost per job (jobs that lost nothing included)."""
    end = result.base + result.end
    return [sum(attempt_losses(result.logs.get(j.job_id, []), end)) / 3600.0 for j in result.jobs]


def jct_hours(result: SimResult) -> list[float]:
    """Submit to success, for the jobs that succeeded."""
    return [
        (r.finished_at - r.submitted_at) / 3600.0
        for r in result.records.values()
        if r.state == "succeeded" and r.finished_at is not None
    ]


def queue_delays_s(result: SimResult) -> list[float]:
    """Submit to first dispatch (what Philly's published queueing delay measures)."""
    return [
        r.attempts[0].dispatched_at - r.submitted_at for r in result.records.values() if r.attempts
    ]


def returns_reclaimed(result: SimResult) -> tuple[int, int]:
    """(spot-returns, of them reclaimed again): attempts that followed a move back to spot
    and ended on spot without success or another planned move."""
    returns = reclaimed = 0
    for r in result.records.values():
        for before, after in itertools.pairwise(r.attempts):
            if before.end_cause != SPOT_RETURN:
                continue
            returns += 1
            if after.ended_at is not None and after.end_cause not in ("succeeded", *PLANNED_MOVES):
                reclaimed += 1
    return returns, reclaimed


def summarize(result: SimResult) -> dict[str, Any]:
    """One row of the comparison table (plain floats and ints, JSON-ready)."""
    end = result.base + result.end
    used = lost = lost_unfinished = cost = paid_work = paid_work_done = 0.0
    preemptions = resumed = moves = 0
    by_type: dict[str, float] = {"spot": 0.0, "on-demand": 0.0}
    by_gpu: dict[str, float] = {}  # GPU-seconds held per GPU type
    for job_id, logs in result.logs.items():
        losses = attempt_losses(logs, end)
        rec = result.records.get(job_id)
        if rec is None or rec.state != "succeeded":
            lost_unfinished += sum(losses)
        for log, gone in zip(logs, losses, strict=True):
            held = log.gpu_s(end)
            used += held
            paid_work += held * log.speed
            if rec is not None and rec.state == "succeeded":
                paid_work_done += held * log.speed
            lost += gone
            cost += held / 3600.0 * log.price
            by_type[log.capacity_type] = by_type.get(log.capacity_type, 0.0) + held
            by_gpu[log.gpu_type.upper()] = by_gpu.get(log.gpu_type.upper(), 0.0) + held
            if log.cause in PLANNED_CAUSES:
                moves += 1
            elif log.ended_at is not None and not log.succeeded:
                preemptions += 1
            if log.start_step > 0:
                resumed += 1
    recover: list[float] = []  # spot notice -> next attempt dispatched
    ended: list[float] = []  # ... of which: notice -> old attempt ended (checkpoint or deadline)
    mbb = noticed = 0
    for logs in result.logs.values():
        for log, nxt in itertools.pairwise(logs):
            if log.noticed_at is None or log.ended_at is None:
                continue
            noticed += 1
            recover.append(nxt.dispatched_at - log.noticed_at)
            ended.append(log.ended_at - log.noticed_at)
            if nxt.dispatched_at == log.ended_at and log.ended_at < log.noticed_at + 120.0:
                mbb += 1  # the replacement was reserved: it started as the old one ended
    jobs = {j.job_id: j for j in result.jobs}
    done = [r for r in result.records.values() if r.state == "succeeded"]
    useful = sum(jobs[r.job_id].gpus * jobs[r.job_id].duration for r in done)
    machine_lost = sum(a.gpu_seconds_lost for r in result.records.values() for a in r.attempts)
    jct = jct_hours(result)
    # Percentiles count unfinished jobs as never finishing (censored at +inf), so a policy
    # cannot look faster by leaving its slowest jobs out; the mean covers completed jobs.
    jct_all = jct + [math.inf] * (len(result.jobs) - len(jct))
    qd = queue_delays_s(result)
    returned = returns_reclaimed(result)
    # Placements whose GPUs span nodes: the share kept within one zone (every pool, declared
    # topology or not: a pool's zones are its trace parts) and within one block (pools that
    # declare blocks).
    multi = [log for logs in result.logs.values() for log in logs if log.gpu_nodes > 1]
    blocked = [log for log in multi if log.blocks]
    return {
        "policy": result.policy,
        "jobs": len(result.jobs),
        "completed": len(done),
        "unfinished": len(result.jobs) - len(done),
        "never_started": sum(1 for r in result.records.values() if not r.attempts),
        "queue_mean_s": _mean(qd),
        "queue_median_s": _median(qd),
        "queue_p90_s": percentile(qd, 90),
        "jct_mean_h": _mean(jct),
        "jct_median_h": percentile(jct_all, 50),
        "jct_p90_h": percentile(jct_all, 90),
        "jct_p99_h": percentile(jct_all, 99),
        "gpu_h_used": used / 3600.0,
        "gpu_h_spot": by_type.get("spot", 0.0) / 3600.0,
        # T4s run these jobs at a fraction of a V100's pace: the share of GPU-hours they
        # carry shows whether placement prices work or GPU-hours.
        "t4_share": by_gpu.get("T4", 0.0) / used if used > 0 else float("nan"),
        "gpu_h_lost": lost / 3600.0,
        "gpu_h_lost_completed": (lost - lost_unfinished) / 3600.0,
        "gpu_h_lost_unfinished": lost_unfinished / 3600.0,
        "gpu_h_lost_machine": machine_lost / 3600.0,
        "gpu_h_useful": useful / 3600.0,
        # Useful work (V100-GPU-seconds of the jobs that completed) over the work the paid
        # GPU-time could have done at each GPU's speed.
        "goodput": useful / paid_work if paid_work > 0 else float("nan"),
        # The same over the jobs that completed only: what the jobs still running at the
        # horizon (whose paid time counts above, their work not) do not weigh down.
        "goodput_completed": useful / paid_work_done if paid_work_done > 0 else float("nan"),
        "cost_usd": cost,
        "cost_per_useful_gpu_h": cost / (useful / 3600.0) if useful > 0 else float("nan"),
        "preemptions": preemptions,
        "planned_moves": moves,
        "resumed_attempts": resumed,
        "spot_notices": result.spot_notices,
        "noticed_attempts": noticed,
        "recover_median_s": _median(recover),
        "recover_p90_s": percentile(recover, 90),
        "recover_p95_s": percentile(recover, 95),
        "noticed_end_p95_s": percentile(ended, 95),
        "make_before_break": mbb / noticed if noticed else float("nan"),
        "makespan_h": result.end / 3600.0,
        "attempts_max": max((len(r.attempts) for r in result.records.values()), default=0),
        "returns_reclaimed": returned[1] / returned[0] if returned[0] else float("nan"),
        "spot_only_queue_p90_s": percentile(
            [
                r.attempts[0].dispatched_at - r.submitted_at
                for r in result.records.values()
                if r.attempts and r.spec.capacity == "spot"
            ],
            90,
        ),
        "multi_node_placements": len(multi),
        "multi_node_one_zone": _share(sum(1 for log in multi if log.zones == 1), len(multi)),
        "multi_node_in_blocks": len(blocked),
        "multi_node_one_block": _share(sum(1 for log in blocked if log.blocks == 1), len(blocked)),
        "start_timeouts": sum(
            1 for r in result.records.values() for a in r.attempts if a.end_cause == "start-timeout"
        ),
        "violations": len(result.violations),
        "violation_kinds": sorted({v.kind for v in result.violations}),
        "first_violations": [f"{v.at:.1f}s {v.kind}: {v.detail}" for v in result.violations[:5]],
        "invariant_checks": result.checks,
        "batch_errors": len(result.batch_errors),
        "steps": result.steps,
        "wall_s": result.wall_s,
    }


# ------------------------------------------------------------------------------ table
ROWS: tuple[tuple[str, str, str], ...] = (
    ("completed", "jobs completed", "{:.0f}"),
    ("unfinished", "jobs unfinished at horizon", "{:.0f}"),
    ("queue_mean_s", "queueing delay mean (s)", "{:.0f}"),
    ("queue_median_s", "queueing delay median (s)", "{:.0f}"),
    ("queue_p90_s", "queueing delay p90 (s)", "{:.0f}"),
    ("jct_mean_h", "JCT mean, completed jobs (h)", "{:.2f}"),
    ("jct_median_h", "JCT median, all jobs (h)", "{:.2f}"),
    ("jct_p90_h", "JCT p90, all jobs (h)", "{:.2f}"),
    ("jct_p99_h", "JCT p99, all jobs (h; inf = unfinished)", "{:.1f}"),
    ("gpu_h_used", "GPU-hours used", "{:.0f}"),
    ("t4_share", "  T4 share of GPU-hours", "{:.1%}"),
    ("gpu_h_lost", "GPU-hours lost to preemption", "{:.0f}"),
    ("gpu_h_lost_completed", "  of it by jobs that completed", "{:.0f}"),
    ("gpu_h_lost_unfinished", "  of it by jobs still retrying", "{:.0f}"),
    ("gpu_h_lost_machine", "  (broker's own estimate, total)", "{:.0f}"),
    ("goodput", "goodput (useful / used)", "{:.3f}"),
    ("cost_usd", "cost ($, price x GPU-hours)", "{:.0f}"),
    ("cost_per_useful_gpu_h", "cost per useful GPU-hour ($)", "{:.3f}"),
    ("preemptions", "preemptions (attempts lost)", "{:.0f}"),
    ("planned_moves", "moves by choice (spot-return, yield, deadline)", "{:.0f}"),
    ("noticed_attempts", "attempts hit by a spot notice", "{:.0f}"),
    ("recover_median_s", "notice -> next attempt, median (s)", "{:.1f}"),
    ("recover_p90_s", "notice -> next attempt, p90 (s)", "{:.1f}"),
    ("recover_p95_s", "notice -> next attempt, p95 (s)", "{:.1f}"),
    ("noticed_end_p95_s", "  notice -> old attempt ended, p95 (s)", "{:.1f}"),
    ("make_before_break", "  replacement reserved at notice", "{:.0%}"),
    ("spot_notices", "spot notices (whole run)", "{:.0f}"),
    ("multi_node_placements", "multi-node placements", "{:.0f}"),
    ("multi_node_one_zone", "  kept within one zone", "{:.0%}"),
    ("multi_node_one_block", "  kept within one block (pools with blocks)", "{:.0%}"),
    ("spot_only_queue_p90_s", "spot-only jobs: queueing delay p90 (s)", "{:.0f}"),
    ("returns_reclaimed", "spot-returns reclaimed again", "{:.0%}"),
    ("attempts_max", "most attempts of one job", "{:.0f}"),
    ("start_timeouts", "attempts ended by the start timeout", "{:.0f}"),
    ("makespan_h", "makespan (h)", "{:.1f}"),
    ("violations", "invariant violations", "{:.0f}"),
    ("invariant_checks", "invariant checks", "{:.0f}"),
    ("wall_s", "wall time per run (s)", "{:.1f}"),
)


def by_policy(runs: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        out.setdefault(r["policy"], []).append(r)
    return out


def median_summary(runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per-metric median over seeds (violations: the maximum, so one bad seed shows)."""
    out: dict[str, float] = {}
    for key, _, _ in ROWS:
        values = [float(r["summary"][key]) for r in runs]
        out[key] = max(values) if key == "violations" else _median(values)
    return out


def format_table(runs: Sequence[dict[str, Any]]) -> str:
    groups = by_policy(runs)
    names = list(groups)
    seeds = max(len(g) for g in groups.values()) if groups else 0
    cols = {n: median_summary(g) for n, g in groups.items()}
    width = max(len(label) for _, label, _ in ROWS) + 2
    head = "metric".ljust(width) + "".join(n.rjust(12) for n in names)
    lines = [head, "-" * len(head)]
    for key, label, fmt in ROWS:
        cells = []
        for n in names:
            v = cols[n][key]
            text = "-" if math.isnan(v) else ("inf" if math.isinf(v) else fmt.format(v))
            cells.append(text.rjust(12))
        lines.append(label.ljust(width) + "".join(cells))
    if seeds > 1:
        lines.append(f"(medians over {seeds} seeds; violations: worst seed)")
    for n in names:
        for r in groups[n]:
            for text in r["summary"]["first_violations"]:
                lines.append(f"! {n} seed {r['seed']}: {text}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ comparison
def _paired(runs: Sequence[dict[str, Any]], base: str) -> dict[tuple[Any, Any], dict[str, Any]]:
    """The `base` policy's summary per (seed, window): what each run is compared with."""
    return {(r["seed"], r.get("offset")): r["summary"] for r in runs if r["policy"] == base}


def _ratio(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return float("nan")
    return a / b


def comparison(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """Per policy, per metric: one value per (seed, window) run, ratios paired with the
    on-demand-only and checkpoint-restart runs of the same jobs and traces, and each run's cost
    over its own hindsight bound (load/oracle.py)."""
    od = _paired(runs, "on-demand-only")
    cr = _paired(runs, "checkpoint-restart")
    out: dict[str, dict[str, list[float]]] = {}
    for r in runs:
        s = r["summary"]
        key = (r["seed"], r.get("offset"))
        row = out.setdefault(r["policy"], {})

        def put(name: str, value: float, row: dict[str, list[float]] = row) -> None:
            row.setdefault(name, []).append(value)

        put("cost_per_useful", s["cost_per_useful_gpu_h"])
        base = od.get(key)
        if base is not None:
            put(
                "saving_vs_od",
                1.0 - _ratio(s["cost_per_useful_gpu_h"], base["cost_per_useful_gpu_h"]),
            )
            put("jct_p50_vs_od", _ratio(s["jct_median_h"], base["jct_median_h"]))
            put("jct_p90_vs_od", _ratio(s["jct_p90_h"], base["jct_p90_h"]))
        if "bound_cost_per_useful_gpu_h" in s:
            put("bound_cost_per_useful", s["bound_cost_per_useful_gpu_h"])
            put("vs_bound", _ratio(s["cost_per_useful_gpu_h"], s["bound_cost_per_useful_gpu_h"]))
        if "bound_timed_cost_per_useful_gpu_h" in s:
            timed = s["bound_timed_cost_per_useful_gpu_h"]
            put("vs_bound_timed", _ratio(s["cost_per_useful_gpu_h"], timed))
        plain = cr.get(key)
        if plain is not None:
            put("cr_vs_this", _ratio(plain["cost_per_useful_gpu_h"], s["cost_per_useful_gpu_h"]))
        put("goodput", s["goodput"])
        put("goodput_completed", s.get("goodput_completed", float("nan")))
        put("t4_share", s.get("t4_share", float("nan")))
        put("gpu_h_lost", s["gpu_h_lost"])
        put("preemptions", float(s["preemptions"]))
        put("planned_moves", float(s.get("planned_moves", 0)))
        put("unfinished", float(s["unfinished"]))
        put("attempts_max", float(s.get("attempts_max", math.nan)))
    return out


COMPARE_ROWS: tuple[tuple[str, str, str], ...] = (
    ("cost_per_useful", "cost per useful V100-GPU-hour ($)", "{:.3f}"),
    ("saving_vs_od", "saving vs on-demand-only", "{:.1%}"),
    ("bound_cost_per_useful", "hindsight bound: cost per useful V100-h ($)", "{:.3f}"),
    ("vs_bound", "cost ratio to the hindsight bound", "{:.2f}x"),
    ("vs_bound_timed", "  ... to the bound at this run's finish times", "{:.2f}x"),
    ("cr_vs_this", "checkpoint-restart's cost / this", "{:.2f}x"),
    ("jct_p50_vs_od", "JCT p50 vs on-demand-only", "{:.2f}x"),
    ("jct_p90_vs_od", "JCT p90 vs on-demand-only", "{:.2f}x"),
    ("goodput", "goodput (useful / paid GPU-time)", "{:.3f}"),
    ("goodput_completed", "  the same, completed jobs only", "{:.3f}"),
    ("t4_share", "T4 share of GPU-hours", "{:.1%}"),
    ("gpu_h_lost", "GPU-hours lost", "{:.0f}"),
    ("preemptions", "preemptions", "{:.0f}"),
    ("planned_moves", "moves by choice", "{:.0f}"),
    ("unfinished", "jobs unfinished", "{:.0f}"),
    ("attempts_max", "most attempts of one job", "{:.0f}"),
)


def _cell(values: Sequence[float], fmt: str) -> str:
    """Median, and [min, max] over runs when there are several."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return "-"

    def f(v: float) -> str:
        return "inf" if math.isinf(v) else fmt.format(v)

    med = f(_median(vals))
    if len(vals) == 1:
        return med
    return f"{med} [{f(min(vals))}, {f(max(vals))}]"


def format_comparison(runs: Sequence[dict[str, Any]]) -> str:
    """The baselines side by side: medians and [min, max] over seeds and trace windows."""
    table = comparison(runs)
    names = list(table)
    cells = {n: [_cell(table[n].get(k, []), fmt) for k, _, fmt in COMPARE_ROWS] for n in names}
    width = max(len(label) for _, label, _ in COMPARE_ROWS) + 2
    colw = max([len(n) for n in names] + [len(c) for cs in cells.values() for c in cs]) + 2
    head = "metric".ljust(width) + "".join(n.rjust(colw) for n in names)
    lines = [head, "-" * len(head)]
    for i, (_, label, _) in enumerate(COMPARE_ROWS):
        lines.append(label.ljust(width) + "".join(cells[n][i].rjust(colw) for n in names))
    runs_per = max((len(v.get("cost_per_useful", [])) for v in table.values()), default=0)
    lines.append(f"(median [min, max] over {runs_per} run(s): seeds x trace windows)")
    return "\n".join(lines)


def plot_comparison(runs: Sequence[dict[str, Any]], out: Path) -> Path:
    """Cost per useful work and JCT ratios per policy, with the spread over runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    table = comparison(runs)
    names = list(table)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, key, title in (
        (axes[0], "cost_per_useful", "cost per useful V100-GPU-hour ($)"),
        (axes[1], "goodput", "goodput (useful / paid)"),
        (axes[2], "jct_p50_vs_od", "JCT p50 / on-demand-only"),
    ):
        meds, lo, hi = [], [], []
        for n in names:
            vals = [v for v in table[n].get(key, []) if math.isfinite(v)]
            m = _median(vals) if vals else float("nan")
            meds.append(m)
            lo.append(m - min(vals) if vals else 0.0)
            hi.append(max(vals) - m if vals else 0.0)
        x = range(len(names))
        colors = [COLORS.get(n, "#777777") for n in names]
        ax.bar(x, meds, color=colors, yerr=[lo, hi], capsize=3)
        ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("baselines on the same jobs and spot traces (bars: median; whiskers: min-max)")
    fig.tight_layout()
    path = _save(fig, out / "sim_baselines.png")
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------ plots
COLORS = {
    "muster": "#1f77b4",
    "scratch": "#d62728",
    "spot-only": "#ff7f0e",
    "fallback": "#2ca02c",
    "on-demand-only": "#7f7f7f",
    "checkpoint-restart": "#9467bd",
    "skypilot-like": "#8c564b",
    "foresight": "#17becf",
}


def plot_all(runs: Sequence[dict[str, Any]], out: Path) -> list[Path]:
    """CDFs of JCT and queueing delay, GPU-hours and cost, utilisation over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    groups = by_policy(runs)
    first = {n: min(g, key=lambda r: r["seed"]) for n, g in groups.items()}
    paths: list[Path] = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for n, r in first.items():
        for ax, key, low in ((axes[0], "jct_h", 1e-3), (axes[1], "queue_s", 1.0)):
            xs = sorted(max(v, low) for v in r["series"][key])
            if not xs:
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=n, color=COLORS.get(n), lw=1.6)
    axes[0].set(xscale="log", xlabel="job completion time (h, log)", ylabel="fraction of jobs")
    seed = min(r["seed"] for r in runs) if runs else 0
    axes[0].set_title(f"JCT CDF (completed jobs, seed {seed})")
    axes[1].set(
        xscale="log", xlabel="queueing delay (s, log; <= 1 s drawn at 1 s)", ylabel="fraction"
    )
    axes[1].set_title(f"Queueing delay CDF (submit to first dispatch, seed {seed})")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right")
    fig.tight_layout()
    paths.append(_save(fig, out / "sim_jct_cdf.png"))
    plt.close(fig)

    names = list(groups)
    meds = {n: median_summary(g) for n, g in groups.items()}
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    seeds = max(len(g) for g in groups.values()) if groups else 0
    if seeds > 1:
        fig.suptitle(f"medians over {seeds} seeds", fontsize=9)
    x = range(len(names))
    used = [meds[n]["gpu_h_used"] for n in names]
    lost = [meds[n]["gpu_h_lost"] for n in names]
    colors = [COLORS.get(n, "#777777") for n in names]
    axes[0].bar(x, used, color=colors, alpha=0.35, label="used")
    axes[0].bar(x, lost, color=colors, label="lost to preemption")
    axes[0].set_title("GPU-hours used / lost to preemption")
    axes[1].bar(x, [meds[n]["goodput"] for n in names], color=colors)
    axes[1].set_ylim(0, 1)
    axes[1].set_title("goodput (useful / used GPU-h)")
    axes[2].bar(x, [meds[n]["cost_usd"] for n in names], color=colors)
    axes[2].set_title("cost ($)")
    for ax in axes:
        ax.set_xticks(list(x), names)
        ax.grid(True, axis="y", alpha=0.3)
    for i, v in enumerate(lost):
        axes[0].annotate(f"{v:.0f}", (i, v), ha="center", va="bottom", fontsize=9)
    axes[0].legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    paths.append(_save(fig, out / "sim_gpu_hours.png"))
    plt.close(fig)

    fig, axes = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    # Stop the time axis once 99% of the jobs of every policy that gets there have finished:
    # a few never-finishing jobs would otherwise stretch it over days of idle replay.
    t99 = [_p99_finish(r) for r in first.values()]
    finite = [t for t in t99 if math.isfinite(t)]
    xmax = 1.15 * max(finite) if finite else None
    drawn_capacity = False
    for n, r in first.items():
        s = r["series"]["samples"]
        if not s:
            continue
        t = [row[0] for row in s]
        if not drawn_capacity:
            axes[0].plot(t, [row[1] for row in s], color="black", lw=1, label="capacity (GPUs up)")
            axes[0].plot(
                t, [row[4] for row in s], color="gray", lw=1, ls="--", label="spot capacity"
            )
            drawn_capacity = True
        axes[0].plot(t, [row[2] for row in s], color=COLORS.get(n), lw=1.2, label=f"{n}: held")
        axes[1].plot(t, [row[5] for row in s], color=COLORS.get(n), lw=1.2, label=n)
    axes[0].set(ylabel="GPUs")
    seed = min(r["seed"] for r in runs) if runs else 0
    axes[0].set_title(f"GPUs held by gangs vs. capacity (spot nodes come and go; seed {seed})")
    axes[1].set(xlabel="virtual time (h)", ylabel="queued jobs")
    if xmax is not None:
        axes[1].set_xlim(0, xmax)
    axes[1].set_title("Queue length")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    paths.append(_save(fig, out / "sim_utilisation.png"))
    plt.close(fig)
    return paths


def _p99_finish(run: dict[str, Any]) -> float:
    """Virtual hour by which 99% of the run's jobs had finished (inf if they never did)."""
    finish = run["series"].get("finish_h", [])
    need = math.ceil(0.99 * run["summary"]["jobs"])
    return finish[need - 1] if 0 < need <= len(finish) else math.inf


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    return path
