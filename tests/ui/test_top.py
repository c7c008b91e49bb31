"""`muster top` against a real broker and fake clusters: rich's capture for what it shows, and
the real command for Ctrl-C on a terminal (a pty) and for its snapshot without one."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import pty
import signal
import sys
from collections.abc import AsyncIterator

import nats
from rich.console import Console

from broker.client import MusterClient
from broker.embedded import EmbeddedNats
from broker.service import Broker
from broker.top import TopView, run_top
from schemas.config import BrokerConfig, QueueConfig
from schemas.natsopts import NatsOptions
from tests.ui.conftest import Live
from tests.world import sim_job


async def test_top_follows_a_spot_move_from_the_event_stream(live: Live) -> None:
    h, fleet = live.world.harness, live.world.fleet
    assert fleet is not None
    client = await MusterClient(NatsOptions(url=h.url), subjects=h.subjects).connect()
    screen = Console(file=io.StringIO(), width=200, record=True)
    view = TopView()
    task = asyncio.create_task(run_top(client, screen, min_interval_s=0.2, view=view))
    try:
        job_id = (await h.submit(sim_job("top", steps=4000, capacity="spot"))).job_id
        await h.wait_event(job_id, "running", timeout=15)
        first = live.reclaim(job_id)
        await h.wait_event(job_id, "running", count=2, timeout=20)

        def moved() -> bool:
            items = view.interruptions.newest_first(5)
            return (
                bool(items)
                and items[0]["new_cluster"] is not None
                and any(j.job_id == job_id and j.cluster != first.cluster for j in view.busiest)
            )

        await h.wait_for(moved, timeout=15)
    finally:
        task.cancel()  # what Ctrl-C does to the command's main task
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.close()
    shown = Console(file=io.StringIO(), width=200, record=True)
    shown.print(view.render())
    text = shown.export_text()
    for expected in ("Clusters", "Queues", "Busiest jobs", "Recent interruptions", "spot-notice"):
        assert expected in text
    assert job_id in text and "default" in text
    other = "b" if first.cluster == "a" else "a"
    row = next(line for line in text.splitlines() if "spot-notice" in line)
    assert job_id in row and f"{first.cluster}/spot" in row and other in row
    assert task.cancelled()  # ended by the cancellation, not by an error of its own


@contextlib.asynccontextmanager
async def broker_on(url: str) -> AsyncIterator[None]:
    """A leading broker with one queue, `research`, on the given NATS server."""
    bnc = await nats.connect(url)
    broker = Broker(BrokerConfig(queues=[QueueConfig(name="research")]), bnc)
    run = asyncio.create_task(broker.run())
    try:
        await asyncio.wait_for(broker.leading.wait(), 15)
        yield
    finally:
        await broker.stop()
        await asyncio.wait_for(run, 15)
        await bnc.close()


def read_all(fd: int) -> bytes:
    """Everything written to a pty until its last writer closes it (EIO on Linux)."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


async def test_top_command_exits_cleanly_on_ctrl_c(fresh_nats: EmbeddedNats) -> None:
    proc = None
    screen, tty = pty.openpty()  # the live view runs only on a terminal
    try:
        async with broker_on(fresh_nats.url):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "broker", "top", "--nats", fresh_nats.url,
                "--interval", "0.2",
                stdout=tty,
                stderr=asyncio.subprocess.PIPE,
                env={**os.environ, "COLUMNS": "160"},
            )  # fmt: skip
            os.close(tty)
            tty = -1
            shown = asyncio.create_task(asyncio.to_thread(read_all, screen))
            assert proc.stderr is not None
            line = await asyncio.wait_for(proc.stderr.readline(), 30)
            assert b"live (Ctrl-C to quit)" in line, line
            proc.send_signal(signal.SIGINT)
            _, rest = await asyncio.wait_for(proc.communicate(), 30)
            assert proc.returncode == 0, rest
            assert b"Traceback" not in rest
            out = await asyncio.wait_for(shown, 30)
            assert b"Clusters" in out and b"Recent interruptions" in out
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        if tty >= 0:
            os.close(tty)
        os.close(screen)


async def top_piped(url: str) -> tuple[int | None, bytes, bytes]:
    """`muster top` with its output to pipes, as in `muster top | less`: exit status, out, err."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "broker", "top", "--nats", url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode, out, err


async def test_top_without_a_terminal_prints_one_snapshot_and_exits(
    fresh_nats: EmbeddedNats,
) -> None:
    async with broker_on(fresh_nats.url):
        status, out, err = await top_piped(fresh_nats.url)
    assert status == 0, err
    text = out.decode()
    assert "\x1b[" not in text  # plain text, no terminal control codes
    for expected in ("Clusters", "Queues", "Busiest jobs", "Recent interruptions", "research"):
        assert expected in text, text
    assert "Ctrl-C" not in text + err.decode()
    assert len(text.splitlines()) > 5, text


async def test_top_without_a_terminal_or_a_broker_exits_1_saying_so(
    fresh_nats: EmbeddedNats,
) -> None:
    status, out, err = await top_piped(fresh_nats.url)
    assert status == 1, (out, err)
    assert b"no broker answers" in err and b"muster broker" in err, err
    assert b"Traceback" not in err and out == b""
