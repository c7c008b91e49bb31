"""Cordon, uncordon, drain and a spot notice on the local backend, with real processes:
a cordoned node refuses new gangs (replicas already there keep running), a drain SIGTERMs the
replicas on the node and their attempts end `evicted` (an infrastructure loss, not a cancel),
and a notice works on spot nodes only."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from agents.backend import BackendError
from schemas.agent import NodeUpsert, SpotNotice
from tests.local.conftest import dispatch, local_config

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


def node_reports(rec: Any, name: str) -> list[Any]:
    return [e.node for e in rec.events if isinstance(e, NodeUpsert) and e.node.name == name]


async def test_cordon_refuses_new_gangs_and_drain_ends_what_runs_as_evicted(
    started: Any, tmp_path: Path
) -> None:
    b, rec = await started(local_config(tmp_path, capacity="on-demand"))
    await b.dispatch(dispatch("before", SLEEP, ["lab-slots-0"]))
    await b.dispatch(dispatch("other", SLEEP, ["lab-slots-1"]))
    await rec.wait(lambda: "running" in rec.phases("before"))
    done = await b.node_op("cordon", "lab-slots-0", "disk check")
    assert done.nodes == ["lab-slots-0"] and done.attempts == []
    report = node_reports(rec, "lab-slots-0")[-1]
    assert report.no_new_pods and report.note == "cordoned by an operator: disk check"
    with pytest.raises(BackendError, match="is cordoned; it takes no new gangs until"):
        await b.dispatch(dispatch("after", SLEEP, ["lab-slots-0"]))
    assert sorted(b.live_workloads()) == [("before", 1), ("other", 1)]  # still running

    done = await b.node_op("drain", "lab-slots-0", "")
    assert done.attempts == [("before", 1)]
    ended = await rec.ended("before")
    assert ended.phase == "evicted" and ended.reason == "node-drained"
    assert b.live_workloads() == [("other", 1)]
    assert b.history["before"][0]["phase"] == "evicted"

    await b.node_op("uncordon", "lab-slots-0", "")
    assert not node_reports(rec, "lab-slots-0")[-1].no_new_pods
    await b.dispatch(dispatch("after", SLEEP, ["lab-slots-0"]))
    await rec.wait(lambda: "running" in rec.phases("after"))


async def test_notice_only_on_spot_nodes_and_unknown_nodes_are_refused(
    started: Any, tmp_path: Path
) -> None:
    b, rec = await started(local_config(tmp_path, spot_notice_s=60))
    with pytest.raises(BackendError, match="has no node 'lab-slots-7'; its nodes: lab-slots-0"):
        await b.node_op("drain", "lab-slots-7", "")
    with pytest.raises(BackendError, match="names one node"):
        await b.node_op("notice", None, "")
    done = await b.node_op("notice", "lab-slots-1", "")
    assert done.nodes == ["lab-slots-1"]
    assert [e.node for e in rec.events if isinstance(e, SpotNotice)] == ["lab-slots-1"]
    od, od_rec = await started(local_config(tmp_path / "od", capacity="on-demand"))
    with pytest.raises(BackendError, match="is on-demand capacity"):
        await od.node_op("notice", "lab-slots-0", "")
    assert not any(isinstance(e, SpotNotice) for e in od_rec.events)
