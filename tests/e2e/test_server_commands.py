"""`muster broker`, `muster fleet` and `muster agent` as real processes, judged by their real
stderr: a failure is one line naming the problem and the fix (never a traceback); an
unreachable NATS or Kubernetes API is said once and retried; a restarted broker keeps its NATS
address so agents come back by themselves; lifecycle steps are logged with job, cluster and
attempt."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from broker.client import MusterClient
from broker.embedded import free_port
from schemas.natsopts import NatsOptions
from tests.e2e.clusters import wait_clusters
from tests.support import ResettingPort, wait_for_sync

ROOT = Path(__file__).resolve().parents[2]
FLEET = """\
clusters:
  - cluster: {name}
    backend: fake
    heartbeat_s: 0.2
    fake:
      time_scale: 10
      start_delay_s: 0.5
      flavors:
        - {{name: od-a100, capacity_type: on-demand, gpu_type: a100, nodes: 2}}
"""


AGENT = """\
cluster: {name}
backend: fake
heartbeat_s: 0.2
fake:
  flavors:
    - {{name: od-a100, capacity_type: on-demand, gpu_type: a100, nodes: 2}}
"""


class Proc:
    """One `muster` child process with its stderr in a file (read while it runs)."""

    def __init__(self, tmp: Path, name: str, *args: str, env: dict[str, str] | None = None):
        self.err_path = tmp / f"{name}.stderr"
        self._err = self.err_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "broker", *args],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=self._err,
            env={**os.environ, **(env or {})},
        )

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_for(self, test: Callable[[str], bool], timeout: float = 30) -> str:
        def seen() -> str | None:
            text = self.stderr
            if test(text):
                return text
            if self.proc.poll() is not None:
                raise AssertionError(f"exited {self.proc.poll()} first; stderr:\n{text}")
            return None

        return wait_for_sync(seen, timeout, what=f"a line in {self.err_path.name}")

    def interrupt(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)
        finally:
            self._err.close()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.interrupt()


@pytest.fixture
def unreachable() -> Iterator[Callable[[], ResettingPort]]:
    """Makes ports that reset every connection (see ResettingPort), closed after the test."""
    with contextlib.ExitStack() as stack:
        yield lambda: stack.enter_context(ResettingPort())


def one_line_error(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "broker", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def write(tmp: Path, name: str, text: str) -> str:
    (tmp / name).write_text(text)
    return str(tmp / name)


def test_bad_configs_are_one_line_each(tmp_path: Path) -> None:
    bad = write(tmp_path, "bad.yaml", "queues:\n  - name: ML\n    wieght: 2\n")
    line = one_line_error("broker", "--config", bad)
    assert "queues[0]" in line
    trace = "  trace: {path: gone.csv, flavor: od-a100}\n"
    missing = {
        "fleet": write(tmp_path, "fleet-trace.yaml", FLEET.format(name="c1") + "    " + trace),
        "agent": write(tmp_path, "agent-trace.yaml", AGENT.format(name="c1") + trace),
    }
    for command, path in missing.items():
        line = one_line_error(command, "--config", path, "--nats", "nats://127.0.0.1:1")
        assert f"no file at {tmp_path / 'gone.csv'}" in line and "data/traces/" in line
    empty = "clusters:\n  - {cluster: c, backend: fake, fake: {flavors: []}}\n"
    empty_fleet = write(tmp_path, "empty.yaml", empty)
    line = one_line_error("fleet", "--config", empty_fleet)
    assert "clusters[0].fake.flavors" in line and "list at least one flavor" in line
    empty_agent = write(tmp_path, "agent.yaml", "cluster: c\nbackend: fake\nfake: {flavors: []}\n")
    line = one_line_error("agent", "--config", empty_agent)
    assert "fake.flavors" in line and "list at least one flavor" in line
    bad_enum = write(tmp_path, "enum.yaml", "cluster: c\nbackend: slurm\nfake: {}\n")
    line = one_line_error("agent", "--config", bad_enum)
    assert "valid values: fake, kube" in line


def test_unreachable_nats_is_said_once_and_retried(
    tmp_path: Path, procs: list[Proc], unreachable: Callable[[], ResettingPort]
) -> None:
    broker_cfg = write(tmp_path, "b.yaml", "flavors: []\nqueues: [{name: default}]\n")
    fleet_cfg = write(tmp_path, "f.yaml", FLEET.format(name="c1"))
    agent_cfg = write(tmp_path, "a.yaml", AGENT.format(name="c2"))
    state = str(tmp_path / "s")
    commands = {
        "broker": ("broker", "--config", broker_cfg, "--state-dir", state),
        "fleet": ("fleet", "--config", fleet_cfg, "--log-format", "console"),
        "agent": ("agent", "--config", agent_cfg),
    }
    # One port each, so each process's attempts are counted on their own.
    ports = [unreachable() for _ in commands]
    urls = [f"nats://127.0.0.1:{port.port}" for port in ports]
    procs += [
        Proc(tmp_path, name, *args, "--nats", url)
        for (name, args), url in zip(commands.items(), urls, strict=True)
    ]
    for p in procs:
        p.wait_for(lambda text: "cannot reach NATS" in text)
    # Three more attempts after the one that was reported: each failed and said nothing.
    wait_for_sync(lambda: all(port.attempts >= 4 for port in ports), 30, what="three retries")
    for p, url in zip(procs, urls, strict=True):
        text = p.stderr
        assert p.proc.poll() is None, text  # still retrying
        assert text.count("cannot reach NATS") == 1, text
        assert "Traceback" not in text
        assert url in text and "hint" in text


def test_unreachable_kubernetes_api_is_said_once_and_retried(
    tmp_path: Path, procs: list[Proc], nats_url: str, unreachable: Callable[[], ResettingPort]
) -> None:
    api = unreachable()
    api_url = f"https://127.0.0.1:{api.port}"
    kubeconfig = write(
        tmp_path,
        "kubeconfig",
        f"""apiVersion: v1
kind: Config
clusters:
- cluster: {{server: "{api_url}", insecure-skip-tls-verify: true}}
  name: c
contexts:
- context: {{cluster: c, user: u}}
  name: c
current-context: c
users:
- name: u
  user: {{token: x}}
""",
    )
    agent_cfg = write(
        tmp_path,
        "kube.yaml",
        f"cluster: k1\nbackend: kube\nsubject_prefix: kubeunreach\nkube:\n"
        f"  kubeconfig: {kubeconfig}\n"
        "  flavors: [{name: a100-od, capacity_type: on-demand, gpu_type: a100}]\n"
        "  report: {enabled: false}\n",
    )
    agent = Proc(tmp_path, "kube", "agent", "--config", agent_cfg, "--nats", nats_url)
    procs.append(agent)
    said = "Kubernetes API server unreachable"
    text = agent.wait_for(lambda text: said in text)
    assert api_url in text, text  # the line names the URL it tried
    # Two more attempts after the one that was reported (backoff 1 s, then 2 s), and the
    # start of a third, so the second has been handled.
    wait_for_sync(lambda: api.attempts >= 4, 30, what="two retries")
    text = agent.stderr
    assert agent.proc.poll() is None, text
    assert text.count(said) == 1, text
    assert "agent stopped" not in text and "Traceback" not in text


def json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.timeout(240)
async def test_restarted_broker_keeps_its_address_and_logs_lifecycle(
    tmp_path: Path, procs: list[Proc]
) -> None:
    port = free_port()
    state = tmp_path / "state"
    env = {"MUSTER_NATS_PORT": str(port), "MUSTER_STATE_DIR": str(state)}
    config = "queues: [{name: default}]\ntimeouts: {heartbeat_s: 0.2}\n"
    broker_cfg = write(tmp_path, "b.yaml", config)
    args = ("broker", "--config", broker_cfg, "--log-format", "json", "--log-level", "info")
    first = Proc(tmp_path, "broker1", *args, env=env)
    procs.append(first)
    await asyncio.to_thread(first.wait_for, lambda text: "broker.leading" in text)
    url = (state / "nats.url").read_text().strip()
    assert url == f"nats://127.0.0.1:{port}"
    fleet_cfg = write(tmp_path, "f.yaml", FLEET.format(name="r1"))
    fleet = Proc(tmp_path, "fleet", "fleet", "--config", fleet_cfg, "--nats", url)
    procs.append(fleet)
    await wait_clusters(url, {"r1"})

    job = {"name": "life", "job_id": "life-1", "gang": [{"name": "w", "gpu": 8}],
           "workload": {"simulate": {"total_steps": 20, "steps_per_second": 10}}}  # fmt: skip
    async with MusterClient(NatsOptions(url=url, name="t")) as client:
        await client.submit(job)
        async for ev in client.watch("life-1", idle_timeout=60):
            if ev.state == "succeeded":
                break
    text = await asyncio.to_thread(first.wait_for, lambda t: '"job succeeded"' in t)
    steps = {
        str(e["event"]): e
        for e in json_lines(text)
        if e.get("job_id") == "life-1" and str(e["event"]).startswith("job ")
    }
    for step in ("job admitted", "job dispatched", "job running", "job succeeded"):
        assert step in steps, (step, sorted(steps))
        assert steps[step]["cluster"] == "r1" and steps[step]["attempt"] == 1
        assert steps[step]["level"] == "info"

    assert first.interrupt() == 0
    assert "Traceback" not in first.stderr
    # The fleet's connections to the old server sit in TIME_WAIT on its port now.
    second = Proc(tmp_path, "broker2", *args, env=env)
    procs.append(second)
    await asyncio.to_thread(second.wait_for, lambda text: "broker.leading" in text)
    assert (state / "nats.url").read_text().strip() == url
    await wait_clusters(url, {"r1"})
    fleet_log = fleet.stderr
    assert fleet_log.count("nats reconnected") == 1, fleet_log
    assert fleet_log.count("nats disconnected") == 1, fleet_log
    assert fleet_log.count("cannot reach NATS") <= 1, fleet_log
