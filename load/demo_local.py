"""`make demo-local`: the spot story with real processes and real training, in about 30 s.

An embedded nats-server, the broker and two `local` agents (`lab-east`, the cheaper spot slot
group, and `lab-west`) start on 127.0.0.1. One job runs `examples/sgd_train.py`, pure-Python
SGD, as a local process. Halfway through, `lab-east` gets a spot notice: the broker asks the
trainer for a checkpoint, stops it, and starts it on `lab-west` from that step. The trainer's
own log lines show the loss continuing across the move; at the end its final model is compared,
bit for bit, with a run of the same seed that was never interrupted.

    python -m load.demo_local [--steps N] [--workdir DIR]

Exit code 0 when the job succeeded and the two final models are identical.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import nats
import typer
from nats.aio.client import Client

from agents.config import AgentConfig, LocalClusterConfig, LocalFlavor, LocalNode
from agents.fleet import Fleet, start_fleet
from broker.embedded import EmbeddedNats
from broker.service import Broker
from load.command import program, summary
from schemas.api import JobEvent
from schemas.codec import decode_job_event, decode_submit_reply, encode_json
from schemas.config import BrokerConfig, QueueConfig, Timeouts
from schemas.subjects import Subjects
from shell.logs import configure_logging
from shell.natsio import submit_request

PREFIX = "muster"
TRAINER = Path(__file__).resolve().parents[1] / "examples" / "sgd_train.py"
HARD_CAP_S = 120.0  # the whole run, start to exit
TAIL_S = 0.1
CHECKPOINT_EVERY = 50
STEP_TIME_S = 0.02
AGENTS = (("lab-east", 1.0), ("lab-west", 1.4))  # name, spot price per GPU-hour


@dataclass
class DemoResult:
    succeeded: bool = False
    identical: bool = False
    resumed_from: int | None = None
    clusters: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 0 if self.succeeded and self.identical else 1


def broker_config() -> BrokerConfig:
    return BrokerConfig(
        subject_prefix=PREFIX,
        queues=[QueueConfig(name="default")],
        timeouts=Timeouts(
            heartbeat_s=0.5,
            unreachable_after_s=1.5,
            lost_after_s=6.0,
            fence_lead_s=2.0,
            dispatch_ack_s=2.0,
            start_s=30.0,
            checkpoint_grace_s=10.0,
            lease_ttl_s=10.0,
        ),
    )


def agent_configs(workdir: Path) -> list[AgentConfig]:
    return [
        AgentConfig(
            cluster=name,
            backend="local",
            heartbeat_s=0.5,
            subject_prefix=PREFIX,
            local=LocalClusterConfig(
                workdir=str(workdir / "agents"),
                flavors=[
                    LocalFlavor(
                        name="spot",
                        capacity_type="spot",
                        price_per_gpu_hour=price,
                        nodes=[LocalNode(gpu=1)],
                        grace_s=5.0,
                    )
                ],
            ),
        )
        for name, price in AGENTS
    ]


def trainer_args(steps: int) -> list[str]:
    return ["--steps", str(steps), "--checkpoint-every", str(CHECKPOINT_EVERY)]


def job_spec(workdir: Path, steps: int) -> dict[str, Any]:
    return {
        "name": "sgd",
        "gang": [{"name": "worker", "replicas": 1, "gpu": 1}],
        "capacity": "spot",
        "checkpoint": {"uri": str(workdir / "checkpoints")},
        "workload": {
            "command": [sys.executable, str(TRAINER)],
            "args": [*trainer_args(steps), "--step-time", str(STEP_TIME_S)],
        },
    }


def reference_model(workdir: Path, steps: int) -> str:
    """The same trainer and seed, run straight through outside Muster."""
    out = workdir / "uninterrupted"
    env = {**os.environ, "MUSTER_CHECKPOINT_URI": str(out)}
    subprocess.run(
        [sys.executable, str(TRAINER), *trainer_args(steps)],
        env=env,
        capture_output=True,
        timeout=60,
        check=True,
    )
    return (out / f"step-{steps}").read_text()


class LogTail:
    """New lines of one replica's log since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def lines(self) -> list[str]:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # only whole lines
        self.offset += end
        return data[:end].decode(errors="replace").splitlines()


async def _submit(nc: Client, spec: dict[str, Any]) -> str:
    msg = await submit_request(nc, Subjects(prefix=PREFIX).submit("default"), encode_json(spec), 10)
    reply = decode_submit_reply(msg.data)
    if not reply.accepted or reply.job_id is None:
        raise RuntimeError(f"submit refused: {reply.error}")
    return reply.job_id


async def _story(
    fleet: Fleet, nc: Client, workdir: Path, steps: int, say: Callable[[str], None]
) -> DemoResult:
    result = DemoResult()
    events: list[JobEvent] = []
    changed = asyncio.Event()

    async def on_event(msg: Any) -> None:
        events.append(decode_job_event(msg.data))
        changed.set()

    subjects = Subjects(prefix=PREFIX)
    await nc.subscribe(subjects.job_events_all, cb=on_event)
    job_id = await _submit(nc, job_spec(workdir, steps))
    say(f"submitted job {job_id}: examples/sgd_train.py, {steps} steps, spot capacity")
    tails: dict[tuple[str, int], LogTail] = {}
    seen = 0
    notice_at = (steps // 2 // CHECKPOINT_EVERY) * CHECKPOINT_EVERY or CHECKPOINT_EVERY
    noticed = False
    while True:
        for ev in events[seen:]:
            seen += 1
            say(_event_line(ev))
            if ev.kind == "admitted" and ev.cluster is not None:
                result.clusters.append(ev.cluster)
                if ev.resume_from_step is not None:
                    result.resumed_from = ev.resume_from_step
                log = fleet.local[ev.cluster].log_path(job_id, ev.attempt, 0)
                tails[(ev.cluster, ev.attempt)] = LogTail(log)
            if ev.kind in ("succeeded", "failed", "cancelled"):
                result.succeeded = ev.kind == "succeeded"
                for (cluster, attempt), tail in tails.items():
                    for line in tail.lines():
                        say(f"  {cluster} attempt {attempt} | {line}")
                return result
        for (cluster, attempt), tail in tails.items():
            for line in tail.lines():
                say(f"  {cluster} attempt {attempt} | {line}")
                if not noticed and line.startswith(f"checkpoint step {notice_at} "):
                    noticed = True
                    backend = fleet.local[cluster]
                    node = backend.nodes_of("spot")[0]
                    backend.spot_notice(node, lead_s=30)
                    say(f">> spot notice on {node}: reclaimed in 30 s (SIGTERM, then SIGKILL)")
        changed.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(TAIL_S):
                await changed.wait()


def _event_line(ev: JobEvent) -> str:
    where = f" on {ev.cluster}" if ev.cluster else ""
    extra = ""
    if ev.resume_from_step is not None:
        extra = f", resuming from step {ev.resume_from_step}"
    if ev.reason:
        extra += f" ({ev.reason})"
    return f"[broker] {ev.kind} attempt {ev.attempt}{where}{extra}"


async def run_demo(workdir: Path, steps: int, say: Callable[[str], None] = print) -> DemoResult:
    """The whole demo in this process (the test calls it)."""
    async with asyncio.timeout(HARD_CAP_S):
        server = await EmbeddedNats().start()
        clients: list[Client] = []
        broker: Broker | None = None
        task: asyncio.Task[None] | None = None
        fleet: Fleet | None = None
        try:
            say(f"embedded nats-server on {server.url}; work directory {workdir}")
            clients = [await nats.connect(server.url) for _ in range(3)]
            broker = Broker(broker_config(), clients[0])
            task = asyncio.create_task(broker.run())
            await broker.leading.wait()
            fleet = await start_fleet(clients[1], agent_configs(workdir))
            for name, price in AGENTS:
                say(f"local agent {name}: one spot slot group, ${price:.2f}/GPU-h")
            result = await _story(fleet, clients[2], workdir, steps, say)
        finally:
            if fleet is not None:
                await fleet.stop()
            if broker is not None and task is not None:
                await broker.stop()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(task, 15)
            for nc in clients:
                with contextlib.suppress(Exception):
                    await nc.close()
            await server.stop()
            server.cleanup()
    # Each attempt writes below its own prefix (checkpoints/attempt-<n>/): the last one's.
    finals = sorted(
        (workdir / "checkpoints").glob(f"attempt-*/step-{steps}"),
        key=lambda p: int(p.parent.name.removeprefix("attempt-")),
    )
    final = finals[-1] if finals else workdir / "checkpoints" / f"step-{steps}"
    if result.succeeded and final.exists():
        t0 = time.monotonic()
        reference = reference_model(workdir, steps)
        result.identical = final.read_text() == reference
        verdict = "identical, bit for bit" if result.identical else "DIFFERENT"
        say(
            f"final model vs. an uninterrupted run of the same seed "
            f"({time.monotonic() - t0:.1f} s to recompute): {verdict}"
        )
    return result


app = program()


@app.command(help=summary(__doc__))
def demo_local(
    steps: Annotated[
        int,
        typer.Option(
            min=100, help="training steps (at least 100: the notice comes after a checkpoint)"
        ),
    ] = 400,
    workdir: Annotated[Path | None, typer.Option(help="keep files here")] = None,
) -> None:
    raise typer.Exit(_run(steps, workdir))


def _run(steps: int, workdir: Path | None) -> int:
    configure_logging("error")  # the broker and agents log for operators; the demo narrates
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="muster-")))
        try:
            result = asyncio.run(run_demo(workdir.resolve(), steps))
        except KeyboardInterrupt:
            return 130
        except (RuntimeError, TimeoutError, subprocess.SubprocessError) as exc:
            print(f"demo failed: {exc}", file=sys.stderr)
            return 1
    return result.exit_code


if __name__ == "__main__":
    app(prog_name="python -m load.demo_local")
