"""Broker config loading and the Kueue / Volcano / Koordinator importers."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings

from broker.config import (
    ANY_FLAVOR,
    ConfigError,
    config_to_yaml,
    from_elastic_quota,
    from_kueue,
    from_volcano,
    import_documents,
    kueue_aliases,
    load_config,
    load_config_full,
    parse_config,
)
from schemas.config import (
    BrokerConfig,
    FlavorClass,
    FlavorQuota,
    PreemptionPolicy,
    QueueConfig,
    ResourceQuota,
    Timeouts,
)
from tests.schemas.strategies import broker_configs

from .conftest import fixture_docs, fixture_text

GI = 2**30
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def kueue_docs() -> list[dict]:
    return (
        fixture_docs("kueue-resourceflavors.yaml")
        + fixture_docs("kueue-clusterqueue.yaml")
        + fixture_docs("kueue-localqueue.yaml")
    )


SEED_KUEUE = BrokerConfig(
    queues=[
        QueueConfig(
            name="ml-cluster-queue",
            cohort="ml-team-cohort",
            strategy="BestEffortFIFO",
            unlisted_resources="zero",
            quotas=[
                FlavorQuota(
                    flavor="gpu-a100",
                    resources={
                        "cpu": ResourceQuota(nominal=64_000),
                        "memory": ResourceQuota(nominal=256 * GI),
                        "gpu": ResourceQuota(nominal=8, borrowing_limit=4, lending_limit=2),
                    },
                ),
                FlavorQuota(
                    flavor="gpu-t4-spot",
                    resources={
                        "cpu": ResourceQuota(nominal=128_000),
                        "memory": ResourceQuota(nominal=512 * GI),
                        "gpu": ResourceQuota(nominal=16),
                    },
                ),
            ],
            preemption=PreemptionPolicy(
                within_queue="LowerPriority", reclaim_within_cohort="LowerPriority"
            ),
            flavor_order=["gpu-a100", "gpu-t4-spot"],  # Kueue tries them in this order
        )
    ],
    flavors=[
        FlavorClass(name="gpu-a100", capacity_type="on-demand", gpu_type="a100"),
        FlavorClass(name="gpu-t4-spot", capacity_type="spot", gpu_type="t4"),
    ],
    queue_aliases={"ml-research-queue": "ml-cluster-queue"},  # the seed's LocalQueue
)

SEED_VOLCANO = BrokerConfig(
    queues=[
        QueueConfig(
            name="ml-research-queue",
            weight=4.0,
            reclaimable=True,
            quotas=[
                FlavorQuota(
                    flavor=ANY_FLAVOR,
                    resources={
                        "cpu": ResourceQuota(nominal=64_000, borrowing_limit=0),
                        "memory": ResourceQuota(nominal=256 * GI, borrowing_limit=0),
                        "gpu": ResourceQuota(nominal=8, borrowing_limit=0),
                    },
                )
            ],
        )
    ],
    flavors=[FlavorClass(name=ANY_FLAVOR)],
)


# -- importers ---------------------------------------------------------------------------


def test_seed_kueue_example() -> None:
    assert from_kueue(kueue_docs()) == SEED_KUEUE
    assert kueue_aliases(kueue_docs()) == {"ml-research-queue": "ml-cluster-queue"}


def test_seed_volcano_queue() -> None:
    assert from_volcano(fixture_docs("volcano-queue.yaml")) == SEED_VOLCANO


def test_seed_elastic_quota() -> None:
    config = from_elastic_quota(fixture_docs("koord-elasticquota.yaml"))
    (queue,) = config.queues
    assert queue.name == "pytorch-team-a"
    assert queue.cohort == "elastic-quota"
    assert queue.strategy == "BestEffortFIFO"  # queue policy Priority
    assert queue.quotas == [
        FlavorQuota(
            flavor=ANY_FLAVOR,
            resources={
                "cpu": ResourceQuota(nominal=20_000, borrowing_limit=80_000),
                "memory": ResourceQuota(nominal=40 * GI, borrowing_limit=160 * GI),
                "gpu": ResourceQuota(nominal=2, borrowing_limit=6),
            },
        )
    ]


def test_importer_refuses_other_kinds() -> None:
    with pytest.raises(ConfigError, match="not a Kueue object"):
        from_kueue(fixture_docs("volcano-queue.yaml"))


def test_kueue_defaults_and_details() -> None:
    docs = [
        {
            "apiVersion": "kueue.x-k8s.io/v1beta1",
            "kind": "ResourceFlavor",
            "metadata": {"name": "default-flavor"},
        },
        {
            "apiVersion": "kueue.x-k8s.io/v1beta1",
            "kind": "ResourceFlavor",
            "metadata": {"name": "karpenter-spot"},
            "spec": {
                "nodeLabels": {
                    "karpenter.sh/capacity-type": "spot",
                    "karpenter.k8s.aws/instance-gpu-name": "l4",
                }
            },
        },
        {
            "apiVersion": "kueue.x-k8s.io/v1beta1",
            "kind": "ClusterQueue",
            "metadata": {"name": "team"},
            "spec": {
                "queueingStrategy": "StrictFIFO",
                "fairSharing": {"weight": "2"},
                "preemption": {"withinClusterQueue": "LowerOrNewerEqualPriority"},
                "resourceGroups": [
                    {
                        "coveredResources": ["cpu", "nvidia.com/gpu", "ephemeral-storage"],
                        "flavors": [
                            {
                                "name": "karpenter-spot",
                                "resources": [
                                    {"name": "cpu", "nominalQuota": "500m"},
                                    {"name": "nvidia.com/gpu", "nominalQuota": 4},
                                    {"name": "ephemeral-storage", "nominalQuota": "1Ti"},
                                ],
                            }
                        ],
                    }
                ],
            },
        },
        {
            "apiVersion": "kueue.x-k8s.io/v1beta1",
            "kind": "WorkloadPriorityClass",
            "metadata": {"name": "high"},
            "value": 1000,
        },
    ]
    loaded = import_documents(docs, source="kueue.yaml")
    flavors = {f.name: f for f in loaded.config.flavors}
    assert flavors["default-flavor"] == FlavorClass(name="default-flavor")  # matches anything
    assert flavors["karpenter-spot"] == FlavorClass(
        name="karpenter-spot", capacity_type="spot", gpu_type="l4"
    )
    (queue,) = loaded.config.queues
    assert queue.strategy == "StrictFIFO"
    assert queue.weight == 2.0
    # Kueue's own defaults (Never) are kept when a ClusterQueue does not say
    assert queue.preemption == PreemptionPolicy(
        within_queue="LowerPriority", reclaim_within_cohort="Never"
    )
    assert queue.quotas == [
        FlavorQuota(
            flavor="karpenter-spot",
            resources={"cpu": ResourceQuota(nominal=500), "gpu": ResourceQuota(nominal=4)},
        )
    ]
    notes = "\n".join(loaded.notes)
    assert "LowerOrNewerEqualPriority imported as LowerPriority" in notes
    assert "'ephemeral-storage' ignored" in notes
    assert loaded.config.priority_classes == {"high": 1000}


def test_local_queues_with_one_name_and_two_targets_conflict() -> None:
    docs = kueue_docs()
    other = {
        "apiVersion": "kueue.x-k8s.io/v1beta1",
        "kind": "LocalQueue",
        "metadata": {"name": "ml-research-queue", "namespace": "other"},
        "spec": {"clusterQueue": "elsewhere"},
    }
    with pytest.raises(ConfigError, match="Muster has no namespaces, so rename one"):
        import_documents([*docs, other])


def test_alias_must_point_at_a_queue() -> None:
    docs = fixture_docs("kueue-localqueue.yaml")  # points at a ClusterQueue not imported
    with pytest.raises(ConfigError, match="points at 'ml-cluster-queue', which is not a queue"):
        import_documents(docs)


# -- loading files -----------------------------------------------------------------------


def test_no_path_gives_the_defaults() -> None:
    assert load_config(None) == BrokerConfig()


def test_muster_yaml_with_kubernetes_quantities(tmp_path: Path) -> None:
    path = tmp_path / "broker.yaml"
    path.write_text(
        """
subject_prefix: prod.muster
flavors:
  - {name: spot-a100, capacity_type: spot, gpu_type: a100}
queues:
  - name: ml
    cohort: research
    weight: 3
    strategy: StrictFIFO
    quotas:
      - flavor: spot-a100
        resources:
          cpu: {nominal: "64", borrowing_limit: 0.5}
          memory: {nominal: 256Gi, lending_limit: "1G"}
          gpu: {nominal: "8", borrowing_limit: 4}
timeouts: {heartbeat_s: 2}
"""
    )
    config = load_config(path)
    assert config.subject_prefix == "prod.muster"
    assert config.timeouts == Timeouts(heartbeat_s=2.0)
    (queue,) = config.queues
    assert queue.weight == 3.0 and queue.strategy == "StrictFIFO"
    assert queue.quotas == [
        FlavorQuota(
            flavor="spot-a100",
            resources={
                "cpu": ResourceQuota(nominal=64_000, borrowing_limit=500),
                "memory": ResourceQuota(nominal=256 * GI, lending_limit=10**9),
                "gpu": ResourceQuota(nominal=8, borrowing_limit=4),
            },
        )
    ]


def test_import_and_override(tmp_path: Path) -> None:
    (tmp_path / "kube").mkdir()
    (tmp_path / "kube" / "kueue.yaml").write_text(
        "\n---\n".join(
            fixture_text(n)
            for n in (
                "kueue-resourceflavors.yaml",
                "kueue-clusterqueue.yaml",
                "kueue-localqueue.yaml",
            )
        )
    )
    (tmp_path / "broker.yaml").write_text(
        """
import: [kube/kueue.yaml]
queues:
  - name: ml-cluster-queue
    weight: 5
  - name: adhoc
queue_aliases: {scratch: adhoc}
"""
    )
    loaded = load_config_full(tmp_path / "broker.yaml")
    assert [q.name for q in loaded.config.queues] == ["ml-cluster-queue", "adhoc"]
    assert loaded.config.queues[0] == QueueConfig(name="ml-cluster-queue", weight=5.0)
    assert loaded.config.flavors == SEED_KUEUE.flavors
    assert loaded.aliases == {"ml-research-queue": "ml-cluster-queue", "scratch": "adhoc"}
    assert loaded.sources == [str(tmp_path / "broker.yaml"), "kube/kueue.yaml"]


def test_kubernetes_documents_inline(tmp_path: Path) -> None:
    path = tmp_path / "all.yaml"
    path.write_text("timeouts: {start_s: 60}\n---\n" + fixture_text("volcano-queue.yaml"))
    config = load_config(path)
    assert config.timeouts.start_s == 60.0
    assert config.queues == SEED_VOLCANO.queues


def test_kubernetes_only_file(tmp_path: Path) -> None:
    path = tmp_path / "kueue.yaml"
    path.write_text(
        "\n---\n".join(
            fixture_text(n) for n in ("kueue-resourceflavors.yaml", "kueue-clusterqueue.yaml")
        )
    )
    # No LocalQueue in these files, so no alias.
    assert load_config(path) == msgspec.structs.replace(SEED_KUEUE, queue_aliases={})


def test_examples_load() -> None:
    loaded = load_config_full(EXAMPLES / "broker.yaml")
    names = [q.name for q in loaded.config.queues]
    assert names == ["ml-cluster-queue", "ml-batch-queue", "llm", "default"]
    assert loaded.aliases == {"ml-research-queue": "ml-cluster-queue"}
    assert [(c.name, c.parent) for c in loaded.config.cohorts] == [
        ("ml-team-cohort", "ml-org"),
        ("ml-org", None),
    ]
    volcano = load_config(EXAMPLES / "volcano-queues.yaml")
    assert volcano.queues[0] == SEED_VOLCANO.queues[0]
    assert [(q.name, q.cohort) for q in volcano.queues] == [
        ("ml-research-queue", None),
        ("vision", "research"),
        ("nlp", "research"),
    ]
    assert [(c.name, c.parent) for c in volcano.cohorts] == [("research", "volcano")]


def test_yaml_output_round_trips() -> None:
    loaded = load_config_full(EXAMPLES / "broker.yaml")
    text = config_to_yaml(loaded.config, loaded.aliases)
    again = parse_config(text, source="round-trip")
    assert again.config == loaded.config
    assert again.aliases == loaded.aliases


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "queues:\n  - name: ml\n    quota: []\n",
            r"^broker\.yaml: queues\[0\]\.quota: unknown field 'quota'; did you mean 'quotas'\?",
        ),
        (
            "queues:\n  - name: ML\n",
            r"^broker\.yaml: queues\[0\]\.name: Expected `str` matching regex",
        ),
        (
            "timeouts:\n  heartbeat_s: soon\n",
            r"^broker\.yaml: timeouts\.heartbeat_s: Expected `float`, got `str`",
        ),
        ("queues:\n  - name: a\n  - name: a\n", r"duplicate queue names \['a'\]"),
        (
            "queues:\n  - name: a\n    quotas:\n      - flavor: x\n        resources:\n"
            "          cpu: {nominal: lots}\n",
            r"^broker\.yaml: queues\[0\]\.quotas\[0\]\.resources\.cpu\.nominal: invalid "
            r"quantity 'lots'",
        ),
        (
            "queues:\n  - name: a\n    quotas:\n      - flavor: x\n        resources:\n"
            "          gpu: {nominal: 1.5}\n",
            r"resources\.gpu\.nominal: 1\.5 is not a whole number of GPUs",
        ),
        (
            "queues:\n  - name: a\n    quotas:\n      - flavor: x\n        resources:\n"
            "          nvidia.com/gpu: {nominal: 1}\n",
            r"resources\.nvidia\.com/gpu: unknown resource; use gpu, cpu or memory "
            r"\(Kubernetes' nvidia\.com/gpu is `gpu` here\)",
        ),
        (
            "queues:\n  - name: a\n    quotas:\n      - flavor: x\n        resources:\n"
            "          gpu: 8\n",
            r"resources\.gpu: expected a mapping like \{nominal: 8\}",
        ),
        (
            "flavors: [{name: spot-a100}]\nqueues:\n  - name: a\n    quotas:\n"
            "      - {flavor: spot-a10, resources: {gpu: {nominal: 1}}}\n",
            r"queues\[0\]\.quotas\[0\]\.flavor: 'spot-a10' is not a declared flavor class "
            r"\(did you mean 'spot-a100'\?\)",
        ),
        ("queue_aliases: {x: nowhere}\n", r"queue alias 'x' points at 'nowhere'"),
        ("queue_aliases: {default: default}\n", r"has the name of a queue"),
        ("import: [missing.yaml]\n", r"import 'missing\.yaml': file not found"),
        ("import: 3\n", r"import: expected a list of file paths"),
        ("queues: [\n", r"^broker\.yaml: not valid YAML at line \d+, column \d+"),
        ("a: 1\n---\nb: 2\n", r"document 2: a second Muster config document"),
        ("- 1\n", r"document 1: expected a mapping of broker settings, got list"),
        (
            "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {name: data}\n",
            r"document 1 \(PersistentVolumeClaim data\): v1 PersistentVolumeClaim is not a "
            r"config object Muster imports",
        ),
        (
            "apiVersion: scheduling.volcano.sh/v1beta1\nkind: Queue\nmetadata: {name: Q}\n",
            r"metadata\.name: 'Q' is not a valid name",
        ),
        (
            "apiVersion: scheduling.volcano.sh/v1beta1\nkind: Queue\nmetadata: {name: q}\n"
            "spec: {weight: -1}\n",
            r"\(Queue q\): spec\.weight: -1; use a positive number",
        ),
        (
            "apiVersion: scheduling.volcano.sh/v1beta1\nkind: Queue\nmetadata: {name: q}\n"
            "spec: {capability: {cpu: many}}\n",
            r"spec\.capability\[cpu\]: invalid quantity 'many'",
        ),
        (
            "apiVersion: kueue.x-k8s.io/v1beta1\nkind: ClusterQueue\nmetadata: {name: q}\n"
            "spec: {queueingStrategy: LIFO}\n",
            r"spec\.queueingStrategy: 'LIFO'; use StrictFIFO or BestEffortFIFO",
        ),
        (
            "apiVersion: kueue.x-k8s.io/v1beta1\nkind: ClusterQueue\nmetadata: {name: q}\n"
            "spec:\n  resourceGroups:\n  - flavors:\n    - name: f\n      resources:\n"
            "      - {name: nvidia.com/gpu, nominalQuota: 2, borrowingLimit: x}\n",
            r"spec\.resourceGroups\[0\]\.flavors\[0\]\.resources\[0\]\.borrowingLimit: invalid "
            r"quantity 'x'",
        ),
    ],
)
def test_bad_files_name_the_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("broker.yaml").write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config("broker.yaml")


def test_errors_start_with_the_file_name(tmp_path: Path) -> None:
    path = tmp_path / "broker.yaml"
    path.write_text("queues:\n  - name: ML\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: queues[0].name")


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: file not found"):
        load_config("nope.yaml")


def test_imported_files_hold_kubernetes_objects_only(tmp_path: Path) -> None:
    (tmp_path / "other.yaml").write_text("queues: []\n")
    (tmp_path / "broker.yaml").write_text("import: [other.yaml]\n")
    with pytest.raises(ConfigError, match="imported files hold Kubernetes objects only"):
        load_config(tmp_path / "broker.yaml")


def test_two_imports_defining_one_queue(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(fixture_text("volcano-queue.yaml"))
    (tmp_path / "b.yaml").write_text(fixture_text("volcano-queue.yaml"))
    (tmp_path / "broker.yaml").write_text("import: [a.yaml, b.yaml]\n")
    with pytest.raises(ConfigError, match=r"already defined by a\.yaml: document 1"):
        load_config(tmp_path / "broker.yaml")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=broker_configs())
def test_any_config_survives_yaml(config: BrokerConfig) -> None:
    """`muster config` output (quantities as text) loads back to the same config."""
    assert parse_config(config_to_yaml(config), source="x").config == config
