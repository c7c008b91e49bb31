"""`muster broker --ui-port` serves the dashboard from the real process, on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp

from broker.embedded import free_port
from tests.support import wait_for


async def test_broker_process_serves_the_dashboard_and_stops_cleanly(
    nats_url: str, tmp_path: Path
) -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "broker", "broker", "--nats", nats_url,
        "--state-dir", str(tmp_path), "--ui-port", str(port), "--log-level", "warning",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "MUSTER_LOG_LEVEL": "warning"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert f"dashboard at http://127.0.0.1:{port}" in line.decode(), line
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/") as resp:
                assert resp.status == 200
                assert "<title>Muster</title>" in await resp.text()
            async with http.get(f"http://127.0.0.1:{port}/static/app.js") as resp:
                assert resp.status == 200
                assert "EventSource" in await resp.text()

            async def jobs_page() -> dict[str, Any] | None:
                """The jobs API answers once the broker leads; before, it says why not."""
                async with http.get(f"http://127.0.0.1:{port}/api/jobs") as resp:
                    body: dict[str, Any] = await resp.json()
                    if resp.status == 200:
                        return body
                    assert resp.status == 503 and "standing by" in body["error"], body
                    return None

            page = await wait_for(jobs_page, 30, what="the broker leads", interval=0.1)
            assert page["total"] == 0
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_ui_port_out_of_range_is_refused() -> None:
    from typer.testing import CliRunner

    from broker.cli_operator import app

    result = CliRunner().invoke(app, ["broker", "--ui-port", "70000"])
    assert result.exit_code == 2
    assert "--ui-port" in result.output
