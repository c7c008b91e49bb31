"""Manifests are checked as strictly as `kubectl apply --validate=strict`: a typo is refused with
the field path and the closest known field, and every hostile shape ends in a typed refusal
with a plain message."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from broker.intake import parse_submission
from broker.manifests import ManifestError, jobspec_from_manifest, load_job_document
from kinds.registry import adapter_of
from kinds.schema import FIELD_VALIDATION
from muster.cli import app
from schemas.codec import DecodeError

from .conftest import fixture, fixture_text

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 1 << 20


def _worker(manifest: dict[str, Any]) -> dict[str, Any]:
    worker: dict[str, Any] = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]
    return worker


def test_a_misspelt_replica_count_is_refused_not_dropped() -> None:
    """`replica: 2` used to run one worker (the field was ignored): 4 GPUs instead of 6."""
    manifest = fixture("pytorchjob-ddp-mnist.yaml")
    worker = _worker(manifest)
    worker["replica"] = worker.pop("replicas")
    with pytest.raises(ManifestError) as err:
        jobspec_from_manifest(manifest)
    text = str(err.value)
    assert text.startswith(
        "spec.pytorchReplicaSpecs.Worker.replica: unknown field; did you mean 'replicas'?"
    )
    assert "kubeflow.org/v1 PyTorchJob CRD of Kubeflow training-operator v1.9.0" in text
    assert f"`{FIELD_VALIDATION}: Warn`" in text


def test_a_misspelt_limits_is_refused_not_a_zero_gpu_job() -> None:
    manifest = fixture("pytorchjob-ddp-mnist.yaml")
    resources = _worker(manifest)["template"]["spec"]["containers"][0]["resources"]
    resources["limit"] = resources.pop("limits")
    with pytest.raises(
        ManifestError,
        match=r"^spec\.pytorchReplicaSpecs\.Worker\.template\.spec\.containers\[0\]\.resources"
        r"\.limit: unknown field; did you mean 'limits'\? known fields: claims, limits, requests",
    ):
        jobspec_from_manifest(manifest)


def test_core_kinds_are_checked_against_the_kubernetes_schema() -> None:
    job = yaml.safe_load(fixture_text("batch-job-indexed.yaml"))
    job["spec"]["paralelism"] = 4
    job["spec"]["template"]["spec"]["containers"][0]["imagePullPolice"] = "Always"
    with pytest.raises(ManifestError) as err:
        jobspec_from_manifest(job)
    text = str(err.value)
    assert "spec.paralelism: unknown field; did you mean 'parallelism'?" in text
    assert "imagePullPolice: unknown field; did you mean 'imagePullPolicy'?" in text
    assert "against the Kubernetes 1.33 API" in text
    assert FIELD_VALIDATION not in text  # no newer operator can serve a core field


def test_metadata_is_object_meta_on_every_kind() -> None:
    manifest = fixture("volcano-job.yaml")
    manifest["metadata"]["lables"] = {"team": "a"}
    with pytest.raises(ManifestError, match=r"^metadata\.lables: unknown field; did you mean"):
        jobspec_from_manifest(manifest)


def test_wrong_types_and_enums_are_refused_with_the_path() -> None:
    manifest = fixture("jobset-llm.yaml")
    manifest["spec"]["startupPolicy"] = {"startupPolicyOrder": "Sometimes"}
    manifest["spec"]["failurePolicy"] = {"maxRestarts": "3"}
    with pytest.raises(ManifestError) as err:
        jobspec_from_manifest(manifest)
    text = str(err.value)
    assert (
        "spec.startupPolicy.startupPolicyOrder: unsupported value 'Sometimes'; supported "
        "values: AnyOrder, InOrder"
    ) in text
    assert "spec.failurePolicy.maxRestarts: expected a whole number, got '3'" in text


def test_warn_lets_unknown_fields_through_and_records_them() -> None:
    """A field of a newer operator release than the vendored CRD: the author opts in."""
    manifest = fixture("pytorchjob-ddp-mnist.yaml")
    manifest["spec"]["runPolicy"] = {"managedBy": "kueue.x-k8s.io/multikueue", "futureKnob": 1}
    manifest["metadata"]["annotations"] = {FIELD_VALIDATION: "Warn"}
    spec = jobspec_from_manifest(manifest)
    assert spec.labels["muster.dev/unknown-fields"] == "spec.runPolicy.futureKnob"
    # a wrong type is refused all the same
    manifest["spec"]["runPolicy"]["backoffLimit"] = "three"
    with pytest.raises(ManifestError, match="backoffLimit: expected a whole number"):
        jobspec_from_manifest(manifest)


def test_the_cli_reads_the_same_refusal(tmp_path: Path) -> None:
    text = fixture_text("tfjob-ps.yaml").replace("replicas: 4", "replica: 4")
    with pytest.raises(ManifestError, match=r"^job\.yaml: spec\.tfReplicaSpecs\.Worker\.replica"):
        load_job_document(text, source="job.yaml")


def test_muster_submit_refuses_the_typo_before_sending(tmp_path: Path) -> None:
    """Through the real command: exit 1 and one error line naming the field, nothing sent."""
    path = tmp_path / "job.yaml"
    path.write_text(fixture_text("pytorchjob-ddp-mnist.yaml").replace("limits:", "limit:"))
    result = CliRunner().invoke(app, ["submit", str(path), "--nats", "nats://127.0.0.1:1"])
    assert result.exit_code == 1
    assert "resources.limit: unknown field; did you mean 'limits'?" in result.stderr
    assert "nats" not in result.stderr.lower()  # refused before any connection


def test_every_example_and_fixture_job_passes() -> None:
    """No false refusal: the upstream-shaped jobs of the repository are all valid."""
    paths = sorted((ROOT / "examples" / "jobs").glob("*.yaml"))
    paths += sorted((ROOT / "tests" / "cli" / "fixtures").glob("*.yaml"))
    checked = 0
    for path in paths:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        if len(docs) != 1:
            continue
        try:
            adapter_of(docs[0])
        except ValueError:
            continue  # a queue or quota object
        jobspec_from_manifest(docs[0])
        checked += 1
    assert checked >= 15


# -- hostile shapes ---------------------------------------------------------------------------

# Python's own words: a refusal carrying them leaked an exception, not a reason.
_LEAK = re.compile(
    r"invalid literal|Traceback|has no attribute|NoneType|not subscriptable|unhashable|"
    r"Exceeds the limit|could not convert|KeyError|TypeError|AttributeError|ValueError|"
    r"object is not|argument must be|not supported between|unsupported operand",
)

_BASES: list[dict[str, Any]] = [
    fixture(name)
    for name in (
        "pytorchjob-ddp-mnist.yaml",
        "mpijob-horovod.yaml",
        "tfjob-ps.yaml",
        "volcano-job.yaml",
        "jobset-llm.yaml",
        "batch-job-indexed.yaml",
    )
] + [
    yaml.safe_load((ROOT / "examples" / "jobs" / name).read_text())
    for name in ("rayjob.yaml", "trainjob.yaml")
]

_HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
    st.sampled_from(["²", "9" * 5000, "1e400", "-1", "8Gi", "0x10", " 3 ", "", "٣", "1.5"]),
    st.lists(st.integers(min_value=-2, max_value=2), max_size=3),
    st.dictionaries(st.sampled_from(["", "a", "replicas", "name"]), st.integers(), max_size=2),
)


# Where a number is read: counts and resource quantities.
_COUNTS = {"replicas", "parallelism", "completions", "minAvailable", "numNodes", "minReplicas"}
_RESOURCES = {"limits", "requests", "resourcesPerNode"}


def _paths(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*at, i))
    return out


@st.composite
def hostile_manifests(draw: st.DrawFn) -> dict[str, Any]:
    manifest = copy.deepcopy(draw(st.sampled_from(_BASES)))
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        paths = [p for p in _paths(manifest) if p]
        counts = [p for p in paths if p[-1] in _COUNTS or (len(p) > 1 and p[-2] in _RESOURCES)]
        if not paths:
            break
        path = draw(st.sampled_from(counts if counts and draw(st.booleans()) else paths))
        parent: Any = manifest
        for key in path[:-1]:
            parent = parent[key]
        if draw(st.booleans()) and isinstance(parent, dict):
            value = parent.pop(path[-1])
            parent[draw(st.sampled_from(["replica", "limit", "", "Worker", path[-1]]))] = value
        else:
            parent[path[-1]] = draw(_HOSTILE)
    return manifest


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_manifests())
def test_hostile_manifests_end_in_a_plain_refusal(manifest: dict[str, Any]) -> None:
    data = json.dumps(manifest).encode()
    try:
        parse_submission(data, LIMIT, None)
    except DecodeError as exc:
        assert not _LEAK.search(str(exc)), str(exc)


def _set_everywhere(value: Any, keys: set[str], new: Any) -> int:
    """Replace every value under one of `keys` (or every entry of a map under one of them)."""
    hits = 0
    if isinstance(value, dict):
        for k, v in value.items():
            if k in keys and not isinstance(v, dict | list):
                value[k] = copy.deepcopy(new)
                hits += 1
            elif k in keys and isinstance(v, dict) and k in _RESOURCES:
                for entry in v:
                    v[entry] = copy.deepcopy(new)
                    hits += 1
            else:
                hits += _set_everywhere(v, keys, new)
    elif isinstance(value, list):
        hits += sum(_set_everywhere(v, keys, new) for v in value)
    return hits


@pytest.mark.parametrize(
    "value", ["²", "9" * 5000, None, [8], {"n": 8}, 1.5, -1, True, "1e400", "", " 2 ", 2**70]
)
@pytest.mark.parametrize("where", ["counts", "resources"])
def test_every_kind_refuses_a_bad_number_plainly(value: Any, where: str) -> None:
    """The shapes that once escaped as Python exceptions (`int('²')`, a 5,000-digit count,
    a null or a list as a GPU limit), in every kind's count and resource fields."""
    keys = _COUNTS if where == "counts" else _RESOURCES
    for base in _BASES:
        manifest = copy.deepcopy(base)
        if not _set_everywhere(manifest, keys, value):
            continue
        try:
            parse_submission(json.dumps(manifest).encode(), LIMIT, None)
        except DecodeError as exc:
            assert not _LEAK.search(str(exc)), str(exc)
