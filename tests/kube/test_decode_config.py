"""Raw watch decoding (tolerant of unknown/missing fields and garbage) and the backend config
(errors name the field)."""

from __future__ import annotations

import json

import pytest

from agents.kube.backend import KubeBackend
from agents.kube.config import KubeConfigError
from agents.kube.decode import KNode, KObject, KPod, decode_list, decode_watch_line
from tests.kube.conftest import BASE_CONFIG, node, pod


def line(obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_decode_pod_event_keeps_needed_fields_only() -> None:
    raw = pod("p", "n1", gpu=2, phase="Running", labels={"a": "b"}, annotations={"k": "v"})
    raw["metadata"]["managedFields"] = [{"manager": "kubelet", "fieldsV1": {"f:x": {}}}]
    raw["metadata"]["resourceVersion"] = "42"
    raw["status"]["someFutureField"] = {"nested": [1, 2, 3]}
    ev = decode_watch_line(line({"type": "MODIFIED", "object": raw}), KPod)
    assert ev is not None and ev.type == "MODIFIED" and ev.obj is not None
    assert ev.resource_version == "42"
    assert ev.obj.spec.nodeName == "n1" and ev.obj.status.phase == "Running"
    assert ev.obj.spec.containers[0].resources.limits == {"nvidia.com/gpu": "2"}
    assert ev.obj.metadata.labels == {"a": "b"}


def test_decode_tolerates_missing_fields_and_rejects_garbage() -> None:
    ev = decode_watch_line(b'{"type":"ADDED","object":{}}', KNode)
    assert ev is not None and ev.obj is not None and ev.obj.metadata.name == ""
    ev = decode_watch_line(b'{"type":"DELETED","object":{"metadata":{"name":"x"}}}', KPod)
    assert ev is not None and ev.obj is not None and ev.obj.status.phase == ""
    for bad in [
        b"",
        b"\n",
        b"not json at all",
        b'{"type":',
        b"[1,2,3]",
        b'{"object":{}}',  # no type
        b'{"type":"ADDED","object":{"metadata":["wrong shape"]}}',
        b'{"type":"ADDED","object":{"spec":{"taints":"nope"}}}',
        b"\xff\xfe\x00",
    ]:
        assert decode_watch_line(bad, KNode) is None, bad


def test_decode_error_and_bookmark_events() -> None:
    err = decode_watch_line(
        line(
            {
                "type": "ERROR",
                "object": {
                    "kind": "Status",
                    "status": "Failure",
                    "message": "too old resource version: 1 (5)",
                    "reason": "Expired",
                    "code": 410,
                },
            }
        ),
        KPod,
    )
    assert err is not None and err.type == "ERROR" and err.error is not None
    assert err.error.code == 410 and err.error.reason == "Expired"
    bm = decode_watch_line(
        line(
            {
                "type": "BOOKMARK",
                "object": {
                    "kind": "Node",
                    "apiVersion": "v1",
                    "metadata": {
                        "resourceVersion": "12345",
                        "annotations": {"k8s.io/initial-events-end": "true"},
                    },
                },
            }
        ),
        KNode,
    )
    assert bm is not None and bm.type == "BOOKMARK" and bm.resource_version == "12345"


def test_decode_list_with_continue_token() -> None:
    body = line(
        {
            "kind": "NodeList",
            "metadata": {"resourceVersion": "77", "continue": "tok"},
            "items": [node("a"), node("b")],
        }
    )
    page = decode_list(body, KNode)
    assert page.metadata.resourceVersion == "77" and page.metadata.continue_ == "tok"
    assert [n.metadata.name for n in page.items or []] == ["a", "b"]
    empty = decode_list(b'{"metadata":{},"items":null}', KObject)
    assert empty.items is None


def test_from_config_builds_and_errors_name_the_field() -> None:
    backend = KubeBackend.from_config("c1", BASE_CONFIG)
    assert backend.cluster == "c1" and backend.config.namespace == "muster-workloads"
    assert backend.config.spot_deadlines_s.aws == 120.0
    assert backend.config.spot_deadlines_s.gcp == backend.config.spot_deadlines_s.azure == 30.0
    cases = [
        ({**BASE_CONFIG, "flavours": []}, "flavours"),
        ({**BASE_CONFIG, "resync_period_s": 0}, "resync_period_s"),
        ({**BASE_CONFIG, "spot_deadlines_s": {"aws": -1}}, "spot_deadlines_s.aws"),
        (
            {**BASE_CONFIG, "flavors": [{"name": "x", "capacity_type": "reserved"}]},
            "flavors[0].capacity_type",
        ),
        (
            {
                **BASE_CONFIG,
                "flavors": [
                    {"name": "x", "capacity_type": "spot", "tolerations": [{"value": "v"}]}
                ],
            },
            "tolerations",
        ),
        ({**BASE_CONFIG, "flavors": [BASE_CONFIG["flavors"][0]] * 2}, "duplicate"),
        ({**BASE_CONFIG, "in_cluster": True, "kubeconfig": "/k"}, "in_cluster"),
        ({"namespace": "x"}, "flavors"),
    ]
    for raw, field in cases:
        with pytest.raises(KubeConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
            KubeBackend.from_config("c1", raw)
