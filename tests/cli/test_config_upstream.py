"""Upstream queue and quota samples (Kueue, Volcano, Koordinator, scheduler-plugins), imported
unchanged: each must give exactly the queue tree its authors meant, and say what it drops."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from broker.config import (
    ConfigError,
    LoadedConfig,
    from_elastic_quota,
    import_documents,
    parse_config,
)
from broker.core.quota import QuotaBook
from schemas.config import BrokerConfig

from .conftest import FIXTURES, fixture_docs

GI = 2**30
MI = 2**20
NEVER = {"within_queue": "Never", "reclaim_within_cohort": "Never"}


def load(name: str) -> LoadedConfig:
    return import_documents(fixture_docs(f"queues/{name}"), source=name)


def tree(config: BrokerConfig) -> dict[str, Any]:
    data = msgspec.to_builtins(config)
    for queue in data.get("queues", []):
        if queue.get("preemption") == {}:
            del queue["preemption"]  # Muster's defaults
    return {k: data.get(k, []) for k in ("queues", "cohorts", "flavors")}


def notes_of(loaded: LoadedConfig) -> str:
    return "\n".join(loaded.notes)


def test_kueue_single_clusterqueue_lists_cpu_and_memory_only() -> None:
    loaded = load("kueue-single-clusterqueue.yaml")
    assert tree(loaded.config) == {
        "queues": [
            {
                "name": "cluster-queue",
                "quotas": [
                    {
                        "flavor": "default-flavor",
                        "resources": {"cpu": {"nominal": 9000}, "memory": {"nominal": 36 * GI}},
                    }
                ],
                "unlisted_resources": "zero",
                "preemption": NEVER,
            }
        ],
        "cohorts": [],
        "flavors": [{"name": "default-flavor"}],
    }
    assert loaded.aliases == {"user-queue": "cluster-queue"}
    # As Kueue: a ClusterQueue without a GPU quota admits no GPU job.
    book = QuotaBook(loaded.config.queues, loaded.config.cohorts)
    qs = book.queues["cluster-queue"]
    assert book.check(qs, "default-flavor", (0, 1000, GI)) is None
    refused = book.check(qs, "default-flavor", (1, 1000, GI))
    assert refused is not None and refused[0] == "quota-exceeded"
    assert "does not list gpu" in refused[1]


def test_kueue_spot_flavor_from_its_taint() -> None:
    loaded = load("kueue-resource-flavor-taints.yaml")
    assert tree(loaded.config)["flavors"] == [{"name": "spot", "capacity_type": "spot"}]
    assert "on-demand" not in notes_of(loaded)


def test_kueue_spot_flavor_from_node_type_label() -> None:
    loaded = load("kueue-shared-quota-setup.yaml")
    assert tree(loaded.config) == {
        "queues": [
            {
                "name": "team-cluster-queue",
                "quotas": [
                    {"flavor": "on-demand", "resources": {"cpu": {"nominal": 9000}}},
                    {"flavor": "spot", "resources": {"cpu": {"nominal": 9000}}},
                    {"flavor": "credits", "resources": {}},
                ],
                "unlisted_resources": "zero",
                "preemption": NEVER,
                "flavor_order": ["on-demand", "spot", "credits"],  # as Kueue tries them
            }
        ],
        "cohorts": [],
        "flavors": [
            {"name": "on-demand", "capacity_type": "on-demand"},
            {"name": "spot", "capacity_type": "spot"},
            {"name": "credits"},
        ],
    }
    assert "'cpu_credits' ignored" in notes_of(loaded)


def test_kueue_admission_fair_sharing_fields_are_named() -> None:
    loaded = load("kueue-admission-fair-sharing.yaml")
    (queue,) = tree(loaded.config)["queues"]
    assert queue["strategy"] == "StrictFIFO"
    assert loaded.aliases == {"lq-a": "cluster-queue", "lq-b": "cluster-queue"}
    notes = notes_of(loaded)
    assert "(ClusterQueue cluster-queue): spec.admissionScope ignored" in notes
    assert "(LocalQueue lq-a): spec.fairSharing ignored" in notes
    assert "(LocalQueue lq-b): spec.fairSharing ignored" in notes


def test_kueue_cohort_tree() -> None:
    loaded = load("kueue-cohorts.yaml")
    assert tree(loaded.config) == {
        "queues": [
            {
                "name": "my-cluster-queue",
                "cohort": "hello-cohort",
                "quotas": [{"flavor": "default-flavor", "resources": {"cpu": {}}}],
                "unlisted_resources": "zero",
                "preemption": NEVER,
            }
        ],
        "cohorts": [
            {
                "name": "hello-cohort",
                "quotas": [{"flavor": "default-flavor", "resources": {"cpu": {"nominal": 12000}}}],
            },
            {"name": "root-cohort"},
            {"name": "important-org", "parent": "root-cohort"},
            {"name": "regular-org", "parent": "root-cohort"},
        ],
        "flavors": [],
    }
    assert "(Cohort important-org): spec.fairSharing ignored" in notes_of(loaded)
    # "the ClusterQueue may access the 12 shared CPUs defined by its Cohort"
    book = QuotaBook(loaded.config.queues, loaded.config.cohorts)
    qs = book.queues["my-cluster-queue"]
    assert book.check(qs, "default-flavor", (0, 12000, 0)) is None
    assert book.check(qs, "default-flavor", (0, 12001, 0)) is not None


def test_volcano_hierarchy_annotations() -> None:
    loaded = load("volcano-hierarchy-annotations.yaml")
    assert tree(loaded.config) == {
        "queues": [
            {"name": "root-eng-prod", "cohort": "root-eng", "weight": 0.16},
            {"name": "root-eng-dev", "cohort": "root-eng", "weight": 0.04},
            {"name": "root-sci-prod", "cohort": "root-sci", "weight": 0.64},
            {"name": "root-sci-dev", "cohort": "root-sci", "weight": 0.16},
        ],
        "cohorts": [
            {"name": "root"},
            {"name": "root-eng", "parent": "root"},
            {"name": "root-sci", "parent": "root"},
        ],
        "flavors": [],
    }
    assert "hierarchy-weights flattened into the queue weight 0.16" in notes_of(loaded)


def test_volcano_parent_queue_becomes_a_cohort() -> None:
    loaded = load("volcano-parent-queues.yaml")

    def leaf(name: str, cohort: str, cpu: int, mem: int) -> dict[str, Any]:
        return {
            "name": name,
            "cohort": cohort,
            "weight": 1.0,
            "quotas": [
                {
                    "flavor": "any",
                    "resources": {"cpu": {"nominal": cpu}, "memory": {"nominal": mem}},
                }
            ],
        }

    assert tree(loaded.config) == {
        "queues": [
            leaf("child-queue-b", "volcano", 64_000, 128 * GI),
            leaf("subchild-queue-a1", "child-queue-a", 32_000, 64 * GI),
            leaf("subchild-queue-a2", "child-queue-a", 32_000, 64 * GI),
        ],
        "cohorts": [
            {
                "name": "child-queue-a",
                "parent": "volcano",
                "quotas": [{"flavor": "any", "resources": {"cpu": {}, "memory": {}}}],
            }
        ],
        "flavors": [{"name": "any"}],
    }
    assert "child-queue-a" not in {q.name for q in loaded.config.queues}
    assert "imported as a cohort of subchild-queue-a1, subchild-queue-a2" in notes_of(loaded)


def test_volcano_children_deserving_more_than_the_parent_are_refused() -> None:
    docs = fixture_docs("queues/volcano-parent-queues.yaml")
    docs[2]["spec"]["deserved"]["cpu"] = 40  # 40 + 32 > the parent's 64
    with pytest.raises(ConfigError, match=r"child queues' spec.deserved.cpu add up to more"):
        import_documents(docs)


def test_volcano_hierarchy_annotation_yields_to_spec_parent() -> None:
    docs = fixture_docs("queues/volcano-parent-queues.yaml")
    docs[2]["metadata"]["annotations"] = {"volcano.sh/hierarchy": "root/elsewhere/x"}
    loaded = import_documents(docs)
    queues = {q.name: q for q in loaded.config.queues}
    assert queues["subchild-queue-a1"].cohort == "child-queue-a"
    assert "annotations volcano.sh/hierarchy and hierarchy-weights ignored" in notes_of(loaded)


def test_koordinator_parent_quota_is_a_cohort_bounding_its_children() -> None:
    loaded = load("koord-quota-tree.yaml")

    def child(name: str) -> dict[str, Any]:
        return {
            "name": name,
            "cohort": "quota-parent-example",
            "quotas": [
                {
                    "flavor": "any",
                    "resources": {
                        "cpu": {"nominal": 5000, "borrowing_limit": 35_000},
                        "memory": {"nominal": 10 * MI, "borrowing_limit": 40 * GI - 10 * MI},
                    },
                }
            ],
        }

    assert tree(loaded.config) == {
        "queues": [child("quota-example"), child("quota-example-b")],
        "cohorts": [
            {
                "name": "quota-parent-example",
                "parent": "elastic-quota",
                "quotas": [
                    {
                        "flavor": "any",
                        "resources": {
                            # min 10 all given to the children; max - min = 30 to borrow
                            "cpu": {"borrowing_limit": 30_000},
                            "memory": {"borrowing_limit": 40 * GI - 20 * MI},
                        },
                    }
                ],
            },
            {
                # Koordinator's root quota is the cluster: it lends max - min of the top level
                "name": "elastic-quota",
                "quotas": [
                    {
                        "flavor": "any",
                        "resources": {
                            "cpu": {"nominal": 30_000},
                            "memory": {"nominal": 40 * GI - 20 * MI},
                        },
                    }
                ],
            },
        ],
        "flavors": [{"name": "any"}],
    }
    assert "it runs no jobs" in notes_of(loaded)
    assert "cohort elastic-quota (Koordinator's root quota) lends cpu 30" in notes_of(loaded)
    # With a sibling quota lending 30 cpu at the top, the parent's max (40) bounds the pair:
    # each child alone could reach its own max of 40, both together stay within 40.
    lender = msgspec.convert(
        {
            "name": "lender",
            "cohort": "elastic-quota",
            "quotas": [{"flavor": "any", "resources": {"cpu": {"nominal": 100_000}}}],
        },
        type=type(loaded.config.queues[0]),
    )
    book = QuotaBook([*loaded.config.queues, lender], loaded.config.cohorts)
    a, b = book.queues["quota-example"], book.queues["quota-example-b"]
    assert book.check(a, "any", (0, 40_000, 0)) is None
    book.charge(a, "any", (0, 25_000, 0), 1)
    assert book.check(b, "any", (0, 15_000, 0)) is None
    assert book.check(b, "any", (0, 15_001, 0)) is not None


def test_koordinator_children_over_the_parent_min_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"checkMinQuotaSum.*lower a child's min"):
        load("koord-quota-tree-refused.yaml")


def test_koordinator_parent_must_be_marked_a_parent() -> None:
    docs = fixture_docs("queues/koord-quota-tree.yaml")
    docs[0]["metadata"]["labels"]["quota.scheduling.koordinator.sh/is-parent"] = "false"
    with pytest.raises(ConfigError, match=r"is not a parent .*is-parent"):
        import_documents(docs)


def test_scheduler_plugins_elastic_quota() -> None:
    config = from_elastic_quota(fixture_docs("queues/scheduler-plugins-elasticquota.yaml"))
    assert tree(config) == {
        "queues": [
            {
                "name": "test",
                "cohort": "elastic-quota",
                "quotas": [
                    {
                        "flavor": "any",
                        "resources": {
                            "cpu": {"nominal": 10_000, "borrowing_limit": 10_000},
                            "gpu": {"nominal": 1, "borrowing_limit": 1},
                            "memory": {"nominal": 20 * GI, "borrowing_limit": 20 * GI},
                        },
                    }
                ],
            }
        ],
        "cohorts": [],
        "flavors": [{"name": "any"}],
    }


@pytest.mark.parametrize(
    ("labels", "taints", "capacity"),
    [
        ({"node-type": "spot"}, None, "spot"),
        ({"eks.amazonaws.com/capacityType": "SPOT"}, None, "spot"),
        ({"karpenter.sh/capacity-type": "spot"}, None, "spot"),
        ({"cloud.google.com/gke-spot": "true"}, None, "spot"),
        ({"cloud.google.com/gke-preemptible": "true"}, None, "spot"),
        ({"kubernetes.azure.com/scalesetpriority": "spot"}, None, "spot"),
        ({"node-type": "on-demand"}, None, "on-demand"),
        (
            {"gpu": "a100"},
            [{"key": "kubernetes.azure.com/scalesetpriority", "value": "spot"}],
            "spot",
        ),
        (
            {},
            [{"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NoSchedule"}],
            "spot",
        ),
    ],
)
def test_spot_flavors_recognised(
    labels: dict[str, str], taints: list[dict[str, str]] | None, capacity: str
) -> None:
    spec: dict[str, Any] = {"nodeLabels": labels}
    if taints is not None:
        spec["nodeTaints"] = taints
    doc = {
        "apiVersion": "kueue.x-k8s.io/v1beta1",
        "kind": "ResourceFlavor",
        "metadata": {"name": "f"},
        "spec": spec,
    }
    loaded = import_documents([doc])
    (flavor,) = loaded.config.flavors
    assert flavor.capacity_type == capacity
    opposite = "on-demand" if capacity == "spot" else "spot"
    assert f"taken as {opposite}" not in notes_of(loaded)


def test_on_demand_labels_with_a_spot_taint_are_refused() -> None:
    doc = {
        "apiVersion": "kueue.x-k8s.io/v1beta1",
        "kind": "ResourceFlavor",
        "metadata": {"name": "f"},
        "spec": {
            "nodeLabels": {"node-type": "on-demand"},
            "nodeTaints": [{"key": "spot", "value": "true"}],
        },
    }
    with pytest.raises(ConfigError, match="fix one of them"):
        import_documents([doc])


def test_every_unread_field_is_named() -> None:
    docs = [
        {
            "apiVersion": "kueue.x-k8s.io/v1beta1",
            "kind": "ClusterQueue",
            "metadata": {"name": "cq"},
            "spec": {"resourceGroups": [], "someFutureField": 1},
        },
        {
            "apiVersion": "scheduling.volcano.sh/v1beta1",
            "kind": "Queue",
            "metadata": {"name": "vq"},
            "spec": {"weight": 1, "priority": 5, "anotherField": True},
        },
        {
            "apiVersion": "scheduling.sigs.k8s.io/v1alpha1",
            "kind": "ElasticQuota",
            "metadata": {
                "name": "eq",
                "labels": {"quota.scheduling.koordinator.sh/shared-weight": "{}"},
            },
            "spec": {"min": {"cpu": 1}, "extra": 1},
        },
    ]
    notes = notes_of(import_documents(docs))
    for expected in (
        "(ClusterQueue cq): spec.someFutureField ignored",
        "(Queue vq): spec.priority ignored",
        "(Queue vq): spec.anotherField ignored",
        "(ElasticQuota eq): spec.extra ignored",
        "(ElasticQuota eq): label quota.scheduling.koordinator.sh/shared-weight ignored",
    ):
        assert expected in notes


def test_muster_config_prints_every_note() -> None:
    from typer.testing import CliRunner

    from broker.cli_operator import app

    path = FIXTURES / "queues" / "kueue-admission-fair-sharing.yaml"
    result = CliRunner().invoke(app, ["config", str(path)])
    assert result.exit_code == 0, result.output
    loaded = load("kueue-admission-fair-sharing.yaml")
    assert loaded.notes
    for note in loaded.notes:
        # the rich console may wrap a long note; compare without line breaks
        assert note.split(": ", 1)[1].replace(" ", "") in result.output.replace("\n", "").replace(
            " ", ""
        )
    assert "unlisted_resources: zero" in result.output


def test_muster_cohorts_with_quantities_and_checked_references() -> None:
    text = """
flavors: [{name: spot-a100, capacity_type: spot}]
cohorts:
  - name: org
    quotas: [{flavor: spot-a100, resources: {cpu: {nominal: "8"}, memory: {nominal: 1Gi}}}]
  - name: team
    parent: org
queues:
  - name: q
    cohort: team
    quotas: [{flavor: spot-a100, resources: {gpu: {nominal: 2}}}]
"""
    config = parse_config(text).config
    assert [(c.name, c.parent) for c in config.cohorts] == [("org", None), ("team", "org")]
    assert config.cohorts[0].quotas[0].resources["cpu"].nominal == 8000
    assert config.cohorts[0].quotas[0].resources["memory"].nominal == GI
    with pytest.raises(ConfigError, match=r"cohorts\[0\].quotas\[0\].flavor: 'spot-a10' .*"):
        parse_config(
            text.replace("flavor: spot-a100, resources: {cpu", "flavor: spot-a10, resources: {cpu")
        )
    with pytest.raises(ConfigError, match="its own ancestor"):
        parse_config(text.replace("  - name: org\n", "  - name: org\n    parent: team\n"))


def test_volcano_guarantee_is_never_lent() -> None:
    docs = fixture_docs("queues/volcano-parent-queues.yaml")
    docs[0]["spec"]["guarantee"] = {"resource": {"cpu": 16}}  # the parent keeps 16 of 64
    docs[1]["spec"]["guarantee"] = {"resource": {"cpu": 8}}  # a leaf keeps 8 of 64
    config = import_documents(docs).config
    (parent,) = config.cohorts
    assert parent.quotas[0].resources["cpu"].lending_limit == 48_000
    leaf = next(q for q in config.queues if q.name == "child-queue-b")
    assert leaf.quotas is not None and leaf.quotas[0].resources["cpu"].lending_limit == 56_000
    docs[1]["spec"]["guarantee"] = {"resource": {"cpu": 65}}
    with pytest.raises(ConfigError, match="guarantee <= deserved"):
        import_documents(docs)


def test_kueue_fabric_quotas_become_the_queue_caps() -> None:
    """A ClusterQueue covering EFA and hugepages (as on p5 pools) caps them per flavor."""
    docs = [
        {
            "apiVersion": "kueue.x-k8s.io/v1beta1",
            "kind": "ClusterQueue",
            "metadata": {"name": "p5"},
            "spec": {
                "resourceGroups": [
                    {
                        "coveredResources": ["nvidia.com/gpu", "vpc.amazonaws.com/efa"],
                        "flavors": [
                            {
                                "name": "p5",
                                "resources": [
                                    {"name": "nvidia.com/gpu", "nominalQuota": 64},
                                    {
                                        "name": "vpc.amazonaws.com/efa",
                                        "nominalQuota": 256,
                                        "borrowingLimit": 32,
                                    },
                                    {"name": "hugepages-2Mi", "nominalQuota": "4Gi"},
                                ],
                            }
                        ],
                    }
                ]
            },
        }
    ]
    loaded = import_documents(docs, source="p5.yaml")
    (queue,) = loaded.config.queues
    (quota,) = queue.quotas or []
    assert quota.resources["gpu"].nominal == 64
    assert quota.extended == {"vpc.amazonaws.com/efa": 256, "hugepages-2Mi": 4 * GI}
    assert "borrowingLimit/lendingLimit ignored" in notes_of(loaded)
    book = QuotaBook(loaded.config.queues)
    qs = book.queues["p5"]
    miss = book.check_ext(qs, "p5", {"vpc.amazonaws.com/efa": 257})
    assert miss is not None and "its cap of 256 leaves 256" in miss.message
