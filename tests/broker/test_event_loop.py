"""`muster broker --event-loop uvloop` (or MUSTER_EVENT_LOOP=uvloop) runs the broker on
uvloop and it serves as on asyncio; asking for uvloop where it is not installed is a one-line
error that says how to install it."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from nats.aio.client import Client

from load.common import BrokerProcess
from schemas.codec import decode_submit_reply, encode_json
from schemas.config import BrokerConfig, QueueConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_the_broker_runs_and_admits_on_the_loop_asked_for(
    loop: str, nats_url: str, nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("uvloop")
    monkeypatch.setenv("MUSTER_EVENT_LOOP", loop)
    config = BrokerConfig(subject_prefix=f"l{uuid.uuid4().hex[:8]}", queues=[QueueConfig(name="q")])
    broker = BrokerProcess(nats_url, config)
    broker.start()
    try:
        stats = await broker.wait_leading(nc)
        assert stats["event_loop"] == loop
        job = {"name": "j", "job_id": "on-" + loop, "gang": [{"name": "w", "gpu": 1}]}
        msg = await nc.request(broker.subjects.submit("q"), encode_json(job), timeout=10)
        reply = decode_submit_reply(msg.data)
        assert reply.accepted and reply.job_id == "on-" + loop, reply
        assert (await broker.stats(nc))["pending"] == 1
    finally:
        broker.cleanup()


def test_uvloop_not_installed_is_an_error_that_says_how_to_install_it() -> None:
    # The import of uvloop fails as it does where the extra is not installed.
    program = (
        "import sys; sys.modules['uvloop'] = None; from muster.cli import main; "
        "main(['broker', '--event-loop', 'uvloop', '--nats', 'nats://127.0.0.1:1'])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    assert "uvloop is not installed" in proc.stderr
    assert "pip install 'muster[uvloop]'" in proc.stderr
    assert "Traceback" not in proc.stderr
