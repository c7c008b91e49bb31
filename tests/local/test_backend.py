"""The local backend's process lifecycle: environment, working directories, logs, verdicts
from exit codes, cancel, spot reclaim with SIGTERM then SIGKILL, fencing, and adoption of
replicas a previous agent left running."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from agents.backend import BackendError
from agents.config import BambooTrace
from agents.local.backend import LocalBackend
from schemas.agent import CheckpointRef, CheckpointReport, LogRequest, NodeGone, SpotNotice
from tests.local.conftest import PY, Recorder, dispatch, group_alive, local_config, wait_dead

DUMP_ENV = (
    "import json, os; "
    "keys = [k for k in os.environ if k.startswith(('MUSTER_', 'MASTER_')) or k in "
    "('WORLD_SIZE', 'RANK', 'LOCAL_RANK', 'MY_SETTING')]; "
    "json.dump({k: os.environ[k] for k in keys}, open('env.json', 'w')); "
    "print('replica', os.environ['RANK'], 'says hello')"
)
SLEEP = [PY, "-c", "import time; time.sleep(120)"]
IGNORE_TERM = [
    PY,
    "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('armed', "
    "flush=True); time.sleep(120)",
]


async def test_replicas_get_the_env_contract_own_dirs_and_logs(
    started: Any, tmp_path: Path
) -> None:
    b, rec = await started(local_config(tmp_path))
    nodes = ["lab-slots-0", "lab-slots-0", "lab-slots-1"]
    cmd = dispatch(
        "envjob",
        [PY, "-c", DUMP_ENV],
        nodes,
        attempt=3,
        env={"MY_SETTING": "on", "RANK": "99"},
        checkpoint_uri=str(tmp_path / "ckpt"),
        resume=CheckpointRef(step=40, uri=str(tmp_path / "ckpt" / "step-40")),
    )
    await b.dispatch(cmd)
    end = await rec.ended("envjob")
    assert end.phase == "succeeded", end.reason
    assert end.exit_codes == [0, 0, 0] and end.total_replicas == 3
    assert rec.phases("envjob")[0] == "created"
    envs = [
        json.loads((b.attempt_dir("envjob", 3) / f"rank-{r}" / "env.json").read_text())
        for r in range(3)
    ]
    port = envs[0]["MASTER_PORT"]
    assert int(port) > 0
    for rank, env in enumerate(envs):
        assert env["RANK"] == str(rank)  # Muster's rank wins over the job's own env
        assert env["WORLD_SIZE"] == "3" and env["MASTER_ADDR"] == "127.0.0.1"
        assert env["MASTER_PORT"] == port  # one rendezvous per attempt
        assert env["MUSTER_JOB_ID"] == "envjob" and env["MUSTER_ATTEMPT"] == "3"
        assert env["MUSTER_CHECKPOINT_URI"] == str(tmp_path / "ckpt")
        assert env["MUSTER_RESUME_FROM"].endswith("step-40")
        assert env["MUSTER_RESUME_STEP"] == "40"
        assert env["MY_SETTING"] == "on"
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0"]  # per slot group
    for rank in range(3):
        log = b.log_path("envjob", 3, rank).read_text()
        assert f"replica {rank} says hello" in log
    # `muster logs` reads the same files, named by podset and replica, after the attempt ended.
    logs = await b.read_logs(LogRequest(job_id="envjob", attempt=3, tail_lines=10))
    assert logs.ended
    assert [ln for ln in logs.lines if "says hello" in ln] == [
        f"[worker-{r}] replica {r} says hello" for r in range(3)
    ]
    one = await b.read_logs(LogRequest(job_id="envjob", attempt=3, replica=1))
    assert one.lines == ["[worker-1] replica 1 says hello"]
    with pytest.raises(BackendError, match="never ran on cluster"):
        await b.read_logs(LogRequest(job_id="envjob", attempt=9))
    verdict = json.loads((b.attempt_dir("envjob", 3) / "verdict.json").read_text())
    assert verdict["phase"] == "succeeded"
    # The next attempt gets its own port (a fresh rendezvous).
    await b.dispatch(dispatch("envjob", [PY, "-c", DUMP_ENV], nodes[:1], attempt=4))
    await rec.wait(lambda: rec.phases("envjob").count("succeeded") == 2)
    env4 = json.loads((b.attempt_dir("envjob", 4) / "rank-0" / "env.json").read_text())
    assert env4["WORLD_SIZE"] == "1" and env4["MUSTER_RESUME_FROM"] == ""


async def test_a_command_that_does_not_exist_fails_with_its_code_and_log(
    started: Any, tmp_path: Path
) -> None:
    b, rec = await started(local_config(tmp_path))
    await b.dispatch(dispatch("nope", ["/no/such/trainer", "--fast"], ["lab-slots-0"]))
    end = await rec.ended("nope")
    assert end.phase == "failed" and end.exit_codes == [127]
    assert "code 127" in end.reason and "cannot run '/no/such/trainer'" in end.reason
    assert b.live_workloads() == []


async def test_a_command_that_exits_at_once_reports_the_last_log_lines(
    started: Any, tmp_path: Path
) -> None:
    b, rec = await started(local_config(tmp_path))
    script = "import sys; print('loading data'); print('bad learning rate: -1'); sys.exit(3)"
    await b.dispatch(dispatch("crash", [PY, "-c", script], ["lab-slots-0"]))
    end = await rec.ended("crash")
    assert end.phase == "failed" and end.exit_codes == [3]
    assert "rank 0 exited with code 3" in end.reason
    assert "loading data | bad learning rate: -1" in end.reason
    # Capacity is given back: the same nodes take a new attempt at once.
    await b.dispatch(dispatch("crash", SLEEP, ["lab-slots-0", "lab-slots-0"], attempt=2))


async def test_one_failing_replica_ends_the_whole_gang(started: Any, tmp_path: Path) -> None:
    b, rec = await started(local_config(tmp_path))
    script = (
        "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(4)\ntime.sleep(120)\n"
    )
    await b.dispatch(dispatch("half", [PY, "-c", script], ["lab-slots-0", "lab-slots-1"]))
    pids = b.pids("half", 1)
    end = await rec.ended("half")
    assert end.phase == "failed" and end.exit_codes[1] == 4
    assert end.exit_codes[0] == -signal.SIGKILL  # the survivor was stopped with the gang
    assert "rank 1 exited with code 4" in end.reason
    await wait_dead(pids)


async def test_cancel_kills_the_whole_process_group(started: Any, tmp_path: Path) -> None:
    b, rec = await started(local_config(tmp_path))
    # The replica forks a helper of its own; cancel must take it too.
    script = "import subprocess, sys, time; subprocess.Popen(['sleep', '120']); time.sleep(120)"
    await b.dispatch(dispatch("cx", [PY, "-c", script], ["lab-slots-0"]))
    await rec.wait(lambda: "running" in rec.phases("cx"))
    pids = b.pids("cx", 1)
    t0 = time.monotonic()
    await b.cancel("cx", None, "user asked")
    assert time.monotonic() - t0 < 5
    await wait_dead(pids, timeout=2)
    assert b.live_workloads() == []
    assert not any(s.phase in ("succeeded", "failed") for s in rec.statuses("cx"))
    assert b.history["cx"][0]["phase"] == "cancelled"
    await b.cancel("cx", 1, "again")  # cancelling what is gone is not an error


async def test_spot_reclaim_sigterms_then_kills_replicas_that_ignore_it(
    started: Any, tmp_path: Path
) -> None:
    b, rec = await started(local_config(tmp_path, grace_s=0.5, spot_notice_s=60))
    await b.dispatch(dispatch("stubborn", IGNORE_TERM, ["lab-slots-0"]))
    await b.dispatch(dispatch("polite", SLEEP, ["lab-slots-0"]))
    await b.dispatch(dispatch("elsewhere", SLEEP, ["lab-slots-1"]))
    await rec.wait(lambda: "armed" in b.log_path("stubborn", 1, 0).read_text())
    deadline = b.spot_notice("lab-slots-0", lead_s=0.3)
    assert deadline is not None
    notices = [e for e in rec.events if isinstance(e, SpotNotice)]
    assert [n.node for n in notices] == ["lab-slots-0"] and notices[0].deadline == deadline
    polite = await rec.ended("polite")
    assert polite.phase == "evicted" and polite.reason == "spot-reclaimed"
    stubborn = await rec.ended("stubborn")
    assert stubborn.phase == "evicted"
    assert "ranks [0] ignored SIGTERM and were killed after 0.5s" in stubborn.reason
    assert stubborn.exit_codes == [-signal.SIGKILL]
    assert any(isinstance(e, NodeGone) and e.node == "lab-slots-0" for e in rec.events)
    assert "lab-slots-0" not in b.nodes
    assert b.live_workloads() == [("elsewhere", 1)]  # other nodes are untouched
    with pytest.raises(BackendError, match="not in cluster"):
        await b.dispatch(dispatch("late", SLEEP, ["lab-slots-0"]))
    assert b.add_node("lab-slots-0")


async def test_capacity_and_bad_assignments_are_refused(started: Any, tmp_path: Path) -> None:
    b, _ = await started(local_config(tmp_path, gpu=1))
    await b.dispatch(dispatch("a", SLEEP, ["lab-slots-0"]))
    with pytest.raises(BackendError, match="over-committed: 1 GPUs asked, 0 free"):
        await b.dispatch(dispatch("b", SLEEP, ["lab-slots-0"]))
    with pytest.raises(BackendError, match=r"workload\.command is empty"):
        await b.dispatch(dispatch("c", [], ["lab-slots-1"]))
    assert b.live_workloads() == [("a", 1)]


async def test_checkpoint_requests_and_reports_go_through_the_attempt_files(
    started: Any, tmp_path: Path
) -> None:
    b, rec = await started(local_config(tmp_path))
    script = (
        "from agents.sdk import Checkpointer\n"
        "ck = Checkpointer(); ck.on_checkpoint_request(sigterm=False)\n"
        "print('waiting', flush=True)\n"
        "assert ck.wait_for_request(60)\n"
        "ck.report_checkpoint(17)\n"
    )
    await b.dispatch(dispatch("ck", [PY, "-c", script], ["lab-slots-0"], checkpoint_uri="/c/ck"))
    await rec.wait(lambda: "waiting" in b.log_path("ck", 1, 0).read_text())
    await b.checkpoint_now("ck", 1, time.time() + 30)
    end = await rec.ended("ck")
    assert end.phase == "succeeded", end.reason
    reports = [e for e in rec.events if isinstance(e, CheckpointReport)]
    assert [(r.job_id, r.attempt, r.step, r.uri) for r in reports] == [
        ("ck", 1, 17, "/c/ck/step-17")
    ]
    assert end.step == 17


async def test_a_restarted_agent_adopts_live_replicas_and_reports_ended_ones(
    started: Any, tmp_path: Path
) -> None:
    config = local_config(tmp_path)
    first = LocalBackend("lab", config)
    await first.start(Recorder())
    await first.dispatch(dispatch("long", SLEEP, ["lab-slots-0"]))
    done_soon = [PY, "-c", "import time, sys; time.sleep(0.5); sys.exit(5)"]
    await first.dispatch(dispatch("short", done_soon, ["lab-slots-1"]))
    pids = first.pids("long", 1)
    await first.stop()  # the agent dies; its replicas run on
    await wait_dead(first.pids("short", 1))
    second, rec = await started(config)
    snap = await second.snapshot()
    live = {(w.job_id, w.attempt): w.phase for w in snap.workloads}
    assert live == {("long", 1): "running"}
    short = await rec.ended("short")
    assert short.phase == "failed" and short.exit_codes == [5]  # recorded by the shim
    free = {n.name: n for n in snap.nodes}
    assert "lab-slots-0" in free
    with pytest.raises(BackendError, match="over-committed"):  # the adopted gang holds its slots
        await second.dispatch(dispatch("squeeze", SLEEP, ["lab-slots-0", "lab-slots-0"]))
    await second.cancel("long", 1, "stale attempt")
    await wait_dead(pids, timeout=5)
    third, rec3 = await started(config)  # nothing is adopted or reported twice
    assert (await third.snapshot()).workloads == []
    assert rec3.statuses("short") == []


async def test_replicas_of_a_dead_agent_stop_when_their_fence_lapses(
    started: Any, tmp_path: Path
) -> None:
    config = local_config(tmp_path)
    first = LocalBackend("lab", config)
    await first.start(Recorder())
    await first.dispatch(dispatch("fenced", SLEEP, ["lab-slots-0"], fence_after_s=1.0))
    await first.dispatch(dispatch("unfenced", SLEEP, ["lab-slots-1"]))
    fenced, unfenced = first.pids("fenced", 1), first.pids("unfenced", 1)
    await first.stop()
    await wait_dead(fenced, timeout=10)
    assert all(group_alive(p) for p in unfenced)
    second, rec = await started(config)
    end = await rec.ended("fenced")
    assert end.phase == "evicted" and end.exit_codes == [-signal.SIGKILL]
    assert end.reason.startswith("fenced")
    assert "fence lapsed" in b_log(second, "fenced")
    assert [w.job_id for w in (await second.snapshot()).workloads] == ["unfenced"]


def b_log(b: LocalBackend, job_id: str, attempt: int = 1, rank: int = 0) -> str:
    return b.log_path(job_id, attempt, rank).read_text()


async def test_a_trace_removal_becomes_a_spot_notice_ahead_of_time(
    started: Any, tmp_path: Path
) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("0,add,0\n400,remove,1\n")
    config = local_config(tmp_path, spot_notice_s=0.2)
    config.trace = BambooTrace(path=str(trace), flavor="slots")
    b, rec = await started(config)
    await rec.wait(lambda: any(isinstance(e, SpotNotice) for e in rec.events))
    notice = next(e for e in rec.events if isinstance(e, SpotNotice))
    assert notice.node == "lab-slots-1"
    await rec.wait(lambda: "lab-slots-1" not in b.nodes)  # reclaimed at the trace's time


async def test_a_replica_exiting_0_on_a_cancel_is_not_reported_as_succeeded(
    started: Any, tmp_path: Path
) -> None:
    b, rec = await started(local_config(tmp_path))
    polite = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)\n"
    )
    await b.dispatch(dispatch("bye", [PY, "-c", polite], ["lab-slots-0"]))
    await rec.wait(lambda: "ready" in b_log(b, "bye"))
    await b.cancel("bye", 1, "superseded")
    assert json.loads((b.attempt_dir("bye", 1) / "rank-0.exit").read_text())["code"] == 0
    assert rec.phases("bye") in (["created"], ["created", "running"])
    assert b.history["bye"] == [{"attempt": 1, "phase": "cancelled", "reason": "superseded"}]
