"""`muster status --watch`: the list refreshes on a terminal (rich Live) and as one JSON array
per line, shows a job submitted after it started, and Ctrl-C ends it with status 130."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from muster.cli import app
from schemas.api import JobView
from tests.cli.live_broker import BLOCKER, runner
from tests.world import ThreadedWorld, World

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 30.0


def _watch(url: str, *extra: str, stdout: int) -> subprocess.Popen[bytes]:
    args = ["status", "--watch", "--interval", "0.2", "--nats", url, *extra]
    env = {**os.environ, "COLUMNS": "160", "NO_COLOR": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "muster", *args],
        cwd=REPO,
        stdout=stdout,
        stderr=subprocess.PIPE,
        env=env,
    )


def _read_until(fd: int, done: Callable[[str], bool], seen: list[str]) -> str:
    """Read `fd` until `done(everything read so far)` or WAIT_S pass."""
    end = time.monotonic() + WAIT_S
    while not done("".join(seen)):
        left = end - time.monotonic()
        assert left > 0, f"not seen in {WAIT_S:g}s; output: {''.join(seen)[-2000:]!r}"
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if ready:
            chunk = os.read(fd, 65536)
            assert chunk, f"the watch ended early; output: {''.join(seen)[-2000:]!r}"
            seen.append(chunk.decode(errors="replace"))
    return "".join(seen)


def _submit_late(world: World) -> None:
    late = {"name": "late", "job_id": "late-1", "queue": "ml", "gang": [{"name": "w", "gpu": 8}]}
    result = runner.invoke(
        app, ["submit", "-", "--nats", world.harness.url], input=json.dumps(late)
    )
    assert result.exit_code == 0, result.stderr


def _start_blocker(threaded: ThreadedWorld, world: World) -> None:
    result = runner.invoke(
        app, ["submit", "-", "--nats", world.harness.url], input=json.dumps(BLOCKER)
    )
    assert result.exit_code == 0, result.stderr
    threaded.call(world.harness.wait_event("blocker", "running"))


def _stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_watch_refreshes_the_table_on_a_terminal(live: tuple[ThreadedWorld, World]) -> None:
    threaded, world = live
    _start_blocker(threaded, world)
    master, slave = pty.openpty()
    proc = _watch(world.harness.url, stdout=slave)
    os.close(slave)
    seen: list[str] = []
    try:
        _read_until(master, lambda out: "blocker" in out and "running" in out, seen)
        assert "late-1" not in "".join(seen)
        _submit_late(world)
        # The same table, refreshed in place: the job submitted later shows up, queued.
        out = _read_until(master, lambda out: "late-1" in out, seen)
        assert "queued" in out[out.index("late-1") - 200 :]
    finally:
        code = _stop(proc)
        os.close(master)
    assert code == 130, proc.stderr.read().decode() if proc.stderr else ""


def test_watch_prints_one_json_array_per_refresh(live: tuple[ThreadedWorld, World]) -> None:
    threaded, world = live
    _start_blocker(threaded, world)
    proc = _watch(world.harness.url, "--output", "json", stdout=subprocess.PIPE)
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    seen: list[str] = []
    try:
        _read_until(fd, lambda out: out.count("\n") >= 2, seen)
        _submit_late(world)
        out = _read_until(fd, lambda out: "late-1" in out.rsplit("\n", 2)[-2], seen)
    finally:
        code = _stop(proc)
    complete = out.rsplit("\n", 1)[0].splitlines()  # the read may end inside a line
    snapshots = [msgspec.json.decode(line, type=list[JobView]) for line in complete]
    assert len(snapshots) >= 3
    assert [j.job_id for j in snapshots[0]] == ["blocker"]
    last = {j.job_id: j.state for j in snapshots[-1]}
    assert last == {"blocker": "running", "late-1": "queued"}
    assert code == 130
