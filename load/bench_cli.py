"""Start-up time of the `muster` command (`muster --help`, a command's own `--help`, `muster
config FILE`, which parses its options and runs) and of a
broker process's imports (`import broker.service, broker.cli_operator` with aiohttp deferred,
what `muster broker` loads before it connects). Bytecode is cached, in a directory of the
benchmark's own, as an installed `muster` has it.

    python -m load.bench_cli [--runs 5] [--baseline DIR] [--json out.json]

Each run starts a fresh `python -m muster ...` or `python -c "import ..."` (this interpreter,
cwd = the tree)
and measures its wall time to exit, and with `-X importtime` the modules it imported. With
`--baseline DIR` (another checkout of the repository, e.g. `git worktree add` or `git
archive | tar -x` of an older commit) the same commands run there too, interleaved run by run,
so both see the same machine load. Prints every run, the medians, and one `RESULT {...}` line.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from load.command import Baseline, Count, JsonOut, Options, program, summary, trees
from load.common import bytecode_cached, emit

REPO = Path(__file__).resolve().parents[1]
HELP = ["-m", "muster", "--help"]
COMMANDS = {
    "help": HELP,
    "status-help": ["-m", "muster", "status", "--help"],
    # A command that converts its options' values (a path, a choice) and runs.
    "config": ["-m", "muster", "config", "examples/broker.yaml", "--output", "json"],
    # As `muster broker` imports them: aiohttp deferred first (shell/lazyimport.py).
    "broker-import": [
        "-c",
        "from shell.lazyimport import defer_unused; defer_unused(); "
        "import broker.service, broker.cli_operator",
    ],
}
# Imports `muster --help` should never pay for.
HEAVY = ("broker.service", "broker.client", "nats", "aiohttp", "torch", "kubernetes_asyncio")


def one_start(tree: Path, args: list[str]) -> float:
    """Wall seconds of one `python ARGS` in `tree`."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], cwd=tree, capture_output=True, timeout=120)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"python {' '.join(args)} in {tree} failed: {proc.stderr.decode()}")
    return elapsed


def imported(tree: Path, args: list[str]) -> list[str]:
    """The modules `python ARGS` imported, from `-X importtime`."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *args],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return [
        line.rsplit("|", 1)[1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and "|" in line and "cumulative" not in line
    ]


app = program()


@app.command(help=summary(__doc__))
def bench_cli(
    runs: Count = 5,
    baseline: Baseline = None,
    json_out: JsonOut = None,
) -> None:
    run_bench(Options(runs=runs, baseline=baseline, json=json_out))


def run_bench(args: Options) -> dict[str, Any]:
    with bytecode_cached(True):  # as an installed `muster` has it, whatever this shell sets
        return _measure(args)


def _measure(args: Options) -> dict[str, Any]:
    checkouts = trees(REPO, args.baseline)
    times: dict[str, dict[str, list[float]]] = {t: {c: [] for c in COMMANDS} for t in checkouts}
    for tree in checkouts.values():  # warm the file cache and the .pyc files once, untimed
        for argv in COMMANDS.values():
            one_start(tree, argv)
    for r in range(args.runs):
        for name, argv in COMMANDS.items():
            for label, tree in checkouts.items():
                times[label][name].append(one_start(tree, argv))
        print(
            f"run {r + 1}: "
            + ", ".join(
                f"{label} {name} {times[label][name][-1] * 1000:.0f} ms"
                for name in COMMANDS
                for label in checkouts
            )
        )
    result: dict[str, Any] = {"bench": "cli", "runs": args.runs}
    for label, tree in checkouts.items():
        modules = imported(tree, HELP)
        result[label] = {
            **{f"{name}_median_s": statistics.median(ts) for name, ts in times[label].items()},
            **{f"{name}_runs_s": [round(t, 4) for t in ts] for name, ts in times[label].items()},
            "help_modules": len(modules),
            "help_heavy_imports": sorted(m for m in modules if m.startswith(HEAVY)),
        }
        print(
            f"{label}: muster --help median {result[label]['help_median_s'] * 1000:.0f} ms, "
            f"broker imports {result[label]['broker-import_median_s'] * 1000:.0f} ms, "
            f"{len(modules)} modules imported, heavy: {result[label]['help_heavy_imports'][:5]}"
        )
    emit(result, args.json)
    return result


if __name__ == "__main__":
    app()
