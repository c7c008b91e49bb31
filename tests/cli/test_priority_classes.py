"""Priority classes: a manifest's `priorityClassName`, Kueue's WorkloadPriorityClass label and
Volcano's `spec.priorityClassName` become the job's priority through the broker config (or the
PriorityClass / WorkloadPriorityClass objects it imports); an unknown class is refused."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from typer.testing import CliRunner

from broker.config import ConfigError, import_documents, parse_config
from broker.embedded import EmbeddedNats
from broker.manifests import ManifestError, jobspec_from_manifest
from muster.cli import app
from schemas.config import QueueConfig
from tests.world import ThreadedWorld, World, flavor

from .conftest import FIXTURES, fixture

runner = CliRunner()
CLASS = "muster.dev/priority-class"


def _class_of(manifest: dict[str, Any]) -> str | None:
    return jobspec_from_manifest(manifest).labels.get(CLASS)


def test_the_pod_templates_class_is_recorded_for_the_broker() -> None:
    spec = jobspec_from_manifest(fixture("pytorchjob-priority-class.yaml"))
    assert spec.labels[CLASS] == "high-priority"
    assert spec.priority == 0  # the broker's config says what the class means


def test_kueues_workload_priority_class_label_wins_over_the_pods() -> None:
    manifest = fixture("pytorchjob-priority-class.yaml")
    manifest["metadata"]["labels"] = {"kueue.x-k8s.io/priority-class": "batch-low"}
    assert _class_of(manifest) == "batch-low"


def test_volcanos_job_priority_class() -> None:
    manifest = fixture("volcano-job.yaml")
    manifest["spec"]["priorityClassName"] = "volcano-high"
    assert _class_of(manifest) == "volcano-high"


def test_a_numeric_priority_annotation_wins_over_any_class() -> None:
    manifest = fixture("pytorchjob-priority-class.yaml")
    manifest["metadata"]["annotations"] = {"muster.dev/priority": "7"}
    spec = jobspec_from_manifest(manifest)
    assert spec.priority == 7 and CLASS not in spec.labels


def test_templates_naming_different_classes_are_refused() -> None:
    manifest = fixture("pytorchjob-ddp-mnist.yaml")
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    replicas["Master"]["template"]["spec"]["priorityClassName"] = "high"
    replicas["Worker"]["template"]["spec"]["priorityClassName"] = "low"
    with pytest.raises(ManifestError, match="the pod templates name different priority classes"):
        jobspec_from_manifest(manifest)


def _priority_class(kind: str, name: str, value: Any, **extra: Any) -> dict[str, Any]:
    api = "scheduling.k8s.io/v1" if kind == "PriorityClass" else "kueue.x-k8s.io/v1beta1"
    return {"apiVersion": api, "kind": kind, "metadata": {"name": name}, "value": value, **extra}


def test_the_config_imports_priority_classes() -> None:
    loaded = import_documents(
        [
            _priority_class("PriorityClass", "high-priority", 1000, globalDefault=True),
            _priority_class("WorkloadPriorityClass", "batch-low", -10),
        ],
        source="classes.yaml",
    )
    assert loaded.config.priority_classes == {"high-priority": 1000, "batch-low": -10}
    assert any("globalDefault is not applied" in n for n in loaded.notes)


def test_a_class_beyond_the_job_priorities_must_be_mapped() -> None:
    system = _priority_class("PriorityClass", "system-critical", 2_000_000_000)
    with pytest.raises(ConfigError, match=r"value 2000000000 is outside Muster's job priorities"):
        import_documents([system], source="classes.yaml")
    text = (
        "priority_classes: {system-critical: 900000}\n---\n"
        "apiVersion: scheduling.k8s.io/v1\nkind: PriorityClass\n"
        "metadata: {name: system-critical}\nvalue: 2000000000\n"
    )
    config = parse_config(text, source="broker.yaml").config
    assert config.priority_classes == {"system-critical": 900000}


# -- through the real command and broker -----------------------------------------------------


async def _start(w: World) -> None:
    w.harness.config = msgspec.structs.replace(
        w.harness.config,
        queues=[QueueConfig(name="default")],
        priority_classes={"high-priority": 100, "batch-low": -5},
    )
    await w.start({"c1": [flavor("a100-od", capacity="on-demand", nodes=2)]}, start_delay_s=0.1)


@pytest.fixture
def live(fresh_nats: EmbeddedNats) -> Iterator[tuple[ThreadedWorld, World]]:
    threaded = ThreadedWorld(fresh_nats.url, _start)
    with threaded as world:
        yield threaded, world


def test_submit_maps_the_class_and_refuses_an_unknown_one(
    live: tuple[ThreadedWorld, World], tmp_path: Any
) -> None:
    threaded, world = live
    manifest = FIXTURES / "pytorchjob-priority-class.yaml"
    url = world.harness.url
    result = runner.invoke(app, ["submit", str(manifest), "--job-id", "hp-1", "--nats", url])
    assert result.exit_code == 0, result.stderr
    view = threaded.call(world.job("hp-1"))
    assert view["spec"]["priority"] == 100
    assert view["spec"]["labels"][CLASS] == "high-priority"

    unknown = tmp_path / "urgent.yaml"
    unknown.write_text(manifest.read_text().replace("high-priority", "urgent"))
    result = runner.invoke(app, ["submit", str(unknown), "--job-id", "u-1", "--nats", url])
    assert result.exit_code == 1
    assert (
        "unknown priority class 'urgent'; known priority classes: batch-low (-5), "
        "high-priority (100)"
    ) in result.stderr
