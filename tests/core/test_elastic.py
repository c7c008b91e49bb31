"""Elastic gangs in the core: admitted at what fits between min and max, said in words."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from broker.core.assigner import Assignment
from broker.core.effects import Publish, Send, split_reply
from broker.core.inputs import SubmitJob
from broker.core.machine import Machine
from broker.core.scheduler import Scheduler
from broker.manifests import jobspec_from_manifest
from schemas.agent import ClusterSnapshot, Dispatch, FlavorInfo, NodeInfo
from schemas.config import BrokerConfig, QueueConfig

from .harness import T0, Sim
from .helpers import NOW, config, flavor, gang, nodes

SEED = Path(__file__).parents[1] / "cli" / "fixtures" / "pytorchjob-elastic-spot.yaml"

SPOT = FlavorInfo(name="a100-spot", capacity_type="spot", gpu_type="A100", price_per_gpu_hour=1.0)


class SpotSim(Sim):
    """One cluster `spot-east` of `count` one-GPU spot A100 nodes."""

    def __init__(self, count: int) -> None:
        self.m = Machine(BrokerConfig(queues=[QueueConfig(name="q")]), epoch=1)
        self.now = T0
        self.seq: dict[str, int] = {}
        self.send("spot-east", ClusterSnapshot(flavors=[SPOT], nodes=self.nodes(range(count))))

    @staticmethod
    def nodes(indices: Any) -> list[NodeInfo]:
        return [
            NodeInfo(name=f"se-{i}", flavor=SPOT.name, gpu=1, cpu_milli=8000, memory=2**36)
            for i in indices
        ]

    def submit_seed(self) -> str:
        """The seed's elastic PyTorchJob (min 2, replicas 4, max 8), unchanged."""
        spec = jobspec_from_manifest(yaml.safe_load(SEED.read_text(encoding="utf-8")))
        reply, _ = split_reply(self.m.handle(SubmitJob(spec, subject_queue="q"), self.now))
        assert reply.job_id is not None, reply.error
        return reply.job_id


def dispatches(effects: list[Any]) -> list[Dispatch]:
    return [e.command for e in effects if isinstance(e, Send) and isinstance(e.command, Dispatch)]


def test_the_seed_elastic_job_is_admitted_at_what_fits_and_says_so() -> None:
    sim = SpotSim(4)
    job = sim.submit_seed()
    out = sim.step(1.0)
    (cmd,) = dispatches(out)
    assert [len(a.nodes) for a in cmd.assignment] == [4]  # 4 of at most 8
    admitted = [e.event for e in out if isinstance(e, Publish) and e.event.kind == "admitted"]
    assert admitted[0].reason == (
        "admitted 4 of 8 worker replicas (min 2): spot-east/a100-spot has room for 4 on 4 "
        "free A100 nodes now"
    )
    why = sim.m.views.why(job, sim.now)
    assert why is not None
    assert [r.message for r in why.reasons if r.code == "elastic"] == [
        "elastic: worker runs 4 of 8 replicas (min 2; grows back when its pool has room)"
    ]


def test_the_seed_elastic_job_takes_its_maximum_when_it_fits() -> None:
    sim = SpotSim(10)
    sim.submit_seed()
    (cmd,) = dispatches(sim.step(1.0))
    assert [len(a.nodes) for a in cmd.assignment] == [8]


def test_a_fleet_too_small_for_the_minimum_refuses_it_at_submission() -> None:
    sim = SpotSim(1)
    spec = jobspec_from_manifest(yaml.safe_load(SEED.read_text(encoding="utf-8")))
    reply, _ = split_reply(sim.m.handle(SubmitJob(spec, subject_queue="q"), sim.now))
    assert reply.error is not None and "2x1 GPU (worker) does not fit" in reply.error


def test_an_elastic_request_asks_for_its_maximum_first() -> None:
    s = Scheduler(config())
    s.apply_snapshot("c", [flavor("od")], nodes("n", "od", 3, gpu=8), NOW)
    req = gang("e", (8, 8))
    req.min_replicas = {"p0": 2}
    req.elastic = frozenset({"p0"})
    got = s.assign(req, NOW)
    assert isinstance(got, Assignment)
    assert [len(n) for _, n in got.placement.assignment] == [3]
    assert got.placement.note.startswith("admitted 3 of 8 p0 replicas (min 2): c/od")
