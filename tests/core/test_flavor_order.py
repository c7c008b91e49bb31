"""A queue's flavor order (a Kueue ClusterQueue's flavor list) is its placement preference:
the first flavor class with room wins over a cheaper later one, the next is tried when the
first is full, and cost (per unit of work: the T4 runs at 0.3 of a V100, the A100 at 2.2)
decides only within a class."""

from __future__ import annotations

import msgspec

from broker.config import import_documents
from broker.core.scheduler import Scheduler
from schemas.config import FlavorClass

from .helpers import NOW, config, flavor, gang, nodes, queue

CLASSES = [
    FlavorClass(name="gpu-a100", capacity_type="on-demand", gpu_type="a100"),
    FlavorClass(name="gpu-t4-spot", capacity_type="spot", gpu_type="t4"),
]


def _scheduler(order: list[str]) -> Scheduler:
    q = queue(
        "ml", quotas={"gpu-a100": {"gpu": (8, None, None)}, "gpu-t4-spot": {"gpu": (8, None, None)}}
    )
    q = msgspec.structs.replace(q, flavor_order=order)
    s = Scheduler(config(queues=[q], classes=CLASSES))
    s.apply_snapshot("c1", [flavor("od", "on-demand", "a100", price=3.0)], nodes("a", "od", 1), NOW)
    s.apply_snapshot("c2", [flavor("spot", "spot", "t4", price=0.2)], nodes("t", "spot", 1), NOW)
    return s


def _placed(s: Scheduler, job_id: str) -> str:
    res = s.schedule([gang(job_id, (1, 8), queue="ml", checkpoint_interval_s=600.0)], NOW)
    ((got, placement),) = res.admitted
    assert got == job_id
    return f"{placement.cluster}/{placement.flavor}"


def test_without_an_order_the_cheaper_pool_wins() -> None:
    assert _placed(_scheduler([]), "j") == "c2/spot"


def test_the_queues_first_flavor_wins_then_the_next_when_it_is_full() -> None:
    s = _scheduler(["gpu-a100", "gpu-t4-spot"])
    assert _placed(s, "first") == "c1/od"
    assert _placed(s, "second") == "c2/spot"  # a100 is full: the next flavor in order


def test_an_imported_cluster_queue_keeps_kueues_flavor_order() -> None:
    docs = [
        {
            "apiVersion": "kueue.x-k8s.io/v1beta1",
            "kind": "ResourceFlavor",
            "metadata": {"name": name},
            "spec": {"nodeLabels": labels},
        }
        for name, labels in (
            ("on-demand-a100", {"cloud.google.com/gke-accelerator": "nvidia-tesla-a100"}),
            ("spot-a100", {"cloud.google.com/gke-spot": "true"}),
        )
    ]
    docs.append(
        {
            "apiVersion": "kueue.x-k8s.io/v1beta1",
            "kind": "ClusterQueue",
            "metadata": {"name": "team"},
            "spec": {
                "resourceGroups": [
                    {
                        "coveredResources": ["nvidia.com/gpu"],
                        "flavors": [
                            {
                                "name": n,
                                "resources": [{"name": "nvidia.com/gpu", "nominalQuota": 8}],
                            }
                            for n in ("on-demand-a100", "spot-a100")
                        ],
                    }
                ],
                "flavorFungibility": {"whenCanBorrow": "TryNextFlavor"},
            },
        }
    )
    loaded = import_documents(docs, source="kueue.yaml")
    (team,) = loaded.config.queues
    assert team.flavor_order == ["on-demand-a100", "spot-a100"]
    assert any(
        "flavorFungibility.whenCanBorrow: TryNextFlavor imported as Borrow" in n
        for n in loaded.notes
    )


def test_why_says_the_queues_flavor_order_chose_the_pool() -> None:
    from broker.core.effects import Send
    from broker.core.machine import Machine
    from schemas.agent import Dispatch
    from schemas.config import BrokerConfig, QueueConfig
    from schemas.job import CheckpointSpec
    from tests.core.harness import OD, SPOT, Sim

    w = Sim.empty()
    w.m = Machine(
        BrokerConfig(
            queues=[QueueConfig(name="q", flavor_order=["od-a100", "spot-a100"])],
            flavors=[
                FlavorClass(name="od-a100", capacity_type="on-demand"),
                FlavorClass(name="spot-a100", capacity_type="spot"),
            ],
        ),
        epoch=3,
    )
    w.cluster("s", flavor=SPOT)
    w.cluster("o", flavor=OD)
    job = w.submit("ordered", checkpoint=CheckpointSpec(uri="s3://b/o"))
    (sent,) = [e for e in w.cycle() if isinstance(e, Send) and isinstance(e.command, Dispatch)]
    assert sent.cluster == "o"  # on-demand first, though spot is cheaper and the job checkpoints
    why = w.m.views.why(job, w.now)
    assert why is not None
    (placed,) = why.reasons
    assert placed.message.endswith(
        "flavor class od-a100 is #1 in queue q's flavor order (od-a100, spot-a100): its first "
        "choice"
    )
