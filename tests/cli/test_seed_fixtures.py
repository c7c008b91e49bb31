"""Every job manifest of the seed documents (tests/cli/fixtures/, with provenance on each
file's first line) and the gang, queue, priority and capacity it must give, submitted
unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.config import parse_config
from broker.core.records import spot_ok
from broker.core.submission import resolve_priority
from broker.manifests import load_job_documents
from schemas.api import SubmitReply
from schemas.config import BrokerConfig

from .conftest import FIXTURES, fixture_text

PROVENANCE = ("# Verbatim from the ", "# Not from the seeds", "# The seed's ")
# The broker config the evaluator used: the seed's PriorityClass `high-priority`.
CONFIG = BrokerConfig(priority_classes={"high-priority": 1000})

Gang = list[tuple[str, int, int]]  # (podset, replicas, GPUs per replica)
# file -> (gang, queue, priority, capacity, may it go to spot at its price)
EXPECTED: dict[str, tuple[Gang, str | None, int, str, bool]] = {
    "batch-job-indexed.yaml": ([("worker", 4, 1)], None, 0, "any", False),
    "jobset-llm.yaml": (
        [("driver", 1, 0), ("workers", 8, 8)],
        "ml-research-queue",
        0,
        "any",
        False,
    ),
    "mpijob-horovod.yaml": ([("launcher", 1, 0), ("worker", 4, 2)], None, 0, "any", False),
    "pytorchjob-ddp-mnist.yaml": ([("master", 1, 2), ("worker", 2, 2)], None, 0, "any", False),
    # nodeSelector cloud.google.com/gke-provisioning: spot
    "pytorchjob-elastic-spot.yaml": ([("worker", 4, 1)], None, 0, "spot", False),
    # Koordinator's scheduling.x-k8s.io/queue and /priority annotations
    "pytorchjob-koord.yaml": (
        [("master", 1, 1), ("worker", 1, 1)],
        "pytorch-team-a",
        10,
        "any",
        False,
    ),
    "pytorchjob-kueue-label.yaml": (
        [("master", 1, 4), ("worker", 3, 4)],
        "ml-research-queue",
        0,
        "any",
        False,
    ),
    # the Master's priorityClassName: high-priority, through the config's priority_classes
    "pytorchjob-priority-class.yaml": ([("master", 1, 2)], None, 1000, "any", False),
    "tfjob-ps.yaml": ([("ps", 2, 0), ("worker", 4, 1)], None, 0, "any", False),
    "volcano-job.yaml": (
        [("master", 1, 1), ("worker", 4, 1)],
        "ml-research-queue",
        0,
        "any",
        False,
    ),
}
# Not jobs: the queue, quota and flavor objects the broker config imports (tests/cli/
# test_config*.py), and Volcano's PodGroup and Koord-Queue's Queue, which are a scheduler's own.
NOT_JOBS = {
    "koord-elasticquota.yaml",
    "koord-queue.yaml",
    "kueue-clusterqueue.yaml",
    "kueue-localqueue.yaml",
    "kueue-resourceflavors.yaml",
    "volcano-podgroup.yaml",
    "volcano-queue.yaml",
}


def test_every_fixture_has_provenance_and_an_expectation() -> None:
    names = {p.name for p in FIXTURES.glob("*.yaml")}
    assert names == set(EXPECTED) | NOT_JOBS
    for name in names:
        first = (FIXTURES / name).read_text(encoding="utf-8").splitlines()[0]
        assert first.startswith(PROVENANCE), (name, first)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_seed_job_gives_its_gang_queue_priority_and_capacity(name: str) -> None:
    gang, queue, priority, capacity, spot = EXPECTED[name]
    (spec,) = load_job_documents(Path(FIXTURES / name).read_text(encoding="utf-8"), source=name)
    resolved = resolve_priority(CONFIG, spec)
    assert not isinstance(resolved, SubmitReply), resolved.error
    assert [(p.name, p.replicas, p.gpu) for p in resolved.gang] == gang
    assert resolved.queue == queue
    assert resolved.priority == priority
    assert resolved.capacity == capacity
    assert spot_ok(resolved) is spot


def test_a_volcano_podgroup_and_a_koord_queue_are_noted_not_refused() -> None:
    """Both come with the quota objects a team applies; neither configures a queue."""
    text = "\n---\n".join(
        fixture_text(n)
        for n in ("koord-elasticquota.yaml", "koord-queue.yaml", "volcano-podgroup.yaml")
    )
    loaded = parse_config(text, source="team.yaml")
    assert [q.name for q in loaded.config.queues] == ["pytorch-team-a"]
    notes = "\n".join(loaded.notes)
    assert "(Queue pytorch-training-queue): skipped; Koord-Queue's Queue orders" in notes
    assert "(PodGroup pytorch-training-pg): skipped; a PodGroup is one job's gang" in notes


def test_the_seeds_volcano_queue_and_kueue_localqueue_import_together() -> None:
    """Both seed documents name a queue `ml-research-queue` (a Volcano Queue, a Kueue
    LocalQueue): imported unchanged, the queue keeps the name and the LocalQueue is noted."""
    names = (
        "volcano-queue.yaml",
        "kueue-resourceflavors.yaml",
        "kueue-clusterqueue.yaml",
        "kueue-localqueue.yaml",
    )
    loaded = parse_config("\n---\n".join(fixture_text(n) for n in names), source="seeds.yaml")
    assert sorted(q.name for q in loaded.config.queues) == ["ml-cluster-queue", "ml-research-queue"]
    assert "ml-research-queue" not in loaded.aliases
    assert any(
        "LocalQueue 'ml-research-queue' has the name of the queue" in n for n in loaded.notes
    )


def test_the_seeds_elastic_quota_max_is_usable_on_an_idle_fleet() -> None:
    """The Koord-Queue guide's ElasticQuota (min 2 GPUs, max 8): a 4-GPU job was refused as
    "needs 4 > 2"; Koordinator runs it while the cluster has idle GPUs, and so does Muster."""
    from broker.core.effects import Send
    from broker.core.machine import Machine
    from schemas.agent import Dispatch
    from tests.core.harness import OD, Sim

    loaded = parse_config(fixture_text("koord-elasticquota.yaml"), source="quota.yaml")
    w = Sim.empty()
    w.m = Machine(loaded.config, epoch=3)
    w.cluster("c1", flavor=OD)  # one idle 8-GPU node
    from broker.core.effects import split_reply
    from broker.core.inputs import SubmitJob
    from schemas.job import JobSpec, PodSet

    spec = JobSpec(name="four", gang=[PodSet(name="w", gpu=4, cpu="1", memory="1Gi")])
    reply, _ = split_reply(w.m.handle(SubmitJob(spec, subject_queue="pytorch-team-a"), w.now))
    assert reply.accepted, reply.error
    job = reply.job_id
    sent = [e for e in w.cycle() if isinstance(e, Send) and isinstance(e.command, Dispatch)]
    assert [e.command.job_id for e in sent] == [job]
    assert any("Koordinator's root quota" in n for n in loaded.notes)
