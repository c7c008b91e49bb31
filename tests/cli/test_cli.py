"""The `muster` CLI: argument errors, help, formatting, and the client commands end to end
against the real broker and a fake cluster on a real nats-server."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import msgspec
import pytest
from rich.console import Console
from typer.testing import Result

from broker.embedded import free_port
from broker.render import (
    clusters_table,
    event_line,
    fmt_ago,
    job_detail,
    jobs_table,
    queues_table,
    submit_line,
    why_view,
)
from muster.cli import app
from schemas.api import (
    ClusterView,
    JobEvent,
    JobView,
    PendingReason,
    QueueView,
    ReasonBound,
    SubmitReply,
    WhyView,
)
from schemas.jsonschema import render
from tests.cli.live_broker import BLOCKER, runner
from tests.support import wait_for
from tests.world import ThreadedWorld, World

from .conftest import FIXTURES
from .samples import NOW, sample_cluster, sample_job, sample_queue

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def text_of(renderable: object) -> str:
    console = Console(width=200, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


# -- help and argument errors ------------------------------------------------------------


COMMANDS = [
    "submit",
    "status",
    "cancel",
    "why",
    "queues",
    "clusters",
    "watch",
    "broker",
    "agent",
    "fleet",
    "config",
    "schema",
]


def test_help_lists_every_command() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in COMMANDS:
        assert command in result.stdout


def test_version_and_completion() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.startswith("muster ")
    text = runner.invoke(app, ["--help"]).stdout
    assert "--install-completion" in text and "--show-completion" in text


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help(command: str) -> None:
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.stderr
    assert "<str>" not in result.stdout and "{" not in result.stdout.splitlines()[0]
    if command in ("submit", "status", "cancel", "why", "queues", "clusters", "watch"):
        for flag in ("--nats", "--creds", "--user", "--password", "--tls-ca", "--tls-cert"):
            assert flag in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["submit"], "Missing argument"),
        (["cancel"], "Missing argument"),
        (["status", "--output", "xml"], "'xml' is not one of 'table', 'json'"),
        (["status", "--state", "sleeping"], "Invalid value for '--state'"),
        (["status", "--limit", "0"], "Invalid value for '--limit'"),
        (["agent"], "Missing option '--config'"),
        (["frobnicate"], "No such command"),
    ],
)
def test_usage_errors(args: list[str], message: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert message in result.stderr


def one_error_line(result: Result, exit_code: int = 1) -> str:
    """A user error: exit 1, one line on stderr, no traceback."""
    assert result.exit_code == exit_code, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.stderr
    return lines[0]


def test_submit_missing_file() -> None:
    line = one_error_line(runner.invoke(app, ["submit", "nope.yaml"]))
    assert line == "error: nope.yaml: cannot read the job file: No such file or directory"


def test_submit_invalid_job_file(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: a\ngang: [{name: w, gpu: 65}]\n")
    line = one_error_line(runner.invoke(app, ["submit", str(path)]))
    assert "gang[0].gpu: Expected `int` <= 64" in line


def test_nats_option_errors(tmp_path: Path) -> None:
    line = one_error_line(runner.invoke(app, ["queues", "--tls-key", "k.pem"]))
    assert "--tls-key needs --tls-cert" in line
    line = one_error_line(runner.invoke(app, ["queues", "--creds", str(tmp_path / "x.creds")]))
    assert "x.creds: file not found" in line


def test_unreachable_nats() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    line = one_error_line(runner.invoke(app, ["queues", "--nats", url]))
    assert f"cannot reach NATS at {url}" in line
    assert "start it with `muster broker`" in line


def test_server_commands_report_bad_configs(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("queues:\n  - name: ML\n")
    line = one_error_line(runner.invoke(app, ["broker", "--config", str(bad)]))
    assert "queues[0].name" in line
    line = one_error_line(runner.invoke(app, ["agent", "--config", str(tmp_path / "no.yaml")]))
    assert "no.yaml" in line
    line = one_error_line(runner.invoke(app, ["fleet", "--config", str(tmp_path / "no.yaml")]))
    assert "no.yaml" in line
    line = one_error_line(
        runner.invoke(app, ["broker", "--creds", "x.creds"]),
    )
    assert "need --nats URL" in line


# -- operator helpers --------------------------------------------------------------------


def test_schema_prints_the_json_schema() -> None:
    result = runner.invoke(app, ["schema"])
    assert result.exit_code == 0
    assert result.stdout == render()
    assert "JobSpec" in json.loads(result.stdout)["$defs"]


def test_config_check() -> None:
    result = runner.invoke(app, ["config", str(EXAMPLES / "broker.yaml")])
    assert result.exit_code == 0, result.stderr
    assert "name: ml-cluster-queue" in result.stdout
    assert "queue_aliases:" in result.stdout
    assert "note: " in result.stderr  # what the Kueue import assumed
    result = runner.invoke(app, ["config", str(EXAMPLES / "volcano-queues.yaml"), "-o", "json"])
    data = json.loads(result.stdout)
    assert data["queues"][0]["quotas"][0]["resources"]["cpu"]["nominal"] == 64_000


# -- formatting --------------------------------------------------------------------------


def test_jobs_table() -> None:
    text = text_of(jobs_table([sample_job(), sample_job("train-2", "queued")], now=NOW))
    header, first, second = text.strip().splitlines()
    assert header.split() == [
        "JOB",
        "NAME",
        "QUEUE",
        "STATE",
        "GPUS",
        "ATTEMPT",
        "WHERE",
        "SUBMITTED",
        "REASON",
    ]
    assert first.split()[:7] == ["train-1", "train", "ml", "running", "16", "2", "gcp-west/a100-od"]
    assert "2.0h ago" in first
    assert second.split()[3] == "queued"


def test_job_detail() -> None:
    text = text_of(job_detail(sample_job(), now=NOW))
    assert "attempt    2 on gcp-west/a100-od" in text
    # attempt 1 was preempted on spot, attempt 2 resumed from step 1000
    lines = [line.split() for line in text.splitlines()]
    one = next(line for line in lines if line[:2] == ["1", "aws-east"])
    two = next(line for line in lines if line[:2] == ["2", "gcp-west"])
    assert "preempted" in one and "spot" in one
    assert two[two.index("step") : two.index("step") + 2] == ["step", "1000"]
    assert (
        "accounting  attempts 2, preemptions 1, errors 0, GPU-hours used 30.22, lost 1.33, "
        "goodput 96%, cost $190.00" in text
    )
    assert "checkpoint  step 1200 at s3://ckpt/train/1200, 1m ago, attempt 2" in text


def test_job_detail_shows_an_elastic_jobs_size() -> None:
    size = "worker runs 3 of 8 replicas (min 2; grows back when its pool has room)"
    job = msgspec.structs.replace(sample_job(), size=size)
    assert f"elastic    {size}" in text_of(job_detail(job, now=NOW))
    assert "elastic" not in text_of(job_detail(sample_job(), now=NOW))


def test_job_detail_without_attempts() -> None:
    job = JobView(
        job_id="j", name="j", queue="q", state="queued", priority=0, submitted_at=NOW, gpus=8
    )
    text = text_of(job_detail(job, now=NOW))
    assert "checkpoint  none yet" in text
    assert "attempts" not in text.split("accounting")[0]


def test_markup_in_server_text_is_printed_as_is() -> None:
    job = msgspec.structs.replace(sample_job(), reason="[bold]quota[/bold] exceeded")
    assert "[bold]quota[/bold] exceeded" in text_of(jobs_table([job], now=NOW))
    assert "[bold]quota[/bold] exceeded" in text_of(job_detail(job, now=NOW))


def test_why_view() -> None:
    why = WhyView(
        job_id="j",
        state="queued",
        position=0,
        reasons=[
            PendingReason(code="quota", message="8 of 8 GPUs in use", flavor="a100-od"),
            PendingReason(code="capacity", message="no node has 8 free", cluster="c", flavor="f"),
        ],
    )
    text = text_of(why_view(why))
    assert "j is queued, position 0 in its queue (at the head)" in text
    assert "[quota] a100-od: 8 of 8 GPUs in use" in text
    assert "[capacity] c/f: no node has 8 free" in text
    full = WhyView(
        job_id="j",
        state="queued",
        position=2,
        queue="ml",
        waiting_for="quota",
        candidates=[
            PendingReason(
                code="quota-exceeded",
                message="quota ml gpu 8/8 used, needs 16 > 4 left of nominal 8 + borrow 4",
                cluster="east",
                flavor="a100-od",
            ),
            PendingReason(
                code="no-matching-flavor", message="no T4 accepted", cluster="c", flavor="t4-spot"
            ),
        ],
    )
    lines = text_of(why_view(full)).splitlines()
    assert lines[0] == "j is queued, position 2 in queue ml (2 ahead of it)"
    assert lines[1] == "waiting for: quota"
    rows = [line.strip().split(None, 2) for line in lines if line.startswith(("east", "c/"))]
    assert rows == [
        [
            "east/a100-od",
            "quota-exceeded",
            "quota ml gpu 8/8 used, needs 16 > 4 left of nominal 8 + borrow 4",
        ],
        ["c/t4-spot", "no-matching-flavor", "no T4 accepted"],
    ]
    bound = msgspec.structs.replace(
        full.candidates[0], bound=ReasonBound(resource="gpu", used=8, needed=16, limit=12)
    )
    lines = text_of(why_view(msgspec.structs.replace(full, candidates=[bound]))).splitlines()
    assert [line.split(None, 3)[:3] for line in lines if line.startswith("east")] == [
        ["east/a100-od", "quota-exceeded", "gpu"]
    ]
    assert "gpu 8+16>12" in next(line for line in lines if line.startswith("east"))


def test_why_view_prints_the_cost_of_work() -> None:
    price = "expected cost of work: best c/a $8 per unit of work (A100 at 2.2x, $17.6/h)"
    why = WhyView(job_id="j", state="queued", position=0, waiting_for="capacity", work_price=price)
    lines = text_of(why_view(why)).splitlines()
    assert lines[1:3] == ["waiting for: capacity", price]
    running = text_of(why_view(WhyView(job_id="j", state="running")))
    assert "nothing holds it back" in running


def test_queues_table() -> None:
    text = text_of(
        queues_table([sample_queue(), QueueView("free", None, "StrictFIFO", 1.0, unlimited=True)])
    )
    assert "a100-od: gpu 12/8 +4, cpu 32/64, memory 64Gi/256Gi" in text
    assert "no quota (unlimited)" in text
    assert "50%" in text


def test_clusters_table() -> None:
    text = text_of(clusters_table([sample_cluster(), ClusterView("gone", "lost")], now=NOW))
    rows = [line.split() for line in text.strip().splitlines()[1:]]
    assert rows[0][:5] == ["aws-east", "healthy", "1s", "ago", "4"]
    assert rows[0][5:12] == ["a100-spot", "spot", "a100", "1.10", "20", "24/160", "1"]
    assert " ".join(rows[0][12:]) == "0.610/node-h, 7 observed ok"  # dispatch breaker: ok
    assert rows[1][:3] == ["a100-od", "on-demand", "a100"]  # same cluster, second flavor
    assert rows[1][-2:] == ["-", "ok"]  # on-demand: nothing observed, no prior
    assert rows[2][:2] == ["gone", "lost"]
    stale = ClusterView("blind", "healthy", NOW - 1, stale_s=75.0)
    assert "healthy, stale 75s" in text_of(clusters_table([stale], now=NOW))
    fresh = msgspec.structs.replace(
        sample_cluster().flavors[0],
        interruptions=0,
        interruption_rate_per_node_hour=0.31,
        interruption_prior=0.5,
    )
    text = text_of(clusters_table([ClusterView("new", "healthy", flavors=[fresh])], now=NOW))
    assert "prior 0.5/node-h, 0 observed" in text.splitlines()[1]
    tripped = msgspec.structs.replace(
        fresh, breaker="open", breaker_failures=3, breaker_reason="circuit open after 3"
    )
    text = text_of(clusters_table([ClusterView("bad", "healthy", flavors=[tripped])], now=NOW))
    assert text.splitlines()[1].rstrip().endswith("open: circuit open after 3")
    grown = msgspec.structs.replace(
        fresh, nodes=1, autoscale_max_nodes=8, nodes_coming=2, stockouts=1.4
    )
    text = text_of(clusters_table([ClusterView("grow", "healthy", flavors=[grown])], now=NOW))
    assert "1 +2 of 8, 1.4 stockouts" in text.splitlines()[1]


def test_event_line() -> None:
    ev = JobEvent(
        job_id="j",
        kind="requeued",
        at=NOW,
        state="queued",
        attempt=2,
        cluster="aws",
        flavor="spot",
        reason="preempted",
        resume_from_step=1000,
    )
    text = event_line(ev).plain
    assert text.endswith("requeued     attempt 2 on aws/spot resuming from step 1000 (preempted)")
    long = msgspec.structs.replace(ev, kind="checkpointed", step=7, resume_from_step=None)
    assert "checkpointed attempt 2 on aws/spot step 7" in event_line(long).plain


def test_submit_line_and_ages() -> None:
    assert submit_line(SubmitReply(accepted=True, job_id="j"), "q") == "submitted job j to queue q"
    assert "already submitted" in submit_line(
        SubmitReply(accepted=True, job_id="j", duplicate=True), "q"
    )
    assert fmt_ago(None, NOW) == "-"
    assert fmt_ago(NOW - 30, NOW) == "30s ago"
    assert fmt_ago(NOW - 90 * 60, NOW) == "1.5h ago"
    assert fmt_ago(NOW - 3 * 86400, NOW) == "3.0d ago"


# -- end to end against the real broker ---------------------------------------------------


def cli(world: World, *args: str) -> Result:
    return runner.invoke(app, [*args, "--nats", world.harness.url])


def test_submit_status_cancel_end_to_end(live: tuple[ThreadedWorld, World]) -> None:
    threaded, world = live
    # ml's whole quota goes to a job that runs all along: what comes next waits, with a reason.
    result = runner.invoke(
        app, ["submit", "-", "--nats", world.harness.url], input=json.dumps(BLOCKER)
    )
    assert result.exit_code == 0, result.stderr
    threaded.call(world.harness.wait_event("blocker", "running"))
    manifest = str(FIXTURES / "pytorchjob-ddp-mnist.yaml")
    result = cli(world, "submit", manifest, "--queue", "ml", "--job-id", "mnist-1")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == "submitted job mnist-1 to queue ml"
    view = threaded.call(world.job("mnist-1"))
    assert view["spec"]["workload"]["kind"] == "manifest"
    assert view["gpus"] == 6

    result = cli(world, "submit", manifest, "--queue", "ml", "--job-id", "mnist-1", "-o", "json")
    assert msgspec.json.decode(result.stdout, type=SubmitReply).duplicate

    result = cli(world, "status")
    assert "mnist-1" in result.stdout and "queued" in result.stdout

    result = cli(world, "status", "-o", "json", "--state", "queued")
    jobs = msgspec.json.decode(result.stdout, type=list[JobView])
    assert [j.job_id for j in jobs] == ["mnist-1"]

    result = cli(world, "status", "mnist-1")
    assert "gang       master x1 (2 gpu, 8 cpu, 32Gi), worker x2" in result.stdout

    async def quota_bound() -> bool:  # once a scheduling cycle has looked at the job
        why = await world.harness.api("why", {"job_id": "mnist-1"})
        return any(r["code"] == "quota-exceeded" for r in why["result"]["reasons"])

    threaded.call(wait_for(quota_bound, what="a quota reason"))
    result = cli(world, "why", "mnist-1")
    assert "[quota-exceeded]" in result.stdout and "queue ml" in result.stdout

    result = cli(world, "cancel", "mnist-1", "--reason", "done")
    assert result.stdout.strip() == "job mnist-1 is cancelled"

    # watch of an ended job: prints where it stands and exits 0 (it has ended) ...
    result = cli(world, "watch", "mnist-1")
    assert result.exit_code == 0, result.stderr
    (line,) = result.stdout.strip().splitlines()
    assert "now cancelled" in line and "(done)" in line
    # ... unless asked to fail for any end but success
    assert cli(world, "watch", "mnist-1", "--exit-status").exit_code == 1

    line = one_error_line(cli(world, "status", "ghost"))
    assert line == "error: unknown job 'ghost'"


def test_submit_jobspec_from_stdin(live: tuple[ThreadedWorld, World]) -> None:
    _, world = live
    body = {"name": "stdin-job", "queue": "ml", "gang": [{"name": "w", "gpu": 1}]}
    result = runner.invoke(
        app, ["submit", "-", "--nats", world.harness.url, "-o", "json"], input=json.dumps(body)
    )
    assert result.exit_code == 0, result.stderr
    reply = msgspec.json.decode(result.stdout, type=SubmitReply)
    assert reply.accepted and reply.job_id and reply.job_id.startswith("stdin-job-")


def test_queues_and_clusters(live: tuple[ThreadedWorld, World]) -> None:
    _, world = live
    result = cli(world, "queues")
    assert result.exit_code == 0, result.stderr
    assert "a100-od: gpu 0/8" in result.stdout
    result = cli(world, "clusters", "-o", "json")
    (cluster,) = msgspec.json.decode(result.stdout, type=list[ClusterView])
    assert cluster.name == "c1" and cluster.health == "healthy"
    assert [(f.name, f.gpu_total, f.gpu_free) for f in cluster.flavors] == [("a100-od", 16, 16)]


def test_watch_follows_a_job_to_its_end(live: tuple[ThreadedWorld, World]) -> None:
    threaded, world = live
    job_id = f"w-{uuid.uuid4().hex[:6]}"
    sim = {"total_steps": 20, "steps_per_second": 20.0, "checkpoint_every": 10}
    body = {
        "name": "w",
        "job_id": job_id,
        "queue": "ml",
        "gang": [{"name": "w", "gpu": 1}],
        "workload": {"simulate": sim},
    }
    submitted = runner.invoke(
        app, ["submit", "-", "--nats", world.harness.url], input=json.dumps(body)
    )
    assert submitted.exit_code == 0, submitted.stderr
    result = cli(world, "watch", job_id, "-o", "json")
    assert result.exit_code == 0, result.stderr
    events = [msgspec.json.decode(line, type=JobEvent) for line in result.stdout.splitlines()]
    threaded.call(world.harness.wait_event(job_id, "succeeded"))
    everything = [e.kind for e in world.harness.events[job_id]]
    # What the watch printed is the tail of the job's events, up to its end.
    assert events and events[-1].kind == "succeeded"
    assert [e.kind for e in events] == everything[len(everything) - len(events) :]


def test_submit_a_multi_document_file_sends_one_job_each(
    live: tuple[ThreadedWorld, World],
) -> None:
    """A Kueue pod group and a JobSet in one file: two submissions, both ids printed."""
    path = Path(__file__).parents[1] / "kube" / "fixtures" / "pod-group.yaml"
    threaded, world = live
    result = cli(world, "submit", str(path), "--queue", "default", "-o", "json")
    assert result.exit_code == 0, result.stderr
    replies = msgspec.json.decode(result.stdout, type=list[SubmitReply])
    assert len(replies) == 2 and all(r.accepted for r in replies)
    group = threaded.call(world.job(replies[0].job_id or ""))["spec"]
    assert sum(p.get("replicas", 1) for p in group["gang"]) == 3
    result = cli(world, "submit", str(path), "--queue", "default")
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("submitted job ") for line in lines)
