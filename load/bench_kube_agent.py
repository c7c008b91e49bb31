"""The kube agent on a big cluster: list time, peak RSS, resync, 410 re-list, loop stalls, API
requests per minute and the checkpoint-request fan-out to a 1,000-pod gang.

    python -m load.bench_kube_agent [--nodes 5000] [--pods 150000] [--gang 1000] [--runs 3]

The cluster is the stand-in API server (tests/kube/fake_apiserver.py) filled with compact,
seeded nodes and pods, in a process of its own (tests/kube/bigcluster.py); each run starts a
fresh one, and the agent's `KubeBackend` runs in a fresh child process too, so its peak RSS
(VmHWM) is its own. The child paces the cycle collector as the `muster agent` process does
(`shell.gcpacing`). A ticker on the agent's loop records the longest stall (how late a 5 ms
sleep wakes) through the initial list, a resync and a 410 re-list; the most CPU one callback
of the loop took (`step_cpu_*_ms`: one piece of the agent's code before it yielded; a stall is
every callback ready in one iteration), what that step ran and the kernel's part of it
(`step_what_*`, `step_sys_*_ms`), and the most user CPU of any step (`step_user_cpu_*_ms`:
the agent's own code, without page faults and memory reclaim, which a neighbour's memory
pressure inflates); and the longest single pass of the cycle collector
(`gc_max_*_ms`, CPU), which says how much of a stall was the collector's.
The fan-out is timed with `--latency` seconds added to every API request (a real API server is
milliseconds away) and the stand-in's API priority and fairness bound (`--inflight`) on.
Steady state: requests the stand-in serves over `--steady-s` seconds with one running attempt,
per minute. Baseline in the same run: the stand-in's own time to serve one full paginated pod
list to a bare client.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Annotated, Any

import aiohttp
import typer

from load.command import Count, JsonOut, Options, program, summary
from load.common import emit, median
from load.stallprobe import Probe
from shell.gcpacing import paced_gc
from shell.tasks import cancel_and_wait

app = program()
FLAVORS = [
    {
        "name": "a100-od",
        "capacity_type": "on-demand",
        "gpu_type": "a100",
        "price_per_gpu_hour": 3.5,
        "node_labels": {"pool": "a100"},
    }
]


class Stand:
    """The stand-in API server process and its stdin command channel."""

    def __init__(self, nodes: int, pods: int) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.kube.bigcluster",
                "--nodes",
                str(nodes),
                "--pods",
                str(pods),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "PORT":
            raise RuntimeError("the stand-in API server did not start")
        self.url = f"http://127.0.0.1:{line[1]}"

    async def command(self, text: str) -> list[int]:
        """Send one command; the stand-in's counters after it (requests, patches, throttled,
        peak in flight)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        line = await asyncio.to_thread(self.proc.stdout.readline)
        return [int(x) for x in line.split()[1:]]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


class Stalls:
    """The longest time the loop did not run a ready callback (a 5 ms sleep woke late), as
    wall time and as the CPU time this thread spent meanwhile. On a loaded machine the wall
    figure includes time the process was not scheduled at all; the CPU figure is what the
    agent's own code held the loop for."""

    def __init__(self, period_s: float = 0.005) -> None:
        self.period_s = period_s
        self.worst = 0.0
        self.worst_cpu = 0.0
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            t, c = time.perf_counter(), time.thread_time()
            await asyncio.sleep(self.period_s)
            late = time.perf_counter() - t - self.period_s
            self.worst = max(self.worst, late)
            self.worst_cpu = max(self.worst_cpu, min(late, time.thread_time() - c))

    def reset(self) -> tuple[float, float]:
        """(wall, CPU) worst stalls in ms since the last reset."""
        out = (self.worst * 1000, self.worst_cpu * 1000)
        self.worst = self.worst_cpu = 0.0
        return out


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def until(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the agent did not get there in time: {what}")
        await asyncio.sleep(0.05)


async def baseline_list_s(url: str, page: int) -> float:
    """A bare client pulling every pod page by page, decoding nothing."""
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as s:
        token = ""
        while True:
            q = {"limit": str(page), **({"continue": token} if token else {})}
            async with s.get(f"{url}/api/v1/pods", params=q) as r:
                body = await r.json(content_type=None)
            token = body["metadata"].get("continue", "")
            if not token:
                return time.perf_counter() - t0


async def agent_run(
    url: str, gang: int, steady_s: float, latency: float, inflight: int
) -> dict[str, Any]:
    """One agent against a running stand-in (in this process: the child the run spawns)."""
    from kubernetes_asyncio.client import ApiClient, Configuration

    from agents.kube.backend import KubeBackend
    from agents.kube.config import convert_kube_config

    stand = _Channel()
    api = ApiClient(configuration=Configuration(host=url))
    cfg = convert_kube_config(
        {"namespace": "muster-workloads", "flavors": FLAVORS, "report": {"enabled": False}}
    )
    backend = KubeBackend("bench", cfg, api_client=api)
    pacing = asyncio.create_task(paced_gc())  # as `muster agent` runs (agents/cli.py)
    stalls = Stalls()
    # Every callback of the child's loop and every collector pass, timed (the child is the
    # agent's alone); the longest of each per phase.
    probe = Probe(threshold_ms=1.0, split_cpu=True)
    probe.install()
    out: dict[str, Any] = {}

    def phase_ended(phase: str) -> None:
        out[f"stall_{phase}_ms"], out[f"stall_cpu_{phase}_ms"] = stalls.reset()
        longest = max(probe.turns, key=lambda t: t["cpu_ms"], default=None)
        out[f"step_cpu_{phase}_ms"] = longest["cpu_ms"] if longest else 0.0
        out[f"step_sys_{phase}_ms"] = longest["sys_ms"] if longest else 0.0
        out[f"step_what_{phase}"] = longest["what"] if longest else ""
        # The agent's own code: the kernel's share (page faults, reclaim under another
        # process's memory pressure) left out.
        out[f"step_user_cpu_{phase}_ms"] = max((t["user_ms"] for t in probe.turns), default=0.0)
        out[f"gc_max_{phase}_ms"] = max((c["cpu_ms"] for c in probe.collections), default=0.0)
        probe.turns.clear()
        probe.collections.clear()

    try:
        t0 = time.perf_counter()
        await backend.start(lambda ev: None)
        out["list_s"] = time.perf_counter() - t0
        phase_ended("list")
        pr, nr = backend.pod_reflector, backend.node_reflector
        assert pr is not None and nr is not None
        out["pods_seen"] = backend.foreign_pod_count
        out["nodes_seen"] = len(nr.cache)
        t0 = time.perf_counter()
        await pr.resync()
        await nr.resync()
        out["resync_s"] = time.perf_counter() - t0
        phase_ended("resync")
        lists = pr.lists + nr.lists
        t0 = time.perf_counter()
        await stand.command("expire")
        await until(lambda: pr.lists + nr.lists >= lists + 2, 300, "re-list")
        out["relist_s"] = time.perf_counter() - t0
        phase_ended("relist")
        out["peak_rss_mib"] = peak_rss_mib()
        # A running gang, then the checkpoint request to every one of its pods.
        await stand.command(f"gang ck {gang}")
        await until(lambda: len(backend.attempt_pods("ck", 1)) >= gang, 120, "gang")
        await stand.command(f"latency {latency}")
        before = await stand.command(f"inflight {inflight}")
        t0 = time.perf_counter()
        await backend.checkpoint_now("ck", 1, time.time() + 30)
        out["fanout_s"] = time.perf_counter() - t0
        after = await stand.command("latency 0")
        out["fanout_patches"] = after[1] - before[1]
        out["fanout_throttled"] = after[2] - before[2]
        out["fanout_peak_inflight"] = after[3]
        if steady_s > 0:
            before = await stand.command("requests")
            await asyncio.sleep(steady_s)
            after = await stand.command("requests")
            out["requests_per_min"] = (after[0] - before[0]) * 60 / steady_s
        phase_ended("rest")
        phases = ("list", "resync", "relist", "rest")
        out["max_stall_ms"] = max(out[f"stall_{p}_ms"] for p in phases)
        out["max_stall_cpu_ms"] = max(out[f"stall_cpu_{p}_ms"] for p in phases)
        out["max_step_cpu_ms"] = max(out[f"step_cpu_{p}_ms"] for p in phases)
        out["max_gc_ms"] = max(out[f"gc_max_{p}_ms"] for p in phases)
        out["peak_rss_mib"] = peak_rss_mib()
    finally:
        stalls.task.cancel()
        await backend.stop()
        await cancel_and_wait(pacing)
        await api.close()
    return out


class _Channel:
    """The child's side of the command channel: lines to the parent, which relays them to
    the stand-in and answers with its counters."""

    async def command(self, text: str) -> list[int]:
        print(f"CMD {text}", flush=True)
        line = await asyncio.to_thread(sys.stdin.readline)
        return [int(x) for x in line.split()[1:]]


async def one_run(o: Options) -> dict[str, Any]:
    stand = Stand(o.nodes, o.pods)
    try:
        result: dict[str, Any] = {}
        if o.baseline:
            result["baseline_list_s"] = await baseline_list_s(stand.url, 500)
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "load.bench_kube_agent",
            "--agent",
            stand.url,
            "--gang",
            str(o.gang),
            "--steady-s",
            str(o.steady_s),
            "--latency",
            str(o.latency),
            "--inflight",
            str(o.inflight),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert child.stdin is not None and child.stdout is not None
        while line := (await child.stdout.readline()).decode():
            if line.startswith("CMD "):
                counters = await stand.command(line[4:].strip())
                child.stdin.write(("REQUESTS " + " ".join(map(str, counters)) + "\n").encode())
                await child.stdin.drain()
            elif line.startswith("AGENT "):
                result.update(json.loads(line[6:]))
        if await child.wait() != 0:
            raise RuntimeError("the agent process failed")
        return result
    finally:
        stand.close()


@app.command(help=summary(__doc__))
def main(
    nodes: Annotated[int, typer.Option(min=1)] = 5000,
    pods: Annotated[int, typer.Option(min=0)] = 150_000,
    gang: Count = 1000,
    runs: Count = 3,
    steady_s: Annotated[float, typer.Option(min=0)] = 30.0,
    latency: Annotated[float, typer.Option(min=0, help="seconds added to every request")] = 0.01,
    inflight: Annotated[int, typer.Option(min=0, help="APF bound of the stand-in")] = 400,
    baseline: Annotated[bool, typer.Option(help="time a bare client's list too")] = True,
    agent: Annotated[str | None, typer.Option(hidden=True)] = None,
    json_out: JsonOut = None,
) -> None:
    if agent is not None:  # the child: one agent against the given stand-in
        out = asyncio.run(agent_run(agent, gang, steady_s, latency, inflight))
        print("AGENT " + json.dumps(out), flush=True)
        return
    o = Options(
        nodes=nodes,
        pods=pods,
        gang=gang,
        steady_s=steady_s,
        latency=latency,
        inflight=inflight,
        baseline=baseline,
    )
    results = [asyncio.run(one_run(o)) for _ in range(runs)]
    keys = [k for k in results[0] if isinstance(results[0][k], (int, float))]
    emit(
        {
            "bench": "kube-agent",
            "nodes": nodes,
            "pods": pods,
            "gang": gang,
            "latency_s": latency,
            "runs": results,
            "median": {k: median([r[k] for r in results]) for k in keys},
        },
        json_out,
    )


if __name__ == "__main__":
    app()
