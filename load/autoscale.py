"""Autoscaled pools in the simulator: warm pools, scale from zero, and scale from zero with
stockouts (drawn, or from a public availability trace), on one scenario
(load/scenarios/autoscale.yaml), with queueing delay and cost.

    python -m load.autoscale [--jobs 1000] [--seeds 2] [--stockout-p 0.3] [--json out.json]
    muster autoscale ...   (the same command)

- warm: every autoscaled pool keeps its limit up all the time (no waiting, idle capacity paid);
- zero: pools start empty and grow when the broker asks (docs/operations.md, "Autoscaled
  pools"); nodes that stay empty `idle_s` go again;
- stockouts: as zero, but each ask gets no node with probability `--stockout-p`;
- trace: as zero, but each spot pool gets at most what one of SkyPilot's 16-node V100
  availability traces grants at the moment of the ask (`AVAILABILITY`, one per pool, looped),
  and nothing while it grants none.

Two costs: what the jobs' own GPU-hours cost (price x GPU-hours held), and what every node
present cost, idle or not (the bill of the fleet). Runs use the Muster policy.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from load.command import Count, JsonOut, program, summary
from load.report import summarize
from load.scenario import apply_scenario, load_scenario
from load.sim import run
from load.sim.cli import GOLDEN
from load.simconfig import SimConfig

SCENARIO = Path(__file__).with_name("scenarios") / "autoscale.yaml"
VARIANTS = ("warm", "zero", "stockouts", "trace")
# Three AWS zones' spot availability from 2023-08-27 ("Can't Be Late", NSDI'24;
# data/traces/README.md), handed to the autoscaled spot pools in order.
AVAILABILITY = tuple(
    f"spot-traces/availability/16-node/aws-08-27-2023/{zone}_v100_1.json"
    for zone in ("us-east-2b", "us-west-2a", "us-west-2c")
)
COLUMNS = (
    ("queue_median_s", "queue median (s)", "{:.0f}"),
    ("queue_p90_s", "queue p90 (s)", "{:.0f}"),
    ("jct_median_h", "JCT median (h)", "{:.2f}"),
    ("completed", "completed", "{:.0f}"),
    ("cost_usd", "job cost ($)", "{:.0f}"),
    ("capacity_cost_usd", "fleet cost ($)", "{:.0f}"),
    ("provision_asks", "asks", "{:.0f}"),
    ("provisioned", "nodes added", "{:.0f}"),
    ("stockouts", "stockouts", "{:.0f}"),
    ("violations", "violations", "{:.0f}"),
)


def variant(cfg: SimConfig, name: str, stockout_p: float) -> SimConfig:
    """The scenario's fleet as `name` runs it."""
    pools = []
    zones = iter(AVAILABILITY)
    for p in cfg.pools:
        a = p.autoscale
        if a is not None:
            if name == "warm":
                p = replace(p, nodes=a.max_nodes, autoscale=replace(a, stockout_p=0.0))
            elif name == "zero":
                p = replace(p, autoscale=replace(a, stockout_p=0.0))
            elif name == "trace":
                trace = next(zones, None) if p.capacity_type == "spot" else None
                p = replace(p, autoscale=replace(a, stockout_p=0.0, trace=trace))
            else:
                p = replace(p, autoscale=replace(a, stockout_p=stockout_p))
        pools.append(p)
    return replace(cfg, pools=tuple(pools))


def one(args: tuple[SimConfig, str]) -> dict[str, Any]:
    cfg, name = args
    result = run(cfg, "muster")
    row = summarize(result)
    row.update(
        variant=name,
        seed=cfg.seed,
        capacity_cost_usd=result.capacity_cost_usd,
        provision_asks=result.provision_asks,
        provisioned=result.provisioned,
        stockouts=result.stockouts,
        violations=len(result.violations),
    )
    return row


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Medians over seeds, one line per variant; every run in the JSON."""
    head = "| variant | " + " | ".join(label for _, label, _ in COLUMNS) + " |"
    out = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for name in VARIANTS:
        mine = [r for r in rows if r["variant"] == name]
        if not mine:
            continue
        cells = [fmt.format(statistics.median(r[key] for r in mine)) for key, _, fmt in COLUMNS]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def every_run(rows: Sequence[dict[str, Any]]) -> str:
    """Each run's queueing delay, costs, asks, stockouts and completions."""
    out = [
        "| seed | variant | queue p90 (s) | job cost ($) | fleet cost ($) | asks | stockouts "
        "| completed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["seed"], VARIANTS.index(r["variant"]))):
        out.append(
            f"| {r['seed']} | {r['variant']} | {r['queue_p90_s']:.0f} | {r['cost_usd']:.0f} "
            f"| {r['capacity_cost_usd']:.0f} | {r['provision_asks']} | {r['stockouts']} "
            f"| {r['completed']} |"
        )
    return "\n".join(out)


app = program()


@app.command(help=summary(__doc__))
def autoscale(
    jobs: Count = 1000,
    seed: int = 1,
    seeds: Count = 1,
    stockout_p: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="chance that an ask gets no node")
    ] = 0.3,
    scenario: Annotated[
        str,
        typer.Option(
            help="the fleet (a scenario file; default: the shipped load/scenarios/autoscale.yaml)",
            show_default=False,
        ),
    ] = str(SCENARIO),
    workers: Count = 2,
    json_out: JsonOut = None,
) -> None:
    rows = compare(jobs, seed, seeds, stockout_p, scenario, workers)
    print(table(rows))
    print()
    print(every_run(rows))
    if json_out:
        Path(json_out).write_text(json.dumps(rows, indent=1, default=str))
    if any(r["violations"] for r in rows):
        raise typer.Exit(1)


def compare(
    jobs: int, seed: int, seeds: int, stockout_p: float, scenario: str, workers: int
) -> list[dict[str, Any]]:
    """Every variant for every seed, as rows (`one`)."""
    fleet = load_scenario(scenario)
    runs = []
    for s in range(seed, seed + seeds):
        # each further seed starts the availability traces elsewhere (as `python -m load.sim`)
        phase = ((s - seed) * GOLDEN) % 1.0
        cfg = SimConfig(jobs=jobs, seed=s, spot="none", trace_phase_frac=phase)
        base = apply_scenario(cfg, fleet)
        runs += [(variant(base, name, stockout_p), name) for name in VARIANTS]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, runs))


if __name__ == "__main__":
    app(prog_name="python -m load.autoscale")
