"""A big cluster on the stand-in API server, in a process of its own.

`python -m tests.kube.bigcluster --nodes 5000 --pods 150000` fills a `FakeApiServer` with compact
GPU nodes and pods (seeded, so every run holds the same cluster), prints `PORT <port>` and then
obeys one command per stdin line, answering each with one line:

* `expire`: a compaction past every version the agent holds: ERROR 410 on every open watch,
  410 on every later watch from an older version and on every continue token: re-list;
* `gang <job_id> <pods>`: a running Muster attempt of that many pods (attempt 1);
* `requests`: the count of requests served so far (`REQUESTS <n> <patches> <throttled>
  <peak in flight>`);
* `latency <seconds>` / `inflight <n>`: what every later request costs / the APF bound.

Its own process, so that the agent side's memory and event loop are measured alone: a stand-in
holding 150,000 pods as dicts would dwarf the agent's figures and steal its loop.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import uuid
from typing import Any

from kinds.base import ANN_JOB, LABEL_ATTEMPT, LABEL_JOB
from tests.kube.fake_apiserver import FakeApiServer

NS = "muster-workloads"
TEAMS = 200  # namespaces the foreign pods spread over


def big_node(i: int) -> dict[str, Any]:
    name = f"gpu-{i:05d}"
    return {
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, "pool": "a100"},
        },
        "spec": {"providerID": f"aws:///us-east-1a/i-{i:017x}"},
        "status": {
            "capacity": {"cpu": "96", "memory": "1024Gi", "nvidia.com/gpu": "8", "pods": "110"},
            "allocatable": {
                "cpu": "95500m",
                "memory": "1000Gi",
                "nvidia.com/gpu": "8",
                "pods": "110",
            },
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
        },
    }


def big_pod(i: int, node: str, rng: random.Random) -> dict[str, Any]:
    gpu = rng.choice((0, 0, 1, 2))
    limits = {"nvidia.com/gpu": str(gpu)} if gpu else {}
    return {
        "metadata": {
            "name": f"w-{i:06d}",
            "namespace": f"team-{i % TEAMS:03d}",
            "uid": str(uuid.UUID(int=rng.getrandbits(128), version=4)),
            "labels": {"app": f"svc-{i % 997}"},
        },
        "spec": {
            "nodeName": node,
            "containers": [
                {
                    "name": "main",
                    "image": "registry.example/app:1",
                    "resources": {
                        "requests": {"cpu": "500m", "memory": "2Gi"},
                        "limits": limits,
                    },
                }
            ],
        },
        "status": {"phase": "Running"},
    }


def gang_pod(job_id: str, i: int, node: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"{job_id}-a1-w-{i}",
            "namespace": NS,
            "labels": {LABEL_JOB: job_id, LABEL_ATTEMPT: "1"},
            "annotations": {ANN_JOB: job_id},
        },
        "spec": {
            "nodeName": node,
            "containers": [
                {"name": "main", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
            ],
        },
        "status": {"phase": "Running"},
    }


def fill(server: FakeApiServer, nodes: int, pods: int, seed: int = 7) -> None:
    """Put the cluster in the store directly (no history, no watchers: nobody listens yet)."""
    rng = random.Random(seed)
    names = [f"gpu-{i:05d}" for i in range(nodes)]
    for i in range(nodes):
        server.put("/api/v1/nodes", big_node(i), silent=True)
    for i in range(pods):
        server.put("/api/v1/pods", big_pod(i, names[i % nodes], rng), silent=True)


async def serve(nodes: int, pods: int) -> None:
    server = FakeApiServer(validate=False, termination_s=None)
    fill(server, nodes, pods)
    await server.start()
    print(f"PORT {server.port}", flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := (await reader.readline()).decode().split():
            cmd, args = line[0], line[1:]
            if cmd == "expire":
                # History moves on (another object changes), then is compacted: every watch
                # and continue token of the agent is now too old, opened yet or not.
                server.put(f"/api/v1/namespaces/{NS}/configmaps", {"metadata": {"name": "tick"}})
                server.expire_watches()
            elif cmd == "gang":
                job_id, count = args[0], int(args[1])
                for i in range(count):
                    server.put(f"/api/v1/namespaces/{NS}/pods", gang_pod(job_id, i, f"gpu-{i:05d}"))
            elif cmd == "latency":
                server.latency_s = float(args[0])
            elif cmd == "inflight":
                server.max_inflight = int(args[0]) or None
            patches = len(server.patches)
            print(
                f"REQUESTS {len(server.requests)} {patches} {server.throttled} "
                f"{server.peak_inflight}",
                flush=True,
            )
    finally:
        await server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--pods", type=int, default=150_000)
    args = parser.parse_args()
    asyncio.run(serve(args.nodes, args.pods))


if __name__ == "__main__":
    main()
