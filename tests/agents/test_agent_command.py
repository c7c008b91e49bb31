"""`muster agent` runs its fleet with the cycle collector paced: the kube agent's node and pod
cache is walked by every full collector pass otherwise (shell/gcpacing.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import agents.cli
import agents.fleet
from agents.config import AgentConfig
from muster.cli import app

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent-fake.yaml"


def test_the_agent_command_runs_its_fleet_with_the_collector_paced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, Any] = {}

    async def run_fleet(configs: list[AgentConfig], *args: object, pace_gc: bool = False) -> None:
        seen["clusters"] = [c.cluster for c in configs]
        seen["pace_gc"] = pace_gc

    def serve(main: Coroutine[Any, Any, None]) -> None:
        asyncio.run(main)

    monkeypatch.setattr(agents.fleet, "run_fleet", run_fleet)
    monkeypatch.setattr(agents.fleet, "until_signal", lambda main: main)
    monkeypatch.setattr(agents.cli, "serve", serve)
    result = CliRunner().invoke(
        app, ["agent", "--config", str(EXAMPLE), "--nats", "nats://127.0.0.1:4222"]
    )
    assert result.exit_code == 0, result.output
    assert seen == {"clusters": ["fake-east"], "pace_gc": True}
