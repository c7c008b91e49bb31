"""CPU a broker log line costs at `info`: the line the broker writes when a job is dispatched.

    python -m load.bench_logs [--lines 30000] [--runs 5] [--json out.json]

Each run writes `lines` copies of the broker's `job dispatched` line (job, cluster, attempt,
flavor, step) to a file in a temporary directory, twice, alternately: once as `muster broker`
configures its logs (`shell.logs.configure_logging("info", "json")`), and once with structlog's
stock stamper and JSON renderer in their place (`TimeStamper`, `JSONRenderer`: what
`shell/logs.py` used before), the baseline of the same run. Each is timed by this process's
CPU time per line. The broker writes about three such lines a job at `info` (docs/operations.md
"Logs"). Prints every run and one `RESULT {...}` line.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import structlog

from load.command import Count, JsonOut, Options, program, summary
from load.common import emit
from shell.logs import configure_logging


def stock_processors() -> list[Any]:
    """The processors of `configure_logging`'s JSON lines with structlog's own stamper and
    renderer in place of `shell.logs`'s."""
    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.StackInfoRenderer(),
        structlog.dev.set_exc_info,
        structlog.processors.TimeStamper(fmt="%Y-%m-%dT%H:%M:%S.%fZ", utc=True),
        structlog.processors.dict_tracebacks,
        structlog.processors.JSONRenderer(),
    ]


@contextlib.contextmanager
def stderr_to(path: Path) -> Iterator[TextIO]:
    """This process's stderr, where the log lines go, sent to a file meanwhile."""
    saved = sys.stderr
    with path.open("w") as f:
        sys.stderr = f
        try:
            yield f
        finally:
            sys.stderr = saved


def time_lines(lines: int, stock: bool, path: Path) -> float:
    """CPU µs per `job dispatched` line, as the broker logs it (or with the stock pieces)."""
    configure_logging("info", "json")
    if stock:
        structlog.configure(processors=stock_processors())
    log = structlog.get_logger("muster.broker")
    with stderr_to(path):
        c0 = time.process_time()
        for i in range(lines):
            log.info(
                "job dispatched",
                job_id=f"job-{i}",
                cluster="c-7",
                attempt=1,
                flavor="c-7-spot",
                resume_from_step=None,
            )
        cpu = time.process_time() - c0
    structlog.reset_defaults()
    return cpu / lines * 1e6


app = program()


@app.command(help=summary(__doc__))
def bench_logs(lines: Count = 30_000, runs: Count = 5, json_out: JsonOut = None) -> None:
    run_bench(Options(lines=lines, runs=runs, json=json_out))


def run_bench(args: Options) -> dict[str, Any]:
    print(f"log bench: {args.lines:,} lines of `job dispatched` a run, {args.runs} runs")
    ours: list[float] = []
    stock: list[float] = []
    with tempfile.TemporaryDirectory(prefix="muster-logs-") as tmp:
        path = Path(tmp) / "broker.log"
        for run in range(args.runs):
            order = (False, True) if run % 2 == 0 else (True, False)
            for is_stock in order:
                us = time_lines(args.lines, is_stock, path)
                (stock if is_stock else ours).append(round(us, 2))
            print(f"run {run + 1}: {ours[-1]:.1f} µs a line (structlog's stock {stock[-1]:.1f})")
    result: dict[str, Any] = {
        "bench": "logs",
        "lines": args.lines,
        "cpu_us_per_line_median": round(statistics.median(ours), 2),
        "cpu_us_per_line": ours,
        "stock_cpu_us_per_line_median": round(statistics.median(stock), 2),
        "stock_cpu_us_per_line": stock,
    }
    print(
        f"median: {result['cpu_us_per_line_median']} µs of CPU a line; structlog's stock "
        f"stamper and renderer, same runs: {result['stock_cpu_us_per_line_median']} µs"
    )
    emit(result, args.json)
    return result


if __name__ == "__main__":
    app(prog_name="python -m load.bench_logs")
