"""The end-to-end benchmarks run at toy sizes: they complete, every job gets through, and the
numbers they print are sane. Nothing here asserts speed (see docs/benchmarks.md for that)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_bench(
    module: str, *args: str, timeout: float = 30.0, stderr: list[str] | None = None
) -> dict[str, Any]:
    """`python -m <module> ...` in a child process (the benchmarks tune their process's GC),
    and its machine-readable RESULT line; its stderr (where its brokers log) is appended to
    `stderr` when given."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if stderr is not None:
        stderr.append(proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])  # type: ignore[no-any-return]


def finite_positive(x: float) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_bench_e2e_tiny() -> None:
    """At a toy size, with the broker logging at a deployment's level (info): a line for
    each job's dispatch on the benchmark's stderr. Beside a CPU burner, gone after the run."""
    logs: list[str] = []
    r = run_bench(
        "load.bench_e2e",
        *("--clusters", "3", "--nodes", "40", "--jobs", "200", "--latency-jobs", "100"),
        *("--rate", "500", "--runs", "1", "--settle-s", "0.2", "--baseline-msgs", "5000"),
        *("--broker-log-level", "info", "--burners", "1"),
        stderr=logs,
    )
    (burner,) = r["burner_pids"]
    assert not Path(f"/proc/{burner}").exists(), "the burner outlived the benchmark"
    dispatched = {
        line["job_id"]
        for line in map(json.loads, (t for t in logs[0].splitlines() if t.startswith("{")))
        if line.get("event") == "job dispatched" and line.get("level") == "info"
    }
    assert len(dispatched) == 300, len(dispatched)
    assert r["all_dispatched"] is True
    assert finite_positive(r["admissions_per_s_median"])
    assert finite_positive(r["raw_nats_msgs_per_s"])
    assert 0 < r["latency_p50_ms_median"] <= r["latency_p99_ms_median"]
    assert r["latency_p99_ms_median"] <= r["latency_max_ms_median"] < 30_000
    for figure in ("broker_cpu_ms_per_job_burst_median", "broker_cpu_ms_per_job_paced_median"):
        assert 0 <= r[figure] < 1_000, figure  # the broker's CPU seconds per job, in ms
    # job-bucket writes per job, read from the server: at least the dispatch's
    assert all(x >= 1 and finite_positive(x) for x in r["kv_puts_per_job"]), r["kv_puts_per_job"]


def test_bench_e2e_with_a_core_of_the_brokers_own(tmp_path: Path) -> None:
    """`--cpus broker-own-core`: the broker runs on a core no other process of the run uses,
    and each process's wait for a core is measured (Linux schedstat)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing to give the broker alone")
    r = run_bench(
        "load.bench_e2e",
        *("--clusters", "3", "--nodes", "40", "--jobs", "100", "--latency-jobs", "100"),
        *("--rate", "500", "--runs", "1", "--settle-s", "0.2", "--baseline-msgs", "5000"),
        *("--cpus", "broker-own-core", "--json", str(tmp_path / "e2e.json")),
    )
    assert r["all_dispatched"] is True and r["cpus"] == "broker-own-core"
    (run,) = json.loads((tmp_path / "e2e.json").read_text())["detail"]
    cores = run["cores"]
    assert len(cores["broker"]) == 1, cores
    for other in ("nats", "bench"):
        assert cores[other] and not set(cores[other]) & set(cores["broker"]), cores
    for figure in (run["burst"], run["paced"]):
        waits = figure["wait_ms_per_job"]
        assert set(waits) == {"broker", "nats", "bench", "steal"}, waits
        assert all(math.isfinite(ms) and ms >= 0 for ms in waits.values()), waits


def test_bench_e2e_fleet_in_its_own_process() -> None:
    """`--fleet both`: each run also measures with the fake agents in a child process, whose
    carried-out Dispatches reach the load generator over NATS; every job is counted once.
    `--stalls-ms`: the broker's long loop turns, GC passes and callbacks per job come back
    from its process, with the benchmark's own loop lag."""
    r = run_bench(
        "load.bench_e2e",
        *("--clusters", "3", "--nodes", "40", "--jobs", "100", "--latency-jobs", "100"),
        *("--rate", "500", "--runs", "1", "--settle-s", "0.2", "--baseline-msgs", "5000"),
        *("--fleet", "both", "--stalls-ms", "1"),
        timeout=60.0,
    )
    assert r["all_dispatched"] is True
    both = r["by_tree_and_fleet"]
    assert set(both) == {"this in-process", "this process"}
    for figures in both.values():
        assert 0 < figures["p50_ms_median"] <= figures["p99_ms_median"] < 30_000
        assert len(figures["load_average_1m"]) == len(figures["raw_request_p99_ms"]) == 1
        assert figures["all_dispatched"] is True
        # the broker ran under load/stallprobe.py: its GC passes in the paced window (it
        # may run none: its cycles run paused and freeze what they leave, shell/gcpacing.py)
        (stalls,) = figures["broker_stalls"]
        assert set(stalls["gc_collected"]) == set(stalls["gc_passes"]), stalls
        assert stalls["gc_cpu_ms"] >= 0 and stalls["gc_max_cpu_ms"] >= 0, stalls
        # and every callback of its loop, counted by kind: a job takes several
        assert stalls["callbacks_per_job"] > 1, stalls
        assert any(name.startswith("task ") for name in stalls["callbacks_per_job_by_task"])
        # and how late the benchmark's own loop ran a 1 ms timer meanwhile
        (lag,) = figures["bench_loop_lag"]
        assert lag["samples"] > 10 and 0 <= lag["p50_ms"] <= lag["p99_ms"] <= lag["max_ms"], lag


def test_bench_scale_tiny() -> None:
    """Durable submissions, a `kill -9` and restart, a failover and a clean handover, at a
    toy size: every job restored each time, and the figures are the process's own. (Without
    the job bucket's snapshot: 300 writes do not prompt one, and the wait for it would be the
    test's whole minute.)"""
    r = run_bench(
        "load.bench_scale",
        *("--jobs", "300", "--queues", "3", "--runs", "1", "--standby-warmup-s", "1"),
        "--no-records-snapshot",
        timeout=60.0,
    )
    (run,) = r["runs"]
    assert finite_positive(r["durable_submits_per_s_median"])
    # the broker's CPU over the submissions, per job, in ms: more than nothing (300 jobs
    # take it at least a clock tick), less than a second each
    assert 0 < r["submit_cpu_ms_per_job_median"] < 1_000
    assert r["submit_cpu_ms_per_job_median"] == round(run["submit_cpu_ms_per_job"], 4)
    for figure in ("recovered_s", "takeover_s", "handover_s", "rss_mib", "rss_restarted_mib"):
        assert finite_positive(run[figure]), figure


def test_bench_logs_tiny() -> None:
    """Both configurations write their lines and are timed in every run."""
    r = run_bench("load.bench_logs", "--lines", "300", "--runs", "2")
    assert len(r["cpu_us_per_line"]) == len(r["stock_cpu_us_per_line"]) == 2
    assert all(finite_positive(x) for x in (*r["cpu_us_per_line"], *r["stock_cpu_us_per_line"]))


def test_bench_ingest_core_tiny() -> None:
    """Every batch is applied (a refused batch fails the run) and every run is timed."""
    r = run_bench(
        "load.bench_ingest_core",
        *("--clusters", "2", "--nodes", "10", "--events", "2000", "--batch", "50", "--runs", "2"),
    )
    assert len(r["cpu_us_per_event"]) == 2
    assert all(finite_positive(x) for x in r["cpu_us_per_event"])
    assert finite_positive(r["events_per_cpu_s_median"])


def test_bench_spot_tiny() -> None:
    r = run_bench(
        "load.bench_spot",
        *("--clusters", "3", "--nodes", "40", "--jobs", "60", "--notices", "10"),
        *("--runs", "1", "--gap-s", "0.01"),
    )
    assert r["replaced_total"] >= 10  # every notice hits at least one running job
    assert r["problems"]["timed_out"] == 0
    assert r["resumed_from_checkpoint"] is True
    assert r["on_another_cluster"] is True
    # The broker holds the new attempt's Dispatch until the old one's Cancel is acknowledged,
    # so no moment ever has two copies of one job running.
    assert r["two_live_copies"] == 0, r["two_live_copies_examples"]
    assert r["two_live_copies_max_ms"] == 0
    assert 0 < r["p50_ms_median"] <= r["p99_ms_median"] < 10_000


def test_bench_memory_tiny() -> None:
    """The broker's own process is measured: its RSS grows with the jobs, and the allocators
    tracemalloc names include the core's records."""
    r = run_bench("load.bench_memory", "--jobs", "300", "--queues", "3", timeout=120.0)
    (run,) = r["runs"]
    assert 0 < run["rss_empty_mib"] <= run["rss_mib"] == r["rss_mib_median"]
    assert r["traced_mib"] > 0 and len(r["top_lines"]) == 25
    assert any(row["where"].startswith("broker/") for row in r["top_files"]), r["top_files"]
    # One registered record: its own bytes only, the parts alike jobs share counted once.
    assert 300 < r["record"]["bytes_per_record"] < 1000  # 1,779 with no part shared
    assert r["record"]["fields"]["job_id"] > 0


def test_bench_nats_client_tiny() -> None:
    """nats-py is measured in every run, a message received and published, on the process and
    on the event loop's thread."""
    r = run_bench(
        "load.bench_nats_client",
        *("--client", "nats-py", "--messages", "2000", "--runs", "2"),
        timeout=120.0,
    )
    assert r["skipped_not_installed"] == []
    for what in ("received", "published", "received_loop", "published_loop"):
        runs = r[f"nats_py_{what}_us_runs"]
        assert len(runs) == 2 and all(finite_positive(x) for x in runs), (what, runs)
    assert finite_positive(r["raw_nats_msgs_per_s"])


def test_bench_nats_client_names_an_unknown_client() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "load.bench_nats_client", "--client", "nats.go"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "'nats.go' is not one of nats-py, natsrpy" in proc.stderr
