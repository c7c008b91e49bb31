"""The broker's start does not run aiohttp (nats-py needs it only for WebSocket URLs), and a
client on `ws://` still works through the deferred module. A command's parse does not go through
pydantic (Typer 0.29 does, which costs every start ~0.1 s). Each check runs in a fresh
interpreter: deferring is about what a process has imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from broker.embedded import EmbeddedNats, free_port

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_broker_imports_without_running_aiohttp() -> None:
    done = _run(
        """
        import sys
        from shell.lazyimport import defer_unused
        defer_unused()
        import broker.cli_operator, broker.service
        ran = sorted(m for m in sys.modules if m.startswith("aiohttp."))
        print(ran)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_command_parses_its_options_without_pydantic() -> None:
    """`muster config FILE -o json` converts a path and a choice, as every command does."""
    done = _run(
        """
        import sys
        sys.argv = ["muster", "config", "examples/broker.yaml", "--output", "json"]
        from muster.cli import main
        try:
            main()
        except SystemExit as exc:
            assert not exc.code, exc.code
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("pydantic", "typer")))
        """
    )
    assert done.returncode == 0, done.stderr
    imported = done.stdout.strip().splitlines()[-1]
    assert "typer.main" in imported  # the probe ran the command line
    assert "pydantic" not in imported


def test_a_websocket_client_works_with_aiohttp_deferred(tmp_path: Path) -> None:
    ws_port = free_port()
    server = EmbeddedNats(store_dir=tmp_path / "js")
    server.store_dir.mkdir(parents=True)
    conf = tmp_path / "ws.conf"
    server.extra_args = ["-c", str(conf)]  # the last -c is the one read: no JetStream here
    conf.write_text(
        f"listen: 127.0.0.1:{server.port}\n"
        f"websocket {{ listen: 127.0.0.1:{ws_port}\n no_tls: true }}\n"
    )
    server.start_sync()
    try:
        done = _run(
            f"""
            import asyncio
            from shell.lazyimport import defer_unused
            defer_unused()
            import nats

            async def main() -> None:
                nc = await nats.connect("ws://127.0.0.1:{ws_port}", connect_timeout=5)
                sub = await nc.subscribe("hello")
                await nc.publish("hello", b"over websocket")
                msg = await sub.next_msg(timeout=5)
                print(msg.data.decode())
                await nc.close()

            asyncio.run(main())
            """
        )
    finally:
        server.cleanup()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "over websocket"
