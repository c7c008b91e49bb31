"""Fence cost on Kubernetes: API writes per minute and fence-extension latency.

    python -m load.bench_fence [--attempts 1000] [--latency-ms 30] [--acks 12] [--runs 3]
                               [--json out.json]

Setup per run: the stand-in API server (tests/kube/fake_apiserver.py, validation off, no
latency while the attempts are created), a `KubeBackend` with `fence_watchdog: true` and the
`AgentRuntime` in front of it (no NATS: its acknowledgement path is called directly).
`attempts` PyTorchJobs are dispatched through the runtime with a 900 s fence window. Then every
request to the API server waits `latency_ms` (a merge patch through operators' admission
webhooks and etcd), and the runtime gets `acks` broker acknowledgements (`Applied`), 5
simulated seconds apart (the backend's clock is simulated; requests and latency are real).

Measured: the wall time from each acknowledgement to the end of its fence extension (the
runtime awaits it), and every write (POST, PATCH, PUT, DELETE) the acknowledgements cause.
Writes per minute = writes / (acks x 5 s) x 60. The same command on an older tree measures
the per-object fence: one annotation patch per object per 5 s step (batch Jobs had two).
Prints every run, the medians, and one machine-readable `RESULT {...}` line.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import statistics
import time
from typing import Annotated, Any, cast

import msgspec
import structlog
import typer
from kubernetes_asyncio.client import ApiClient, Configuration
from nats.aio.client import Client

from agents.kube.backend import KubeBackend
from agents.kube.config import convert_kube_config
from agents.runtime import AgentRuntime
from load.command import Count, JsonOut, Options, program, summary
from load.common import emit
from schemas.agent import Applied, Dispatch
from schemas.job import JobSpec

NS = "muster-workloads"
WINDOW_S = 900.0
ACK_EVERY_S = 5.0
WRITES = ("POST", "PATCH", "PUT", "DELETE")
PYTORCHJOB: dict[str, Any] = {
    "apiVersion": "kubeflow.org/v1",
    "kind": "PyTorchJob",
    "metadata": {"name": "pt"},
    "spec": {
        "pytorchReplicaSpecs": {
            "Master": {
                "replicas": 1,
                "template": {
                    "spec": {
                        "containers": [
                            {
                                "name": "pytorch",
                                "image": "trainer:1",
                                "resources": {"limits": {"nvidia.com/gpu": 8}},
                            }
                        ]
                    }
                },
            }
        }
    },
}


class SimClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def dispatch(i: int) -> Dispatch:
    spec = {
        "name": "bench",
        "job_id": f"pt-{i}",
        "workload": {"kind": "manifest", "manifest": PYTORCHJOB},
    }
    return Dispatch(
        job_id=f"pt-{i}",
        attempt=1,
        epoch=1,
        flavor="a100",
        assignment=[],
        spec=msgspec.convert(spec, JobSpec),
        fence_after_s=WINDOW_S,
    )


async def one_run(attempts: int, latency_s: float, acks: int) -> dict[str, Any]:
    # The test stand-in, imported by name: it lives with the tests, not the package.
    stand_in: Any = importlib.import_module("tests.kube.fake_apiserver")
    async with stand_in.FakeApiServer(validate=False, termination_s=None) as server:
        api = ApiClient(configuration=Configuration(host=server.url))
        clock = SimClock(time.time())
        config = convert_kube_config(
            {
                "namespace": NS,
                "fence_watchdog": True,
                "flavors": [{"name": "a100", "capacity_type": "on-demand", "gpu_type": "a100"}],
                "report": {"enabled": False},
            }
        )
        backend = KubeBackend("c1", config, api_client=api, clock=clock)
        await backend.start(lambda _: None)
        runtime = AgentRuntime(backend, cast(Client, None))
        runtime.instance = "bench"
        log = structlog.get_logger("bench")
        for i in range(attempts):
            await runtime._dispatch(dispatch(i), log)
        server.latency_s = latency_s
        clock.now = time.time()  # the dispatches renewed from the wall clock: start from it
        before = len(server.requests)
        latencies: list[float] = []
        for seq in range(1, acks + 1):
            clock.now += ACK_EVERY_S
            runtime._sent_at[seq] = clock.now
            t0 = time.perf_counter()
            await runtime._on_applied(Applied(epoch=1, instance="bench", seq=seq))
            latencies.append(time.perf_counter() - t0)
        writes = sum(1 for m, _, _ in server.requests[before:] if m in WRITES)
        await backend.stop()
        await api.close()
    ordered = sorted(latencies)
    return {
        "attempts": attempts,
        "writes": writes,
        "writes_per_min": writes / (acks * ACK_EVERY_S) * 60,
        "ack_latency_p50_s": statistics.median(latencies),
        "ack_latency_max_s": ordered[-1],
    }


app = program()


@app.command(help=summary(__doc__))
def bench_fence(
    attempts: Annotated[int, typer.Option(min=1, max=100_000, help="running attempts")] = 1000,
    latency_ms: Annotated[float, typer.Option(min=0, help="per API request")] = 30.0,
    acks: Count = 12,
    runs: Count = 3,
    json_out: JsonOut = None,
) -> None:
    run_bench(
        Options(attempts=attempts, latency=latency_ms / 1000, acks=acks, runs=runs, json=json_out)
    )


def run_bench(args: Options) -> dict[str, Any]:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    print(
        f"fence bench: {args.attempts} PyTorchJobs, {args.latency * 1000:g} ms per request, "
        f"{args.acks} acknowledgements {ACK_EVERY_S:g} s apart"
    )
    results = []
    for r in range(args.runs):
        out = asyncio.run(one_run(args.attempts, args.latency, args.acks))
        results.append(out)
        print(
            f"run {r + 1}: {out['writes']} writes ({out['writes_per_min']:.0f}/min), "
            f"extension p50 {out['ack_latency_p50_s'] * 1000:.1f} ms, "
            f"max {out['ack_latency_max_s'] * 1000:.1f} ms"
        )
    result = {
        key: statistics.median(r[key] for r in results)
        for key in ("writes_per_min", "ack_latency_p50_s", "ack_latency_max_s")
    }
    result |= {"attempts": args.attempts, "runs": results}
    emit(result, args.json)
    return result


if __name__ == "__main__":
    app()
