"""Liveness and readiness over HTTP on 127.0.0.1, for the broker's and the agent's probes.

Kept beside the wire schemas because both processes use it and may import nothing else in
common. It binds the loopback address only, so the Deployments probe it with `exec`
(`python -m schemas.healthz --port P --path /readyz`) rather than from the kubelet's network:

* `GET /livez`: 200 while the event loop answers (a stuck loop times the probe out);
* `GET /readyz`: 200 when `ready()` is true (connected to NATS), else 503.

`MUSTER_HEALTH_PORT` in the environment turns it on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable

ENV_PORT = "MUSTER_HEALTH_PORT"
_MAX_REQUEST = 8192


def port_from_env() -> int | None:
    raw = os.environ.get(ENV_PORT, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise ValueError(f"{ENV_PORT}={raw!r}: give a TCP port number from 1 to 65535")
    return int(raw)


def _response(code: int, text: str) -> bytes:
    reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[code]
    body = text.encode()
    head = (
        f"HTTP/1.1 {code} {reason}\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


async def serve(port: int, ready: Callable[[], bool], host: str = "127.0.0.1") -> asyncio.Server:
    """Start answering probes; close the returned server to stop."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5)
            parts = line[:_MAX_REQUEST].decode("latin-1").split()
            path = parts[1] if len(parts) >= 2 else ""
            if path == "/livez":
                writer.write(_response(200, "ok\n"))
            elif path == "/readyz":
                ok = ready()
                writer.write(_response(200 if ok else 503, "ok\n" if ok else "not ready\n"))
            else:
                writer.write(_response(404, "try /livez or /readyz\n"))
            await writer.drain()
        except (TimeoutError, ConnectionError, UnicodeDecodeError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    return await asyncio.start_server(handle, host, port)


def main(argv: list[str] | None = None) -> int:
    """The exec probe: exit 0 when the endpoint answers 200 within the timeout."""
    parser = argparse.ArgumentParser(prog="python -m schemas.healthz")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--path", default="/livez", choices=["/livez", "/readyz"])
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    url = f"http://127.0.0.1:{args.port}{args.path}"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as resp:
            return 0 if resp.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
