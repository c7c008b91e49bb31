"""Real training through Muster: a real nats-server, the real broker, two `local` agents and
the pure-Python SGD trainer. A spot notice moves the job; it resumes from the exact saved step
and ends with the same model, bit for bit, as a run never interrupted. A restarted agent
adopts its replicas; one gone too long has them fenced before the job starts elsewhere."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.local.conftest import PY, REPO, Lab, group_alive

SGD = REPO / "examples" / "sgd_train.py"
STEPS = 300


@dataclass
class Reference:
    final: str  # the last checkpoint file, byte for byte
    losses: set[str]  # its `step N loss X` lines


def reference_run(tmp: Path, steps: int = STEPS) -> Reference:
    """The same trainer and seed, never interrupted, outside Muster."""
    env = {**os.environ, "MUSTER_CHECKPOINT_URI": str(tmp / "reference")}
    env.pop("MUSTER_RESUME_FROM", None)
    out = subprocess.run(
        [PY, str(SGD), "--steps", str(steps), "--checkpoint-every", "50"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return Reference((tmp / "reference" / f"step-{steps}").read_text(), loss_lines(out.stdout))


def loss_lines(log: str) -> set[str]:
    return {ln for ln in log.splitlines() if ln.startswith("step ")}


def sgd_job(name: str, ckpt: Path, *, step_time: float = 0.01) -> dict[str, Any]:
    return {
        "name": name,
        "gang": [{"name": "worker", "replicas": 1, "gpu": 1}],
        "capacity": "spot",
        "checkpoint": {"uri": str(ckpt)},
        "restart": {"backoff_s": 0.1},
        "workload": {
            "command": [PY, str(SGD)],
            "args": [
                "--steps",
                str(STEPS),
                "--checkpoint-every",
                "50",
                "--step-time",
                str(step_time),
            ],
        },
    }


async def test_spot_notice_moves_real_training_and_it_ends_bit_for_bit_equal(lab: Lab) -> None:
    reference = reference_run(lab.tmp)
    await lab.start()
    h = lab.harness
    ckpt = lab.tmp / "ckpt"
    job_id = (await h.submit(sgd_job("sgd", ckpt))).job_id
    first = await h.wait_event(job_id, "admitted", timeout=15)
    assert first.cluster == "a"  # the cheaper spot pool
    await lab.broker_has_checkpoint(job_id, 100)
    a = lab.backend("a")
    pids = a.pids(job_id, 1)
    a.spot_notice(a.nodes_of("spot")[0], lead_s=30)
    second = await h.wait_event(job_id, "admitted", count=2, timeout=20)
    assert second.cluster == "b"
    saved = second.resume_from_step
    assert saved is not None and saved > 100  # saved on request, not the one the broker had
    assert f"checkpoint step {saved} " in lab.log("a", job_id, 1)
    await h.wait_event(job_id, "succeeded", timeout=60)
    resumed = lab.log("b", job_id, 2)
    # each attempt writes below its own prefix; the second resumes from the first's checkpoint
    assert resumed.startswith(f"resumed from step {saved} ({ckpt}/attempt-1/step-{saved})")
    assert f"checkpoint step {saved} " not in resumed  # no step before it was redone
    assert (ckpt / "attempt-2" / f"step-{STEPS}").read_text() == reference.final
    # The loss curve continues where it left off: every step logged after the move logs
    # the loss the uninterrupted run had at that step.
    after = loss_lines(resumed)
    assert f"step {STEPS} loss" in "".join(after) and after <= reference.losses
    assert loss_lines(lab.log("a", job_id, 1)) <= reference.losses
    assert not any(group_alive(p) for p in pids)  # the first copy is gone
    assert [e.kind for e in h.events[job_id]].count("admitted") == 2


async def test_a_restarted_agent_adopts_its_replica_and_the_job_finishes_once(lab: Lab) -> None:
    reference = reference_run(lab.tmp)
    fleet = await lab.start()
    h = lab.harness
    ckpt = lab.tmp / "ckpt"
    job_id = (await h.submit(sgd_job("adopt", ckpt, step_time=0.02))).job_id
    await lab.log_has("a", job_id, 1, "checkpoint step 50 ")
    pids = lab.backend("a").pids(job_id, 1)
    await fleet.runtimes["a"].stop()  # the agent goes away; the replica keeps training
    assert all(group_alive(p) for p in pids)
    await lab.restart_agent("a")  # back well before the broker would declare it lost
    await h.wait_event(job_id, "succeeded", timeout=60)
    assert [e.kind for e in h.events[job_id]].count("admitted") == 1
    assert (ckpt / "attempt-1" / f"step-{STEPS}").read_text() == reference.final


async def test_an_agent_gone_too_long_has_its_replica_fenced_before_the_job_moves(
    lab: Lab,
) -> None:
    reference = reference_run(lab.tmp)
    fleet = await lab.start()
    h = lab.harness
    ckpt = lab.tmp / "ckpt"
    job_id = (await h.submit(sgd_job("fence", ckpt, step_time=0.03))).job_id
    await lab.broker_has_checkpoint(job_id, 50)
    pids = lab.backend("a").pids(job_id, 1)
    await fleet.runtimes["a"].stop()
    second = await h.wait_event(job_id, "admitted", count=2, timeout=30)
    assert second.cluster == "b"
    assert not any(group_alive(p) for p in pids)  # fenced before the broker moved the job
    assert "fence lapsed" in lab.log("a", job_id, 1)
    restarted = await lab.restart_agent("a")
    await h.wait_event(job_id, "succeeded", timeout=60)
    assert restarted.live_workloads() == []
    assert (ckpt / "attempt-2" / f"step-{STEPS}").read_text() == reference.final
    resumed = lab.log("b", job_id, 2)
    assert second.resume_from_step is not None and second.resume_from_step >= 50
    assert resumed.startswith(f"resumed from step {second.resume_from_step} ")


async def test_a_partitioned_agent_fences_its_processes_before_the_job_moves(lab: Lab) -> None:
    fleet = await lab.start()
    h = lab.harness
    job_id = (await h.submit(sgd_job("cut", lab.tmp / "ckpt", step_time=0.03))).job_id
    await lab.broker_has_checkpoint(job_id, 50)
    pids = lab.backend("a").pids(job_id, 1)
    fleet.runtimes["a"].set_partitioned(True)  # alive, but no word reaches the broker
    second = await h.wait_event(job_id, "admitted", count=2, timeout=30)
    assert second.cluster == "b"
    assert not any(group_alive(p) for p in pids)  # the fence lapsed and the launcher killed them
    assert lab.backend("a").live_workloads() == []
    endings = lab.backend("a").history[job_id]
    assert any(str(e.get("reason", "")).startswith("fenced") for e in endings), endings
    fleet.runtimes["a"].set_partitioned(False)
    await h.wait_event(job_id, "succeeded", timeout=60)


async def test_a_bad_command_fails_the_job_with_its_exit_code_and_log(lab: Lab) -> None:
    await lab.start()
    h = lab.harness
    bad = sgd_job("bad", lab.tmp / "bad")
    bad["workload"] = {"command": ["/no/such/trainer"], "args": ["--fast"]}
    bad["restart"] = {"max_restarts_on_error": 0}
    bad_id = (await h.submit(bad)).job_id
    failed = await h.wait_event(bad_id, "failed", timeout=20)
    assert failed.reason is not None
    assert "127" in failed.reason and "cannot run '/no/such/trainer'" in failed.reason
    # The broker carries on: the next job runs to the end on the same capacity.
    good_id = (await h.submit(sgd_job("good", lab.tmp / "good", step_time=0))).job_id
    await h.wait_event(good_id, "succeeded", timeout=30)
