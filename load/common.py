"""Shared pieces of the benchmarks: an embedded NATS, a broker in its own process, the raw
NATS baseline every figure is compared with, and small statistics helpers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats
from nats.aio.client import Client

from schemas.config import BrokerConfig
from schemas.subjects import Subjects
from shell.natsio import flush

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


BROKER_PROGRAM = ("-m", "broker")


class BrokerProcess:
    """`muster broker` as a child process (so it can be SIGKILLed and measured alone)."""

    def __init__(
        self,
        url: str,
        config: BrokerConfig,
        state_dir: Path | None = None,
        *,
        program: tuple[str, ...] = BROKER_PROGRAM,
        tree: Path | None = None,
        log_level: str = "warning",
    ) -> None:
        # What runs the `muster` command line in the child (a probe may go in front), and the
        # checkout whose broker runs (`--baseline` of bench_e2e; None: this one). Its logs
        # go to this process's stderr at `log_level` (a deployment's default is info).
        self.program = program
        self.tree = tree
        self.log_level = log_level
        self.url = url
        self.config = config
        self._tmp = tempfile.TemporaryDirectory(prefix="muster-bench-")
        self.state_dir = state_dir or Path(self._tmp.name)
        self.config_path = self.state_dir / "broker.yaml"
        self.config_path.write_bytes(msgspec.yaml.encode(config))
        self.proc: subprocess.Popen[bytes] | None = None
        self.subjects = Subjects(prefix=config.subject_prefix)

    def start(self) -> None:
        env = {**os.environ, "MUSTER_LOG_LEVEL": self.log_level}
        if self.tree is not None:
            env["PYTHONPATH"] = str(self.tree)
        self.proc = subprocess.Popen(
            [
                sys.executable, *self.program, "broker",
                "--nats", self.url,
                "--config", str(self.config_path),
                "--state-dir", str(self.state_dir),
                "--log-level", self.log_level,
            ],
            env=env,
            cwd=self.tree,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip

    async def wait_leading(self, nc: Client, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}")
            try:
                return await self.stats(nc, timeout=0.5)
            except Exception:
                await asyncio.sleep(0.05)
        raise TimeoutError("broker did not start leading in time")

    async def stats(self, nc: Client, timeout: float = 5.0) -> dict[str, Any]:
        msg = await nc.request(self.subjects.api("stats"), b"{}", timeout=timeout)
        return json.loads(msg.data)  # type: ignore[no-any-return]

    def rss_bytes(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        end_process(self.proc, 10.0)

    def cleanup(self) -> None:
        self.stop()
        self._tmp.cleanup()


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc), to tell who was busy."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def end_process(proc: subprocess.Popen[bytes] | None, grace_s: float) -> None:
    """SIGTERM, then SIGKILL if the process has not exited within `grace_s`."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


async def raw_nats_baseline(url: str, count: int = 200_000, size: int = 64) -> float:
    """Messages per second from one connection to another through the same server: the
    ceiling every figure is compared with. (Both sides flush through `shell.natsio.flush`:
    with nats-py's own flush the subscription could miss the first messages and the baseline
    then waited 60 s and failed.)"""
    pub = await nats.connect(url)
    sub_nc = await nats.connect(url, pending_size=256 * 1024 * 1024)
    got = 0
    done = asyncio.get_running_loop().create_future()

    async def on_msg(_: Any) -> None:
        nonlocal got
        got += 1
        if got == count and not done.done():
            done.set_result(None)

    try:
        await sub_nc.subscribe(
            "bench.baseline", cb=on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1
        )
        await flush(sub_nc)
        payload = b"x" * size
        started = time.perf_counter()
        for i in range(count):
            await pub.publish("bench.baseline", payload)
            if i % 5000 == 0:
                await asyncio.sleep(0)
        await flush(pub)
        await asyncio.wait_for(done, 60)
        return count / (time.perf_counter() - started)
    finally:
        await pub.close()
        await sub_nc.close()


def emit_with_detail(result: dict[str, Any], path: str | None) -> None:
    """The RESULT line leaves out each run's detail; the file keeps it."""
    emit({k: v for k, v in result.items() if k != "detail"}, None)
    if path:
        Path(path).write_text(json.dumps(result, sort_keys=True, default=str) + "\n")


def emit(result: dict[str, Any], path: str | None) -> None:
    """Print one machine-readable line and optionally save it."""
    line = json.dumps(result, sort_keys=True)
    print("RESULT " + line)
    if path:
        Path(path).write_text(line + "\n")


@contextlib.contextmanager
def bytecode_cached(cached: bool) -> Iterator[None]:
    """Let the processes a benchmark starts (brokers, `muster` commands) cache their bytecode
    (in a directory of their own, removed after) as an installed Muster has it: with
    PYTHONDONTWRITEBYTECODE set, as on some dev machines, every start compiled the modules it
    imports from source again (~0.45 s of a broker's restart)."""
    if not cached:
        yield
        return
    saved = {k: os.environ.get(k) for k in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    with tempfile.TemporaryDirectory(prefix="muster-bytecode-") as cache:
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        os.environ["PYTHONPYCACHEPREFIX"] = cache
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
