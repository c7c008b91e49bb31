"""The kube agent's checkpoint report endpoint (agents/kube/report.py): a pod's report with its
attempt's token becomes the same CheckpointReport the annotation route makes; everything else
is a 4xx that says what was wrong and changes nothing."""

from __future__ import annotations

import asyncio
import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client

from agents import sdk
from agents.kube.backend import KubeBackend
from agents.kube.config import build_workload
from agents.kube.report import REPORT_PATH, Refused, ReportBody, decode_report
from agents.metrics import AgentMetrics
from agents.runtime import AgentRuntime
from kinds.base import ANN_CHECKPOINT, ANN_TOKEN_DIGEST
from kinds.pods import token_digest
from schemas.agent import CheckpointReport
from tests.kube.conftest import (
    NS,
    PODS,
    Recorder,
    caught_up,
    gang_dispatch,
    make_config,
    manifest_dispatch,
)
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.scheduling import pods_from_template

JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"
TOKEN = "t0k-attempt-1"


def _env(job: dict[str, Any]) -> dict[str, str]:
    container = job["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", "") for e in container["env"]}


async def _started(
    make_backend: Any, apiserver: FakeApiServer
) -> tuple[KubeBackend, Recorder, dict[str, Any]]:
    """A backend that ran the Dispatch of job-1 attempt 1 (a 2-replica Job, returned) with
    its token."""
    backend, rec = await make_backend()
    cmd = msgspec.structs.replace(gang_dispatch("job-1", 1), checkpoint_token=TOKEN)
    await backend.dispatch(cmd)
    job = apiserver.get(f"{JOBS}/job-1-a1-worker")
    assert job is not None
    return backend, rec, job


async def _post(url: str, body: bytes) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp,
    ):
        return resp.status, await resp.json(content_type=None)


def _report(**fields: Any) -> bytes:
    body = {"job_id": "job-1", "attempt": 1, "step": 100, "uri": "s3://c/step-100"}
    return json.dumps({**body, "token": TOKEN, **fields}).encode()


async def test_pods_get_the_endpoint_and_only_their_own_report_is_taken(
    make_backend: Any, apiserver: FakeApiServer
) -> None:
    backend, rec, job = await _started(make_backend, apiserver)
    env = _env(job)
    url = env["MUSTER_REPORT_URL"]
    assert backend.report_url == url and url.endswith(REPORT_PATH)
    assert env["MUSTER_CHECKPOINT_TOKEN"] == TOKEN

    refusals = {
        "no token": (_report(token=""), 401, "MUSTER_CHECKPOINT_TOKEN"),
        "wrong token": (_report(token="guess"), 403, "not the one of job job-1 attempt 1"),
        "attempt not here": (_report(attempt=7), 404, "job-1 attempt 7 does not run"),
        "not JSON": (b"step=100", 400, "not valid JSON"),
        "unknown field": (_report(stepp=1), 400, "stepp"),
        "negative step": (_report(step=-1), 400, "step"),
        "empty uri": (_report(uri=""), 400, "uri"),
        "too large": (_report(uri="x" * 9000), 413, "over 8192 bytes"),
    }
    for why, (body, status, text) in refusals.items():
        got, answer = await _post(url, body)
        assert (got, text in answer.get("error", "")) == (status, True), (why, answer)
    assert rec.of(CheckpointReport) == []  # no refusal changed anything

    status, answer = await _post(url, _report())
    assert (status, answer["recorded"]) == (200, True)
    await rec.wait_for(lambda: rec.of(CheckpointReport))
    (report,) = rec.of(CheckpointReport)
    assert (report.job_id, report.attempt, report.step, report.uri) == (
        "job-1",
        1,
        100,
        "s3://c/step-100",
    )
    assert report.token == ""  # the agent vouches for it; the token never leaves the cluster

    # An older step, by either route, is no news: one owner decides what is newer.
    status, answer = await _post(url, _report(step=90))
    assert (status, answer["recorded"]) == (200, False)
    pods = pods_from_template(job["spec"]["template"], 1, "job-1-a1-worker", NS)
    pods[0]["metadata"]["annotations"][ANN_CHECKPOINT] = json.dumps({"step": 95, "uri": "u"})
    apiserver.put(PODS, pods[0])
    await caught_up(apiserver, backend)
    assert [r.step for r in rec.of(CheckpointReport)] == [100]

    # Once the attempt is cancelled (moved elsewhere), its own token no longer reports.
    await backend.cancel("job-1", 1, "moved")
    status, answer = await _post(url, _report(step=200))
    assert status == 409 and "cancelled or moved" in answer["error"]
    assert [r.step for r in rec.of(CheckpointReport)] == [100]


async def test_answers_are_counted_in_the_agents_metrics(
    make_backend: Any, apiserver: FakeApiServer, nc: Client
) -> None:
    backend, _, _ = await _started(make_backend, apiserver)
    assert backend.report_url is not None
    for body in (_report(), _report(token="guess"), _report(token="guess")):
        await _post(backend.report_url, body)
    registry = AgentMetrics(lambda: {"c1": AgentRuntime(backend, nc)}).registry

    def answered(status: str) -> float | None:
        labels = {"cluster": "c1", "status": status}
        return registry.get_sample_value("muster_agent_checkpoint_reports_total", labels)

    assert (answered("200"), answered("403"), answered("404")) == (1, 2, None)


async def test_the_sdk_posts_with_the_pods_env_and_raises_a_refusal(
    make_backend: Any, apiserver: FakeApiServer
) -> None:
    _, rec, job = await _started(make_backend, apiserver)
    env = _env(job)
    ck = sdk.Checkpointer(sdk.SdkEnv.from_env(env))
    assert await asyncio.to_thread(ck.report_checkpoint, 40) == "http"
    await rec.wait_for(lambda: rec.of(CheckpointReport))
    assert rec.of(CheckpointReport)[0].uri == ck.checkpoint_uri(40)
    forged = sdk.Checkpointer(sdk.SdkEnv.from_env({**env, "MUSTER_CHECKPOINT_TOKEN": "x"}))
    with pytest.raises(sdk.CheckpointRefused, match=r"403.*not the one of job job-1"):
        await asyncio.to_thread(forged.report_checkpoint, 41)


async def test_an_agent_restarted_since_the_dispatch_checks_the_token_its_pods_carry(
    make_backend: Any, apiserver: FakeApiServer
) -> None:
    first, _, job = await _started(make_backend, apiserver)
    for p in pods_from_template(job["spec"]["template"], 2, "job-1-a1-worker", NS):
        p["spec"]["nodeName"] = "n1"
        p["status"] = {"phase": "Running"}
        assert ANN_TOKEN_DIGEST in p["metadata"]["annotations"]
        assert TOKEN not in json.dumps(p["metadata"])  # only its digest is readable there
        apiserver.put(PODS, p)
    await first.stop()
    second, rec = await make_backend()  # no Dispatch reaches this one
    url = second.report_url
    assert url is not None
    assert (await _post(url, _report(token="guess")))[0] == 403
    status, _ = await _post(url, _report(step=7))
    assert status == 200
    await rec.wait_for(lambda: [r.step for r in rec.of(CheckpointReport)] == [7])


async def test_a_taken_port_leaves_the_agent_running_without_the_endpoint(
    make_backend: Any,
) -> None:
    first, _ = await make_backend()
    assert first.report_server is not None
    port = first.report_server.port
    second, _ = await make_backend(
        report={"listen_host": "127.0.0.1", "listen_port": port, "url": ""}
    )
    assert second.report_url is None
    await second.dispatch(gang_dispatch("job-2", 1))  # pods then get no MUSTER_REPORT_URL


async def test_an_attempt_dispatched_without_a_token_takes_no_report(make_backend: Any) -> None:
    backend, rec = await make_backend()
    await backend.dispatch(gang_dispatch("job-1", 1))  # a broker that sends no token
    assert backend.report_url is not None
    status, answer = await _post(backend.report_url, _report())
    assert status == 403 and "dispatched without a checkpoint token" in answer["error"]
    assert rec.of(CheckpointReport) == []


async def test_a_body_that_never_arrives_gets_408_and_garbage_stops_nothing(
    make_backend: Any, apiserver: FakeApiServer
) -> None:
    backend, rec = await make_backend(
        report={"listen_host": "127.0.0.1", "listen_port": 0, "url": "", "timeout_s": 0.3}
    )
    await backend.dispatch(
        msgspec.structs.replace(gang_dispatch("job-1", 1), checkpoint_token=TOKEN)
    )
    assert backend.report_server is not None
    port = backend.report_server.port

    async def exchange(data: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(data)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(4096), 5)
        writer.close()
        return answer

    slow = b"POST /v1/checkpoint HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n{"
    assert (await exchange(slow)).startswith(b"HTTP/1.1 408")
    junk = [b"\x00\xff" * 64 + b"\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"POST /v1/checkpoint\r\n"]
    for data in junk:
        answer = await exchange(data)
        assert answer == b"" or re.match(rb"HTTP/1\.[01] 4\d\d ", answer), answer  # refused
    assert backend.report_url is not None
    assert (await _post(backend.report_url, _report()))[0] == 200
    await rec.wait_for(lambda: rec.of(CheckpointReport))


def _templates(obj: object) -> Iterator[dict[str, Any]]:
    """Every pod template (or pod) in an object: a mapping whose `spec` has containers."""
    if isinstance(obj, dict):
        spec = obj.get("spec")
        if isinstance(spec, dict) and isinstance(spec.get("containers"), list):
            yield obj
        for value in obj.values():
            yield from _templates(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _templates(value)


EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "jobs"


@pytest.mark.parametrize(
    "example", sorted(p.stem for p in EXAMPLES.glob("*.yaml") if p.stem != "jobspec")
)
def test_every_replica_of_every_kind_gets_the_endpoint_with_a_token_only(example: str) -> None:
    text = (EXAMPLES / f"{example}.yaml").read_text()
    forged = yaml.safe_load(text)
    for t in _templates(forged):  # an author cannot choose the digest the agent checks
        t.setdefault("metadata", {}).setdefault("annotations", {})[ANN_TOKEN_DIGEST] = "f" * 64
    cmd = manifest_dispatch(yaml.safe_dump(forged))
    cfg = make_config()
    url = "http://muster-agent-report.muster-system.svc:8470/v1/checkpoint"
    for token, expected in ((TOKEN, url), ("", None)):
        plan = build_workload(
            msgspec.structs.replace(cmd, checkpoint_token=token),
            cfg.flavors[0],
            NS,
            config=cfg,
            report_url=url,
        )
        templates = [t for o in plan.objects for t in _templates(o.body)]
        assert templates, example
        for t in templates:
            digest = t["metadata"]["annotations"].get(ANN_TOKEN_DIGEST)
            assert digest == (token_digest(TOKEN) if token else None), example
            for c in t["spec"]["containers"]:
                env = {e["name"]: e.get("value") for e in c["env"]}
                assert env.get("MUSTER_REPORT_URL") == expected, (example, c["name"])


def test_the_shipped_default_is_the_service_on_its_port() -> None:
    cfg = make_config(report={}).report
    assert cfg.enabled and cfg.listen_port == 8470
    assert cfg.url == "http://muster-agent-report.muster-system.svc:8470"
    with pytest.raises(Exception, match="must start with http"):
        make_config(report={"url": "muster-agent-report:8470"})


# -- the decoder never fails on any input but with a 400 -----------------------------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
_fields = st.fixed_dictionaries(
    {},
    optional={
        "job_id": st.text(max_size=300) | _json_values,
        "attempt": st.integers(min_value=-5, max_value=2**40) | _json_values,
        "step": st.integers(min_value=-5, max_value=2**64) | _json_values,
        "uri": st.text(max_size=2100) | _json_values,
        "token": st.text(max_size=200) | _json_values,
        "extra": _json_values,
    },
)


def _json_or_none(body: bytes) -> object:
    """The body as strict JSON (no NaN or Infinity, which Python's json takes), else None."""

    def no_constant(name: str) -> object:
        raise ValueError(name)

    try:
        return json.loads(body, parse_constant=no_constant)
    except ValueError:
        return None


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.binary(max_size=400) | _fields.map(lambda d: json.dumps(d).encode()))
def test_decoder_answers_any_body_with_a_report_or_a_400(body: bytes) -> None:
    try:
        report = decode_report(body)
    except Refused as exc:
        assert exc.status == 400 and exc.message.startswith("bad checkpoint report")
        if isinstance(_json_or_none(body), dict):  # an object: the answer names the field
            assert "not valid JSON" not in exc.message, exc.message
        return
    assert isinstance(report, ReportBody)
    assert report.step >= 0 and report.attempt >= 1 and 1 <= len(report.uri) <= 2048
    assert decode_report(msgspec.json.encode(report)) == report


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    st.text(min_size=1, max_size=253) | st.just("j" * 253),
    st.integers(min_value=1, max_value=2**31),
    st.integers(min_value=0, max_value=2**62),
    st.text(min_size=1, max_size=2048) | st.just("s3://" + "u" * 2043),
)
def test_decoder_takes_every_valid_report(job: str, attempt: int, step: int, uri: str) -> None:
    body = {"job_id": job, "attempt": attempt, "step": step, "uri": uri, "token": TOKEN}
    report = decode_report(json.dumps(copy.deepcopy(body)).encode())
    assert msgspec.to_builtins(report) == body
