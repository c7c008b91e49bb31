"""The SDK's report to the kube agent's endpoint (MUSTER_REPORT_URL): retried while the agent
is unreachable or answers 5xx, a refusal raised, the other routes used when it cannot be
reached at all."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agents import sdk

ENV = {"MUSTER_JOB_ID": "job-1", "MUSTER_ATTEMPT": "2", "MUSTER_CHECKPOINT_TOKEN": "tok"}


class Agent(ThreadingHTTPServer):
    """Answers each POST with the next (status, body) of `answers`; records the bodies."""

    def __init__(self, answers: list[tuple[int, dict[str, object]]]) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.answers = answers
        self.bodies: list[dict[str, object]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/checkpoint"


class Handler(BaseHTTPRequestHandler):
    server: Agent

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        self.server.bodies.append(json.loads(self.rfile.read(length)))
        status, body = self.server.answers.pop(0)
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def agent(request: pytest.FixtureRequest) -> Iterator[Agent]:
    server = Agent(list(request.param))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    yield server
    server.shutdown()
    thread.join(5)
    server.server_close()


def _checkpointer(**env: str) -> sdk.Checkpointer:
    return sdk.Checkpointer(sdk.SdkEnv.from_env({**ENV, **env}))


@pytest.mark.parametrize("agent", [[(503, {}), (200, {"recorded": True})]], indirect=True)
def test_a_5xx_is_retried_and_the_report_carries_the_attempt_and_token(agent: Agent) -> None:
    ck = _checkpointer(MUSTER_REPORT_URL=agent.url, MUSTER_CHECKPOINT_URI="s3://c/attempt-2")
    assert ck.report_checkpoint(30) == "http"
    assert len(agent.bodies) == 2
    assert agent.bodies[-1] == {
        "job_id": "job-1",
        "attempt": 2,
        "step": 30,
        "uri": "s3://c/attempt-2/step-30",
        "token": "tok",
    }


@pytest.mark.parametrize(
    "agent", [[(409, {"error": "job job-1 attempt 2 was moved"})]], indirect=True
)
def test_a_refusal_is_raised_with_the_agents_reason_and_not_retried(
    agent: Agent, tmp_path: Path
) -> None:
    ck = _checkpointer(
        MUSTER_REPORT_URL=agent.url, MUSTER_ANNOTATION_FILE=str(tmp_path / "ckpt.json")
    )
    with pytest.raises(sdk.CheckpointRefused, match=r"409.*attempt 2 was moved") as info:
        ck.report_checkpoint(30)
    assert info.value.status == 409 and len(agent.bodies) == 1
    assert not (tmp_path / "ckpt.json").exists()  # no other route for a refused report


def test_an_unreachable_agent_falls_back_to_the_annotation_file(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ckpt.json"
    ck = _checkpointer(
        MUSTER_REPORT_URL=f"http://127.0.0.1:{port}/v1/checkpoint",
        MUSTER_ANNOTATION_FILE=str(out),
    )
    assert ck.report_checkpoint(12, "s3://c/12", timeout=2.0) == "file"
    assert json.loads(out.read_text())["step"] == 12


def test_a_report_url_that_is_no_url_is_refused_at_start() -> None:
    with pytest.raises(sdk.SdkConfigError, match="MUSTER_REPORT_URL"):
        sdk.SdkEnv.from_env({"MUSTER_REPORT_URL": "muster-agent-report:8470"})
