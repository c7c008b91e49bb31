"""`python -m load.sim` / `muster sim`: options to configs, runs (in worker processes), the
tables, plots and JSON."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from load import traces
from load.command import Options, program
from load.command import run as run_command
from load.sim.jobs import (
    load_philly,
)
from load.sim.policies import (
    ABLATIONS,
    COMPARISON,
    EXTENSIONS,
    POLICIES,
)
from load.sim.results import (
    _finite,
    _run_summary,
)
from load.simconfig import (
    SimConfig,
)

GOLDEN = (5**0.5 - 1) / 2  # successive multiples mod 1 spread evenly over [0, 1)

_DEFAULTS = SimConfig()


class _Spot(StrEnum):
    """`--spot`: where the reclaims come from."""

    trace = "trace"
    poisson = "poisson"
    none = "none"


app = program()


@app.command(
    help="Replay Philly jobs and Bamboo spot reclaims through the Muster core under a virtual "
    "clock and compare recovery policies."
)
def sim(
    jobs: Annotated[int, typer.Option(min=1)] = 3000,
    offset: Annotated[int, typer.Option(min=0, help="first Philly row")] = _DEFAULTS.offset,
    compress: Annotated[float, typer.Option(min=0.0)] = _DEFAULTS.compress,
    max_duration_h: Annotated[float, typer.Option(min=0.0)] = _DEFAULTS.max_duration_s / 3600,
    drain_h: Annotated[
        float,
        typer.Option(min=0.0, help="stop this long after the last arrival even if jobs are left"),
    ] = _DEFAULTS.drain_s / 3600,
    policy: Annotated[
        str,
        typer.Option(
            help="a policy, a comma-separated list, both (muster+scratch), all, or compare "
            "(the baselines side by side: " + ", ".join(COMPARISON) + ", with the ablations "
            "and elastic)"
        ),
    ] = "both",
    windows: Annotated[
        int,
        typer.Option(
            help="also replay this many further Philly windows (each WINDOW_STRIDE rows later)"
        ),
    ] = 1,
    spot: _Spot = _Spot.trace,
    poisson_rate: Annotated[float, typer.Option(min=0.0)] = _DEFAULTS.poisson_rate,
    scale: Annotated[float, typer.Option(min=0.0, help="multiply every pool's node count")] = 1.0,
    seed: int = 1,
    seeds: Annotated[int, typer.Option(help="run seeds seed..seed+n-1, medians")] = 1,
    workers: Annotated[int, typer.Option(min=1, help="processes (one run each)")] = 2,
    out: Annotated[str, typer.Option(help="folder for PNGs ('' = no plots)")] = "docs/img",
    json_out: Annotated[str | None, typer.Option("--json", help="write the summaries here")] = None,
    scenario: Annotated[
        str | None,
        typer.Option(
            help="YAML file with the pools, spot traces, GPU speeds and checkpoint costs "
            "(see load/scenarios/)"
        ),
    ] = None,
    traces_dir: Annotated[
        str | None,
        typer.Option(help="folder holding philly.csv and the bamboo-*.csv spot traces"),
    ] = None,
    gpu_speeds: Annotated[
        str | None,
        typer.Option(
            help="the world's training speed per GPU type relative to a V100, e.g. "
            "'A100=1.3,T4=0.6' (types not named keep the scenario's or built-in speed)"
        ),
    ] = None,
    prior_speeds: Annotated[
        str | None,
        typer.Option(
            help="the broker's prior speed per GPU type (scheduling.gpu_speeds), e.g. "
            "'V100=1,A100=1,T4=1'; default: the broker's defaults"
        ),
    ] = None,
    learn_speeds: Annotated[
        bool,
        typer.Option(
            help="let the broker learn each job's speeds from its step rates (--no-learn-speeds:"
            " every job declares the prior, so placement uses the prior alone)"
        ),
    ] = True,
    breakdown: Annotated[
        bool,
        typer.Option(
            help="also print where each run's cost and time went: paid per pool, what the "
            "GPU-time did, lost work, first-dispatch waits, the job with most attempts"
        ),
    ] = False,
    reasons: Annotated[
        bool,
        typer.Option(
            help="also print how often each wait reason fired per policy (spot-held, "
            "insufficient-capacity, ...) and how often the spot-kept rule turned a job away"
        ),
    ] = False,
    progress: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="print a progress line to stderr every this many wall seconds (0 = never)",
        ),
    ] = 15.0,
) -> None:
    options = {k: v for k, v in locals().items() if k not in ("json_out", "spot")}
    raise typer.Exit(_run(Options(**options, json=json_out, spot=spot.value)))


WINDOW_STRIDE = 7919  # Philly rows between the windows of `--windows`


def config_from_args(args: Options, seed: int, window: int = 0) -> SimConfig:
    pools = tuple(replace(p, nodes=max(1, round(p.nodes * args.scale))) for p in _DEFAULTS.pools)
    cfg = SimConfig(
        jobs=args.jobs,
        offset=(args.offset + window * WINDOW_STRIDE) % 82_247,
        compress=args.compress,
        max_duration_s=args.max_duration_h * 3600.0,
        drain_s=args.drain_h * 3600.0,
        seed=seed,
        # Each further seed also replays the spot traces from another point, spread over the
        # whole of each trace (golden-ratio steps), not only its first hours.
        trace_phase_frac=((seed - args.seed) * GOLDEN) % 1.0,
        pools=pools,
        spot=args.spot,
        poisson_rate=args.poisson_rate,
        progress_s=args.progress,
    )
    if args.traces_dir:
        folder = Path(args.traces_dir)
        cfg = replace(cfg, philly=folder / "philly.csv", traces=folder)
    if args.scenario:
        from load.scenario import apply_scenario, load_scenario

        cfg = apply_scenario(cfg, load_scenario(args.scenario))
        scaled = (
            replace(p, nodes=max(0 if p.autoscale else 1, round(p.nodes * args.scale)))
            for p in cfg.pools
        )
        cfg = replace(cfg, pools=tuple(scaled))
    # Callers that build their own options may leave out the speed options.
    gpu_speeds, prior_speeds = (
        getattr(args, "gpu_speeds", None),
        getattr(args, "prior_speeds", None),
    )
    if gpu_speeds:
        world = {t.lower(): (t, v) for t, v in cfg.gpu_speed}
        for t, v in parse_speeds(gpu_speeds, "--gpu-speeds"):
            world[t.lower()] = (world.get(t.lower(), (t, v))[0], v)
        cfg = replace(cfg, gpu_speed=tuple(world.values()))
    if prior_speeds:
        cfg = replace(cfg, prior_speed=parse_speeds(prior_speeds, "--prior-speeds"))
    return replace(cfg, learn_speeds=getattr(args, "learn_speeds", True))


def parse_speeds(text: str, option: str) -> tuple[tuple[str, float], ...]:
    """'A100=2.2,T4=0.3' as (type, speed) pairs; a malformed one is a ValueError that
    names the option and the expected form."""
    out: list[tuple[str, float]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            speed = float(value) if sep and name.strip() else -1.0
        except ValueError:
            speed = -1.0
        if not speed > 0 or speed == float("inf"):
            raise ValueError(
                f"{option}: {part!r} is not TYPE=SPEED with a speed > 0; write e.g. "
                f"{option} 'A100=2.2,T4=0.3'"
            )
        out.append((name.strip(), speed))
    return tuple(out)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m load.sim ARGS` as a function: its exit status."""
    return run_command(app, sys.argv[1:] if argv is None else argv, "python -m load.sim")


def _run(args: Options) -> int:
    from load import report

    if args.policy == "both":
        names = ["muster", "scratch"]
    elif args.policy == "all":
        names = list(POLICIES)
    elif args.policy == "compare":
        names = [*COMPARISON, *ABLATIONS, *EXTENSIONS]
    else:
        names = [n.strip() for n in args.policy.split(",")]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        print(f"unknown policy {unknown}; choose from {sorted(POLICIES)}", file=sys.stderr)
        return 2
    seeds = list(range(args.seed, args.seed + max(1, args.seeds)))
    if args.scenario or args.gpu_speeds or args.prior_speeds:
        try:
            config_from_args(args, args.seed)
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
    windows = range(max(1, args.windows))
    tasks = [(config_from_args(args, s, w), n) for s in seeds for w in windows for n in names]
    cfg0 = tasks[0][0]
    try:  # one clear line, not a traceback from a worker, when a trace is not there
        traces.require_trace(cfg0.philly.name, cfg0.philly.parent)
    except traces.MissingTraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    if args.workers > 1 and len(tasks) > 1:
        from concurrent.futures import ProcessPoolExecutor

        load_philly(tasks[0][0].philly)  # parse once before forking
        with ProcessPoolExecutor(max_workers=min(args.workers, len(tasks))) as pool:
            outputs = list(pool.map(_run_summary, tasks))
    else:
        outputs = [_run_summary(t) for t in tasks]
    runs = [
        {"policy": n, "seed": cfg.seed, "offset": cfg.offset, **out}
        for (cfg, n), out in zip(tasks, outputs, strict=True)
    ]
    print(report.format_table(runs))
    if {"on-demand-only", "checkpoint-restart"} & set(names):
        print()
        print(report.format_comparison(runs))
    if args.breakdown:
        from load.sim.breakdown import format_breakdown, jct_gap

        base = {(r["seed"], r["offset"]): r for r in runs if r["policy"] == "on-demand-only"}
        for r in runs:
            parts, share = r["breakdown"]
            head = f"\n{r['policy']} seed {r['seed']} row {r['offset']:,}"
            print(format_breakdown(parts, head, share))
            od = base.get((r["seed"], r["offset"]))
            if od is not None and od is not r:
                print(jct_gap(parts, od["breakdown"][0]))
    if args.reasons:
        from load.sim.reasons import format_reasons

        print()
        print(format_reasons(runs))
    print(f"\n{len(tasks)} run(s) in {time.perf_counter() - started:.1f}s wall")
    if args.out:
        for path in report.plot_all(runs, Path(args.out)):
            print(f"wrote {path}")
        if {"on-demand-only", "checkpoint-restart"} & set(names):
            print(f"wrote {report.plot_comparison(runs, Path(args.out))}")
    if args.json:
        kept = [{k: v for k, v in r.items() if k != "breakdown"} for r in runs]
        Path(args.json).write_text(json.dumps({"runs": _finite(kept)}, indent=1, default=str))
        print(f"wrote {args.json}")
    bad = sum(r["summary"]["violations"] for r in runs)
    return 1 if bad else 0
