"""The virtual-clock simulator: a small deterministic replay of real traces through the Machine.

One 200-job Philly window inside one pass of the Bamboo traces is run once per policy (module
fixture) and every test reads it; the whole file takes a few seconds.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from agents.fake.model import ClusterModel
from broker.core.effects import Send, split_reply
from broker.core.inputs import CYCLE, AgentBatch, Checkpoint, DispatchAcked, SubmitJob
from broker.core.machine import Machine
from broker.core.records import AttemptRecord
from load.report import attempt_losses, comparison, summarize
from load.scenario import apply_scenario, load_scenario
from load.sim import COMPARISON, AttemptLog, Sim, SimResult, main
from load.simconfig import DEFAULT_POOLS, NOTICE_S, SimConfig
from schemas.agent import (
    CheckpointReport,
    ClusterSnapshot,
    Dispatch,
    EventBatch,
    FlavorInfo,
    NodeInfo,
    PodSetAssignment,
    SpotNotice,
    WorkloadStatus,
)
from schemas.config import BrokerConfig, QueueConfig
from schemas.job import CheckpointSpec, JobSpec, PodSet
from tests.load.small_sim import SMALL

TRACE_PASS_H = 11.4  # one pass of bamboo-p3 (g4dn is shorter, 10.6 h)


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[Sim, SimResult]]:
    out = {}
    for policy in ("muster", "scratch"):
        sim = Sim(SMALL, policy)
        out[policy] = (sim, sim.run())
    return out


@pytest.mark.parametrize("policy", ["muster", "scratch"])
def test_every_job_finishes_and_invariants_hold(
    runs: dict[str, tuple[Sim, SimResult]], policy: str
) -> None:
    _, res = runs[policy]
    s = summarize(res)
    # Every job finishes, but spot-only jobs that kept losing their work without a new
    # checkpoint, which give up by the no-progress rule.
    failed = [r for r in res.records.values() if r.state == "failed"]
    assert all(
        r.spec.capacity == "spot" and "no progress on spot" in (r.reason or "") for r in failed
    )
    assert s["completed"] + len(failed) == SMALL.jobs
    assert len(failed) <= 0.05 * SMALL.jobs
    assert res.violations == [], res.violations[:5]
    assert res.batch_errors == []
    # touched jobs after every step, plus full sweeps: several per job (fewer under scratch,
    # whose jobs, none checkpointing, meet fewer reclaims where spot's priced loss is dear)
    assert res.checks > 4 * SMALL.jobs
    assert res.end / 3600.0 < TRACE_PASS_H  # one Bamboo window
    assert s["preemptions"] > 10  # the traces really did reclaim nodes under running gangs
    for r in res.records.values():
        assert sum(1 for a in r.attempts if a.ended_at is None) == 0


def test_scratch_loses_at_least_as_much_as_muster(
    runs: dict[str, tuple[Sim, SimResult]],
) -> None:
    muster = summarize(runs["muster"][1])
    scratch = summarize(runs["scratch"][1])
    assert scratch["gpu_h_lost"] >= muster["gpu_h_lost"]
    assert scratch["gpu_h_used"] >= muster["gpu_h_used"]
    assert muster["goodput"] > scratch["goodput"]
    # Both replay the same jobs on the same spot world (until the sooner one is done).
    until = min(res.end for _, res in runs.values())
    logs = [[n for n in sim.notice_log if n[0] <= until] for sim, _ in runs.values()]
    assert logs[0] == logs[1] and len(logs[0]) > 10


def test_preempted_job_resumes_from_its_checkpointed_step(
    runs: dict[str, tuple[Sim, SimResult]],
) -> None:
    _, res = runs["muster"]
    jobs = {j.job_id: j for j in res.jobs}
    resumed = 0
    for job_id, logs in res.logs.items():
        job = jobs[job_id]
        if res.records[job_id].state == "failed":  # gave up on spot without progress
            continue
        assert logs[-1].succeeded and logs[-1].end_step == job.duration
        assert logs[0].start_step == 0
        written: list[int] = []
        for prev, nxt in itertools.pairwise(logs):
            written += prev.ckpt_steps
            # The next attempt starts exactly at the newest checkpoint any attempt wrote...
            assert nxt.start_step == max(written, default=0), (job_id, prev.attempt)
            # ...which no attempt ran past without: the steps have no gap,
            assert nxt.start_step <= prev.end_step
            # and what was redone is at most one checkpoint interval (a reclaim that came
            # without warning) and, when the notice let it checkpoint first, what it computed
            # while that checkpoint was being written.
            lost = prev.end_step - nxt.start_step
            if prev.ckpt_every is not None and prev.running_at is not None:
                assert lost <= prev.ckpt_every * prev.speed + 1, (job_id, prev.attempt, lost)
                noticed_while_running = (
                    prev.noticed_at is not None and prev.noticed_at >= prev.running_at
                )
                if noticed_while_running and prev.ended_at is not None:
                    assert prev.noticed_at is not None
                    window = max(NOTICE_S.values())
                    if prev.ended_at - prev.noticed_at < window - 1:
                        # moved at the notice: it lost only what it computed while writing
                        assert lost <= job.ckpt_cost + 1, (job_id, prev.attempt, lost)
                    else:
                        # no placement elsewhere: it ran on until its node went, losing at
                        # most what it computed in the window since its newest checkpoint
                        assert lost <= window + job.ckpt_cost + 1, (job_id, prev.attempt, lost)
                if nxt.start_step > 0:
                    resumed += 1
    assert resumed >= 5


@pytest.mark.parametrize("policy", ["muster", "scratch"])
def test_the_clusters_are_the_fake_backends_model(
    runs: dict[str, tuple[Sim, SimResult]], policy: str
) -> None:
    """The attempt logs the report reads agree with each cluster model's own history."""
    sim, res = runs[policy]
    assert sum(len(v) for v in res.logs.values()) > len(res.logs) > 0  # some jobs retried
    for name, agent in sim.clusters.items():
        assert isinstance(agent.model, ClusterModel)
        logs = [log for v in res.logs.values() for log in v if log.cluster == name]
        records = [r for v in agent.model.history.values() for r in v]
        assert agent.model.counters["dispatched"] == len(logs) == len(records)
        assert agent.model.counters["checkpoints"] == sum(len(log.ckpt_steps) for log in logs)
        by_key = {(log.job_id, log.attempt): log for log in logs}
        for job_id, recs in agent.model.history.items():
            for r in recs:
                log = by_key[(job_id, r.attempt)]
                assert r.started_from_step == log.start_step
                assert (r.ended_at is None) == (log.ended_at is None)


def test_scratch_policy_restarts_from_zero(runs: dict[str, tuple[Sim, SimResult]]) -> None:
    _, res = runs["scratch"]
    assert all(log.start_step == 0 and not log.ckpt_steps for v in res.logs.values() for log in v)
    assert all(r.spec.checkpoint is None for r in res.records.values())


def test_lost_gpu_time_matches_the_brokers_accounting(
    runs: dict[str, tuple[Sim, SimResult]],
) -> None:
    for _, res in runs.values():
        s = summarize(res)
        assert s["gpu_h_lost"] == pytest.approx(s["gpu_h_lost_machine"], rel=0.02, abs=0.05)
        end = res.base + res.end
        for logs in res.logs.values():
            for log, lost in zip(logs, attempt_losses(logs, end), strict=True):
                assert 0.0 <= lost <= log.gpu_s(end) + 1e-6


def test_correlated_reclaims_stay_correlated(runs: dict[str, tuple[Sim, SimResult]]) -> None:
    sim, _ = runs["muster"]
    by_time: dict[float, list[str]] = {}
    for t, node in sim.notice_log:
        by_time.setdefault(t, []).append(node)
    same_pool = [
        nodes for nodes in by_time.values() if len({n.rsplit("-", 2)[0] for n in nodes}) == 1
    ]
    assert any(len(nodes) >= 2 for nodes in same_pool)
    notices = dict((node, t) for t, node in sim.notice_log)
    for t, node in sim.reclaim_log:
        assert t == pytest.approx(notices[node] + NOTICE_S["aws"])


def test_same_seed_same_run() -> None:
    cfg = replace(SMALL, jobs=60)
    a = summarize(Sim(cfg, "muster").run())
    b = summarize(Sim(cfg, "muster").run())
    for key in ("completed", "gpu_h_used", "gpu_h_lost", "preemptions", "jct_mean_h", "steps"):
        assert a[key] == b[key], key


def test_poisson_mode_runs_clean() -> None:
    cfg = replace(SMALL, jobs=80, spot="poisson", poisson_rate=2.0)
    res = Sim(cfg, "muster").run()
    s = summarize(res)
    gave_up = [r for r in res.records.values() if r.state == "failed"]
    assert all("no progress on spot" in (r.reason or "") for r in gave_up)
    assert s["completed"] + len(gave_up) == cfg.jobs
    assert res.violations == []
    assert s["noticed_attempts"] > 0


def test_invariant_checker_is_not_vacuous() -> None:
    """Corrupt a copy of the machine's records and the checker must say so."""
    sim = Sim(replace(SMALL, jobs=30), "muster")
    sim.run()
    assert sim.violations == []
    record = next(r for r in sim.machine.jobs.values() if r.attempts)
    last = record.attempts[-1]
    ghost = AttemptRecord(
        attempt=last.attempt + 1,
        cluster=last.cluster,
        flavor="not-" + last.flavor,
        flavor_class="",
        assignment=[
            PodSetAssignment(podset=p.podset, nodes=list(p.nodes)) for p in last.assignment
        ],
        dispatched_at=last.dispatched_at,
    )
    last.ended_at = None
    record.attempts.append(ghost)
    sim.check_all()
    kinds = {v.kind for v in sim.violations}
    assert {"two-live-attempts", "gang-split"} <= kinds


def test_command_line_writes_table_plots_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "img"
    code = main(
        [
            "--jobs", "40", "--policy", "both", "--workers", "1", "--max-duration-h", "1",
            "--drain-h", "12",
            "--out", str(out), "--json", str(tmp_path / "r.json"),
        ]
    )  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert "GPU-hours lost to preemption" in text and "scratch" in text
    assert sorted(p.name for p in out.glob("*.png")) == [
        "sim_gpu_hours.png",
        "sim_jct_cdf.png",
        "sim_utilisation.png",
    ]
    assert (tmp_path / "r.json").stat().st_size > 100


# -- a Machine behaviour the simulator found ------------------------------------------------


def _batch(cluster: str, seq: int, *events: object) -> EventBatch:
    return EventBatch(cluster=cluster, instance=cluster, seq=seq, events=list(events))  # type: ignore[arg-type]


def test_replacement_on_a_noticed_node_is_not_dispatched() -> None:
    m = Machine(BrokerConfig(queues=[QueueConfig(name="q")]))
    flavor = FlavorInfo(name="spot", capacity_type="spot", gpu_type="A100", price_per_gpu_hour=1)
    t = 1000.0
    for c in ("a", "b"):
        node = NodeInfo(name=f"{c}-n1", flavor="spot", gpu=8, cpu_milli=96_000, memory=2**40)
        m.handle(AgentBatch(c, _batch(c, 1, ClusterSnapshot(flavors=[flavor], nodes=[node]))), t)
    spec = JobSpec(
        name="j",
        job_id="j1",
        queue="q",
        gang=[PodSet(name="w", gpu=8)],
        capacity="spot",
        checkpoint=CheckpointSpec(uri="s3://x"),
    )
    split_reply(m.handle(SubmitJob(spec), t))
    first = next(e.cluster for e in m.handle(CYCLE, t) if isinstance(e, Send))
    other = "b" if first == "a" else "a"
    m.handle(DispatchAcked("j1", 1, True, ""), t + 0.1)
    running = WorkloadStatus(
        job_id="j1", attempt=1, phase="running", running_replicas=1, total_replicas=1
    )
    m.handle(AgentBatch(first, _batch(first, 2, running)), t + 30)
    m.handle(
        AgentBatch(first, _batch(first, 3, SpotNotice(node=f"{first}-n1", deadline=t + 220))),
        t + 100,
    )
    record = m.jobs["j1"]
    assert record.preempting is not None and record.preempting.replacement is not None
    assert record.preempting.replacement.cluster == other
    # A correlated reclaim: the reserved node gets its own notice at the same instant.
    m.handle(
        AgentBatch(other, _batch(other, 2, SpotNotice(node=f"{other}-n1", deadline=t + 220))),
        t + 100,
    )
    report = CheckpointReport(job_id="j1", attempt=1, step=500, uri="s3://x/500")
    effects = m.handle(Checkpoint(report), t + 104)
    doomed = [
        e
        for e in effects
        if isinstance(e, Send)
        and isinstance(e.command, Dispatch)
        and f"{other}-n1" in e.command.assignment[0].nodes
    ]
    assert doomed == [], "dispatched onto a node that will be reclaimed at t+220"


def _noticed_running(res: SimResult) -> list[AttemptLog]:
    return [
        log
        for logs in res.logs.values()
        for log in logs
        if log.noticed_at is not None
        and log.running_at is not None
        and log.noticed_at >= log.running_at
        and log.ended_at is not None
        and not log.succeeded
    ]


def test_a_checkpoint_longer_than_the_notice_window_is_lost_with_the_node() -> None:
    """GCP gives 30 s: a 45 s checkpoint asked for at the notice never lands, and the work
    since the last periodic checkpoint is lost. AWS's 120 s window lets the same one land."""
    base = replace(SMALL, jobs=120, ckpt_cost_s=(45.0, 45.0))
    landed = {}
    for provider in ("gcp", "aws"):
        pools = tuple(replace(p, provider=provider) for p in base.pools)
        res = Sim(replace(base, pools=pools), "muster").run()
        assert res.violations == []
        hit = _noticed_running(res)
        assert len(hit) >= 3, provider
        # The checkpoint asked for at the notice lands 45 s after it (periodic ones may land
        # inside the window by chance; they are not the point here).
        after = [
            log
            for log in hit
            if any(abs(t - (log.noticed_at or 0.0) - 45.0) < 1e-6 for t in log.ckpt_times)
        ]
        landed[provider] = len(after) / len(hit)
    assert landed["gcp"] == 0.0
    assert landed["aws"] > 0.5


def test_slower_gpus_take_longer_and_stalls_cost_time() -> None:
    # One node per A100 pool: priced by work, the A100s would otherwise take every job.
    pools = tuple(replace(p, nodes=1) if p.gpu_type == "A100" else p for p in SMALL.pools)
    speeds = (("V100", 1.0), ("A100", 2.0), ("T4", 0.5))
    sim = Sim(replace(SMALL, jobs=60, pools=pools, gpu_speed=speeds))
    res = sim.run()
    assert res.violations == []
    seen = set()
    for logs in res.logs.values():
        log = logs[-1]
        if not log.succeeded or log.start_step or log.running_at is None or log.ended_at is None:
            continue
        job = sim.jobs_by_id[log.job_id]
        compute = job.duration / log.speed
        stalls = len(log.ckpt_steps) * job.ckpt_cost
        assert log.ended_at - log.running_at == pytest.approx(compute + stalls, abs=1.0)
        seen.add(log.speed)
    assert len(seen) >= 2, seen  # jobs ran on GPUs of different speeds


def test_baselines_replay_the_same_jobs_and_differ_as_designed() -> None:
    cfg = replace(SMALL, jobs=120)
    out = {name: Sim(cfg, name).run() for name in (*COMPARISON, "foresight")}
    for name, res in out.items():
        assert res.violations == [], (name, res.violations[:3])
        assert [j.job_id for j in res.jobs] == [j.job_id for j in out["muster"].jobs]
    od = summarize(out["on-demand-only"])
    assert od["preemptions"] == 0 and od["gpu_h_spot"] == 0.0
    assert all(
        log.capacity_type == "on-demand" for v in out["on-demand-only"].logs.values() for log in v
    )
    # Without the notice the broker reserves nothing ahead and asks for no checkpoint.
    for name in ("checkpoint-restart", "skypilot-like"):
        s = summarize(out[name])
        assert s["make_before_break"] == 0.0 or math.isnan(s["make_before_break"])
    # Foresight writes no periodic checkpoints and loses less than the policies that lose work
    # after their last checkpoint. Muster may lose less still: foresight's jobs all write the
    # one checkpoint they need, so those that write none under Muster stay on spot under it,
    # where Muster prices their loss and runs them on on-demand when that is cheaper.
    assert all(len(log.ckpt_steps) <= 1 for v in out["foresight"].logs.values() for log in v)
    lost = {n: summarize(r)["gpu_h_lost"] for n, r in out.items()}
    assert lost["foresight"] <= min(lost["checkpoint-restart"], lost["scratch"])
    assert lost["checkpoint-restart"] >= lost["muster"]
    table = comparison([{"policy": n, "seed": 1, "summary": summarize(r)} for n, r in out.items()])
    assert table["on-demand-only"]["saving_vs_od"] == [0.0]
    assert table["checkpoint-restart"]["cr_vs_this"] == [1.0]


def test_results_do_not_depend_on_the_hash_seed(tmp_path: Path) -> None:
    """Two processes with different PYTHONHASHSEED replay the same run to the same numbers."""
    script = (
        "import json, sys\n"
        "from dataclasses import replace\n"
        "from load.sim import Sim\n"
        "from load.report import summarize\n"
        "from tests.load.small_sim import SMALL\n"
        "s = summarize(Sim(replace(SMALL, jobs=60), 'muster').run())\n"
        "s.pop('wall_s')\n"
        "print(json.dumps(s, sort_keys=True, default=str))\n"
    )
    outs = []
    for seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", script],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        outs.append(done.stdout)
    assert outs[0] == outs[1]
    assert '"completed": 60' in outs[0]


def test_scenario_files_define_the_fleet(tmp_path: Path) -> None:
    scenarios = Path(__file__).resolve().parents[2] / "load" / "scenarios"
    assert apply_scenario(SimConfig(), load_scenario(scenarios / "default.yaml")).pools == (
        DEFAULT_POOLS
    )
    cfg = apply_scenario(replace(SMALL, jobs=60), load_scenario(scenarios / "multicloud.yaml"))
    sim = Sim(cfg, "muster")
    res = sim.run()
    assert res.violations == []
    assert summarize(res)["completed"] >= 57  # a spot-only job may give up without progress
    # The GCP pool spans two zones, each driven by its own trace; a 30 s window there.
    zones = {n.split("-")[4] for n in sim.node_home if n.startswith("gcp-usc1-a100-spot")}
    assert "z1" in zones and any(z.isdigit() for z in zones)  # zone 0 names carry no tag
    gcp = [t for t, node in sim.reclaim_log if node.startswith("gcp-usc1")]
    notices = dict((node, t) for t, node in sim.notice_log)
    assert gcp and all(
        t == pytest.approx(notices[node] + NOTICE_S["gcp"])
        for t, node in sim.reclaim_log
        if node.startswith("gcp-usc1")
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools: [{cluster: a, flavor: b, capacity: spot, gpu: T4, price: -1, nodes: 1}]")
    with pytest.raises(ValueError, match=r"bad\.yaml"):
        load_scenario(bad)


@pytest.mark.parametrize("keep_order", [True, False])
def test_a_dispatch_waits_for_the_cancel_it_is_ordered_after(keep_order: bool) -> None:
    """Cancels take 30 s to reach their agents. Sent at once, a replacement (a spot notice
    moves the job to another pool) starts while the old copy still runs; held until the
    Cancel the core names in `after_cancel_of` arrives, it never does."""
    sim = Sim(replace(SMALL, jobs=40, cancel_latency_s=30.0, keep_order=keep_order), "muster")
    sim.run()
    copies = [v for v in sim.violations if v.kind == "two-live-copies"]
    if keep_order:
        assert sim.violations == []
    else:
        assert copies, "without the ordering the simulator must see two live copies"
