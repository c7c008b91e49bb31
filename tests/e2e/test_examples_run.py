"""The shipped examples fit together: `muster broker --config examples/broker.yaml` and `muster
fleet --config examples/fleet-fake.yaml` as real processes on a private nats-server; every job in
examples/jobs/ is submitted with the command its own header gives and runs to `succeeded`; the
README's Python snippet submits to a queue that exists, and its retry is safe."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.client import MusterClient
from broker.embedded import EmbeddedNats
from schemas.natsopts import NatsOptions
from tests.e2e.clusters import wait_clusters
from tests.support import wait_for

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
JOBS = sorted((EXAMPLES / "jobs").glob("*.yaml"))
SUBMIT = re.compile(r"muster submit (examples/jobs/\S+\.yaml)((?: --queue \S+)?)")


def muster(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "broker", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        **kw,  # type: ignore[arg-type]
    )


def muster_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip


class Stack:
    """The broker and the fake fleet of the examples, as `muster` child processes."""

    def __init__(self, url: str, state: Path) -> None:
        self.url = url
        self.state = state
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, *args: str) -> subprocess.Popen[bytes]:
        log = (self.state / f"{args[0]}-{len(self.procs)}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "broker", *args, "--nats", self.url],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "MUSTER_STATE_DIR": str(self.state)},
        )
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in self.state.glob("*.log"))


@pytest.fixture
def stack(fresh_nats: EmbeddedNats, tmp_path: Path) -> Iterator[Stack]:
    s = Stack(fresh_nats.url, tmp_path)
    s.spawn("broker", "--config", "examples/broker.yaml", "--log-level", "warning")
    s.spawn("fleet", "--config", "examples/fleet-fake.yaml", "--log-level", "warning")
    try:
        yield s
    finally:
        s.stop()


async def wait_ended(client: MusterClient, job_id: str, timeout: float) -> str:
    async def ended() -> str | None:
        state = (await client.get(job_id, timeout=2)).state
        return state if state in ("succeeded", "failed", "cancelled") else None

    return await wait_for(ended, timeout, what=f"{job_id} to end")


def test_every_header_names_a_submit_command() -> None:
    assert {p.name for p in JOBS} >= {"jobspec.yaml", "mpijob.yaml", "pytorchjob.yaml"}
    for path in JOBS:
        assert SUBMIT.search(path.read_text()), f"{path.name}: no `muster submit` line"


@pytest.mark.timeout(300)
async def test_every_example_job_runs_to_succeeded(stack: Stack) -> None:
    async with MusterClient(NatsOptions(url=stack.url)) as client:
        await wait_clusters(stack.url, {"fake-a", "fake-b", "fake-bamboo"})
        submitted: dict[str, str] = {}
        for path in JOBS:
            match = SUBMIT.search(path.read_text())
            assert match is not None
            extra = match.group(2).split()
            job_id = f"ex-{path.stem}"
            done = await asyncio.to_thread(
                muster, "submit", match.group(1), *extra, "--job-id", job_id, "--nats", stack.url
            )
            assert done.returncode == 0, (path.name, done.stderr, stack.logs())
            assert done.stdout.startswith(f"submitted job {job_id} to queue "), done.stdout
            submitted[path.name] = job_id
        view = await client.get(submitted["mpijob.yaml"])
        assert view.queue == "default"  # it names no queue
        for name, job_id in submitted.items():
            state = await wait_ended(client, job_id, timeout=150)
            assert state == "succeeded", (name, stack.logs())


@pytest.mark.timeout(180)
async def test_readme_snippet_submits_to_an_existing_queue_and_retries_safely(
    stack: Stack,
) -> None:
    readme = (ROOT / "README.md").read_text()
    (snippet,) = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    assert "muster.submit.ml-cluster-queue" in snippet and '"job_id"' in snippet
    code = snippet.replace("nats://127.0.0.1:4222", stack.url)
    async with MusterClient(NatsOptions(url=stack.url)) as client:
        await wait_clusters(stack.url, {"fake-a"})
        for _ in range(2):  # the second run is the "retry after a timeout"
            ran = await asyncio.to_thread(muster_python, code)
            assert ran.returncode == 0, ran.stderr
            assert "'accepted': True" in ran.stdout, ran.stdout
        jobs = [j for j in await client.list() if j.name == "llama-ft"]
        assert len(jobs) == 1, jobs  # the same job_id twice: one job


@pytest.mark.timeout(120)
async def test_no_queue_without_a_default_queue_is_refused_clearly(
    fresh_nats: EmbeddedNats, tmp_path: Path
) -> None:
    config = tmp_path / "broker.yaml"
    config.write_text("queues:\n  - name: research\n")
    s = Stack(fresh_nats.url, tmp_path)
    s.spawn("broker", "--config", str(config), "--log-level", "warning")
    try:

        async def answered() -> subprocess.CompletedProcess[str] | None:
            """A submission the broker answered. Until the broker makes its submit stream
            nothing listens (no responders, nothing kept, so trying again is safe); from then
            on the stored copy is answered on its reply header, led or not."""
            done = await asyncio.to_thread(
                muster, "submit", "examples/jobs/mpijob.yaml", "--nats", s.url
            )
            return None if "nothing listens" in done.stderr else done

        done = await wait_for(answered, 60, what="the broker answers", interval=0.3)
        assert done.returncode == 1
        assert done.stderr.strip() == (
            "error: the job names no queue and the config has no queue named 'default' to take "
            "it; name one (--queue, `queue:`); known queues: research"
        ), done.stderr
    finally:
        s.stop()


def watch_status(url: str, refreshes: int = 2) -> list[str]:
    """`muster status -w -o json`: read a few refreshes (one JSON array a line), then stop."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "broker", "status", "-w", "--interval", "0.2", "-o", "json",
         "--nats", url],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        return [proc.stdout.readline() for _ in range(refreshes)]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def job_file(tmp: Path, name: str, gpus: int, steps: int, replicas: int = 1) -> str:
    path = tmp / f"{name}.yaml"
    path.write_text(
        f"name: {name}\nqueue: ml-cluster-queue\ncapacity: on-demand\ngpu_types: [a100]\n"
        f"gang: [{{name: w, replicas: {replicas}, gpu: {gpus}, cpu: '8', memory: 32Gi}}]\n"
        f"workload: {{simulate: {{total_steps: {steps}, steps_per_second: 10}}}}\n"
    )
    return str(path)


@pytest.mark.timeout(180)
async def test_first_hour_commands_explain_a_waiting_job(stack: Stack, tmp_path: Path) -> None:
    """A gang no quota can hold is refused at once; a gang that waits for quota says so in
    `muster why` (per cluster x flavor, with numbers) and in the REASON column."""
    nats = ("--nats", stack.url)
    async with MusterClient(NatsOptions(url=stack.url)) as client:
        await wait_clusters(stack.url, {"fake-a", "fake-b", "fake-bamboo"})
        never = await asyncio.to_thread(
            muster, "submit", job_file(tmp_path, "huge", 8, 10, replicas=2), *nats
        )
        assert never.returncode == 1
        assert "queue ml-cluster-queue can never admit it" in never.stderr
        assert "gpu-a100: needs 16 gpu > 8" in never.stderr
        for name in ("holder", "waiter"):
            path = job_file(tmp_path, name, 8, 100_000)
            done = await asyncio.to_thread(muster, "submit", path, "--job-id", name, *nats)
            assert done.returncode == 0, done.stderr

        async def holder_placed() -> bool:
            return (await client.get("holder")).state in ("admitted", "running")

        async def waiter_bound_by_quota() -> bool:
            why = await client.why("waiter")
            return bool(why.candidates) and why.waiting_for == "quota"

        await wait_for(holder_placed, 60, what="holder admitted")
        await wait_for(waiter_bound_by_quota, 60, what="waiter held by quota")
        shown = await asyncio.to_thread(muster, "why", "waiter", *nats)
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        assert lines[0].startswith("waiter is queued, position 0 in queue ml-cluster-queue")
        assert "waiting for: quota" in lines
        od = next(line for line in lines if line.startswith("fake-a/od-a100"))
        assert "quota-exceeded" in od and "quota ml-cluster-queue gpu 8/8 used, needs 8" in od
        t4 = next(line for line in lines if line.startswith("fake-a/spot-t4"))
        assert "no T4 accepted" in t4
        table = await asyncio.to_thread(muster, "status", "--queue", "ml-cluster-queue", *nats)
        row = next(line for line in table.stdout.splitlines() if line.startswith("waiter"))
        assert "quota" in row
        refreshed = await asyncio.to_thread(watch_status, stack.url)
        assert len(refreshed) >= 2 and all("waiter" in line for line in refreshed)
        for name in ("holder", "waiter"):
            await client.cancel(name, "test over")
        ended = await asyncio.to_thread(muster, "watch", "holder", *nats)
        assert ended.returncode == 0 and "now cancelled" in ended.stdout, ended
        ran = await asyncio.to_thread(muster, "status", "--cluster", "fake-a", *nats)
        assert any(line.startswith("holder") for line in ran.stdout.splitlines()), ran.stdout
