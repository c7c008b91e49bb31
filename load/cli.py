"""`muster bench <name>`: the benchmarks of load/ as one lazily loaded group.

Each benchmark declares its options once, as the typer command `app` of its module, which its
`python -m load.<module>` form (the docs and the Makefile use it) also runs: `muster bench e2e
--runs 3` and `python -m load.bench_e2e --runs 3` parse and run the same command. Its module is
imported only when the command runs or its own help is asked for: `muster bench --help` lists
them from the table below. The other load programs (`muster sim`, ...) are listed in
muster/cli.py the same way.
"""

from __future__ import annotations

from shell.cli import LazyGroup


class Benchmarks(LazyGroup):
    # name -> (module.app, summary); the summary fits an 80-column `muster bench --help` uncut.
    lazy_subcommands = {
        name: (f"load.{module}.app", summary)
        for name, module, summary in (
            ("core", "bench_core", "Placement decisions/s, 100,000 pending jobs (pure core)."),
            ("cycle", "bench_cycle", "Admission cycle after a capacity change, by queue depth."),
            ("e2e", "bench_e2e", "Submit -> dispatch acked over NATS: admissions/s, latency."),
            ("flood", "bench_flood", "Another queue's submission latency while one queue floods."),
            ("flood-cycle", "bench_flood_cycle", "Admission cycle CPU while submissions flood in."),
            ("ingest", "bench_ingest", "Agent events/s applied by the broker."),
            ("ingest-core", "bench_ingest_core", "CPU an agent event costs the core alone."),
            ("kube-agent", "bench_kube_agent", "The kube agent at 5,000 nodes x 150,000 pods."),
            ("logs", "bench_logs", "CPU a broker log line costs at info, and structlog's stock."),
            ("memory", "bench_memory", "Broker bytes per pending job and its top allocators."),
            ("nats-client", "bench_nats_client", "CPU a NATS message costs a Python client."),
            (
                "nats-failover",
                "bench_nats_failover",
                "Serving again after kill -9 of each NATS leader.",
            ),
            ("restore", "bench_restore", "Restore of 100,000 records in process: CPU-s."),
            ("scale", "bench_scale", "Broker RSS with 100,000 pending; kill -9 and recovery time."),
            ("spot", "bench_spot", "Spot notice -> new attempt acked elsewhere, p50/p99."),
            ("ui", "bench_ui", "Dashboard page loads with 100,000 jobs in the broker."),
            (
                "reclaim-storm",
                "reclaim_storm",
                "Reclaim with team queues: how often one job is evicted.",
            ),
        )
    }


bench = Benchmarks(
    name="bench",
    help="Benchmarks (docs/benchmarks.md); each prints a RESULT line of JSON.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
