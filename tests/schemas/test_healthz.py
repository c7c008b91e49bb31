"""The probe endpoint: /livez answers while the loop runs, /readyz follows `ready()`, and the
exec probe's exit code says which."""

from __future__ import annotations

import asyncio

import pytest

from broker.embedded import free_port
from schemas import healthz


async def test_live_ready_and_the_exec_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    ready = {"ok": False}
    port = free_port()
    server = await healthz.serve(port, lambda: ready["ok"])
    try:

        def probe(path: str) -> int:
            return healthz.main(["--port", str(port), "--path", path, "--timeout", "5"])

        assert await asyncio.to_thread(probe, "/livez") == 0
        assert await asyncio.to_thread(probe, "/readyz") == 1  # 503 until connected
        ready["ok"] = True
        assert await asyncio.to_thread(probe, "/readyz") == 0
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /other HTTP/1.1\r\n\r\n")
        assert (await reader.read()).startswith(b"HTTP/1.1 404")
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
    assert await asyncio.to_thread(healthz.main, ["--port", str(port), "--timeout", "2"]) == 1
    monkeypatch.setenv(healthz.ENV_PORT, "8081")
    assert healthz.port_from_env() == 8081
    monkeypatch.setenv(healthz.ENV_PORT, "http")
    with pytest.raises(ValueError, match="MUSTER_HEALTH_PORT"):
        healthz.port_from_env()
    monkeypatch.delenv(healthz.ENV_PORT)
    assert healthz.port_from_env() is None
