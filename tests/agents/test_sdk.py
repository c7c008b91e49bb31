"""Checkpoint SDK: environment parsing, the annotation file, SIGTERM, and NATS both ways."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client

from agents.sdk import (
    ANNOTATION,
    Checkpointer,
    SdkConfigError,
    SdkEnv,
    annotation_value,
    parse_resume_from,
)
from schemas.agent import CheckpointNow, CheckpointRef, CheckpointReport
from shell.natsio import flush
from tests.agents.helpers import unique
from tests.support import wait_for_sync


def test_env_parsing() -> None:
    env = SdkEnv.from_env(
        {
            "MUSTER_JOB_ID": "job-1",
            "MUSTER_ATTEMPT": "3",
            "MUSTER_CHECKPOINT_URI": "s3://b/job-1/",
            "MUSTER_RESUME_FROM": '{"step": 40, "uri": "s3://b/job-1/step-40"}',
            "MUSTER_NATS_URL": "nats://127.0.0.1:4222",
            "MUSTER_SUBJECT_PREFIX": "acme.muster",
            "MUSTER_ANNOTATION_FILE": "/tmp/x",
        }
    )
    assert (env.job_id, env.attempt, env.subject_prefix) == ("job-1", 3, "acme.muster")
    assert env.resume_from == CheckpointRef(step=40, uri="s3://b/job-1/step-40")
    assert env.resume_step == 40
    ck = Checkpointer(env)
    assert ck.checkpoint_uri(50) == "s3://b/job-1/step-50"
    assert ck.nats_enabled
    assert ck.subjects.checkpoint("job-1") == "acme.muster.checkpoint.job-1"


def test_empty_env_is_a_fresh_local_run() -> None:
    env = SdkEnv.from_env({})
    assert env.job_id is None and env.resume_from is None and env.resume_step == 0
    ck = Checkpointer(env)
    assert not ck.nats_enabled
    assert ck.report_checkpoint(5) == "none"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", None),
        ("   ", None),
        ("s3://b/j/step-120", CheckpointRef(step=120, uri="s3://b/j/step-120")),
        ("s3://b/j/latest", CheckpointRef(step=0, uri="s3://b/j/latest")),
        ('{"step": 7, "uri": "gs://x"}', CheckpointRef(step=7, uri="gs://x")),
    ],
)
def test_parse_resume_from(text: str, expected: CheckpointRef | None) -> None:
    assert parse_resume_from(text) == expected


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"MUSTER_ATTEMPT": "two"}, "MUSTER_ATTEMPT"),
        ({"MUSTER_ATTEMPT": "0"}, "MUSTER_ATTEMPT"),
        ({"MUSTER_JOB_ID": "a.b"}, "MUSTER_JOB_ID"),
        ({"MUSTER_RESUME_FROM": '{"step": "x"}'}, "MUSTER_RESUME_FROM"),
        ({"MUSTER_SUBJECT_PREFIX": "a..b"}, "MUSTER_SUBJECT_PREFIX"),
        ({"MUSTER_SIGTERM_GRACE_S": "soon"}, "MUSTER_SIGTERM_GRACE_S"),
    ],
)
def test_bad_env_names_the_variable(env: dict[str, str], needle: str) -> None:
    with pytest.raises(SdkConfigError, match=needle):
        SdkEnv.from_env(env)


def test_annotation_file(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "ckpt.json"
    ck = Checkpointer(
        SdkEnv(job_id="j", attempt=1, checkpoint_uri="s3://b/j", annotation_file=str(target))
    )
    assert ck.report_checkpoint(30) == "file"
    named = {"job_id": "j", "attempt": 1}  # the attempt that wrote it
    assert json.loads(target.read_text()) == {"step": 30, "uri": "s3://b/j/step-30", **named}
    assert ck.report_checkpoint(40, "s3://elsewhere") == "file"
    assert json.loads(target.read_text()) == {"step": 40, "uri": "s3://elsewhere", **named}
    assert annotation_value(1, "u") == '{"step":1,"uri":"u"}'
    assert ANNOTATION == "muster.dev/checkpoint"
    assert [p.name for p in target.parent.iterdir()] == ["ckpt.json"]  # no temp files left
    with pytest.raises(ValueError):
        ck.report_checkpoint(-1)


def test_sigterm_maps_to_checkpoint_request() -> None:
    ck = Checkpointer(SdkEnv(job_id="j", attempt=2, sigterm_grace_s=12))
    seen: list[CheckpointNow] = []
    before = signal.getsignal(signal.SIGTERM)
    try:
        ck.on_checkpoint_request(seen.append)
        os.kill(os.getpid(), signal.SIGTERM)
        assert ck.wait_for_request(2)
        assert ck.sigterm_received
        assert seen and (seen[0].job_id, seen[0].attempt) == ("j", 2)
        ck.clear_request()
        assert not ck.requested
    finally:
        ck.close()
    assert signal.getsignal(signal.SIGTERM) == before


async def test_report_over_nats(nc: Client, nats_url: str) -> None:
    job = unique("j")
    got: asyncio.Queue[bytes] = asyncio.Queue()

    async def on(msg: object) -> None:
        await got.put(msg.data)  # type: ignore[attr-defined]

    sub = await nc.subscribe(f"muster.checkpoint.{job}", cb=on)
    await flush(nc)
    env = SdkEnv.from_env(
        {
            "MUSTER_JOB_ID": job,
            "MUSTER_ATTEMPT": "4",
            "MUSTER_CHECKPOINT_URI": f"s3://b/{job}",
            "MUSTER_NATS_URL": nats_url,
        }
    )
    ck = Checkpointer(env)
    try:
        assert await asyncio.to_thread(ck.report_checkpoint, 100) == "nats"
        report = msgspec.json.decode(await asyncio.wait_for(got.get(), 5), type=CheckpointReport)
        assert (report.job_id, report.attempt, report.step) == (job, 4, 100)
        assert report.uri == f"s3://b/{job}/step-100" and report.at > 0
    finally:
        await asyncio.to_thread(ck.close)
        await sub.unsubscribe()


def test_example_training_loop_checkpoints_on_sigterm(tmp_path: Path) -> None:
    """The example loop, as a real process: SIGTERM -> checkpoint written -> clean exit."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    ann = tmp_path / "annotation.json"
    env = {
        **os.environ,
        "PYTHONPATH": str(root),
        "MUSTER_JOB_ID": "demo",
        "MUSTER_ATTEMPT": "1",
        "MUSTER_CHECKPOINT_URI": str(tmp_path / "ckpt"),
        "MUSTER_RESUME_FROM": '{"step": 500, "uri": "x"}',
        "MUSTER_ANNOTATION_FILE": str(ann),
    }
    env.pop("MUSTER_NATS_URL", None)
    proc = subprocess.Popen(
        [sys.executable, str(root / "examples" / "train_with_sdk.py")],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert "starting at step 500" in proc.stdout.readline()
        # Its periodic checkpoint proves the loop is past the resume step (~1 s of steps).
        assert "checkpoint at step 500 -> file" in proc.stdout.readline()
        assert "checkpoint at step 600 -> file" in proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    value = json.loads(ann.read_text())
    assert value["step"] >= 600 and value["uri"].endswith(f"step-{value['step']}")


def test_kube_env_resume_step_overrides() -> None:
    env = SdkEnv.from_env(
        {"MUSTER_RESUME_FROM": "s3://b/j/ckpt-latest", "MUSTER_RESUME_STEP": "250"}
    )
    assert env.resume_from == CheckpointRef(step=250, uri="s3://b/j/ckpt-latest")
    assert SdkEnv.from_env({"MUSTER_RESUME_STEP": "3"}).resume_from is None
    with pytest.raises(SdkConfigError, match="MUSTER_RESUME_STEP"):
        SdkEnv.from_env({"MUSTER_RESUME_FROM": "u", "MUSTER_RESUME_STEP": "x"})


def test_podinfo_annotations_file_maps_to_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from agents import sdk

    ann = tmp_path / "annotations"
    ann.write_text('muster.dev/job-id="j"\n')
    assert sdk.read_checkpoint_request(ann) is None
    assert sdk.read_checkpoint_request(tmp_path / "missing") is None
    reads = [0]
    read = sdk.read_checkpoint_request

    def counted(path: str | os.PathLike[str]) -> float | None:
        reads[0] += 1
        return read(path)

    def polls_after(n: int) -> None:
        """Wait until the poller has read the file twice more: one whole poll after now."""
        wait_for_sync(lambda: reads[0] >= n + 2, 5, what="two more podinfo polls")

    monkeypatch.setattr(sdk, "read_checkpoint_request", counted)
    env = SdkEnv(job_id="j", attempt=1, podinfo_dir=str(tmp_path), podinfo_poll_s=0.02)
    ck = Checkpointer(env)
    seen: list[CheckpointNow] = []
    try:
        ck.on_checkpoint_request(seen.append, sigterm=False)
        polls_after(reads[0])
        assert not ck.requested
        deadline = time.time() + 60
        ann.write_text(f'muster.dev/job-id="j"\nmuster.dev/checkpoint-request="{deadline:.3f}"\n')
        assert ck.wait_for_request(2)
        assert len(seen) == 1 and abs(seen[0].deadline - deadline) < 0.01
        polls_after(reads[0])
        assert len(seen) == 1  # the same request is delivered once
    finally:
        ck.close()
