"""`assess_node` judges one node with no watch, no API server and no clock of its own: the
node watch's rules can be driven step by step with the time as an argument, and since it
returns the node's new signals instead of editing them, a judgement can be replayed."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.kube.config import DEFAULT_GPU_FAILURE_CONDITIONS, DEFAULT_SPOT_TAINTS
from agents.kube.decode import KNode
from agents.kube.nodes import Rules, match_flavor
from agents.kube.nodewatch import OUT_OF_SERVICE, Assessment, NodeSignals, Observation, assess_node
from tests.kube.conftest import make_config, node

CFG = make_config()
RULES = Rules(CFG)


def seen(raw: dict[str, Any], **flags: bool) -> Observation:
    knode = msgspec.convert(raw, KNode)
    flavor = match_flavor(knode, CFG.flavors)
    assert flavor is not None
    return Observation(knode, flavor, **flags)


def test_a_reclaim_taint_is_news_once_with_a_deadline_from_when_it_was_seen() -> None:
    taint = {"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}
    obs = seen(node("g1", taints=[taint]))
    signals, first = assess_node(NodeSignals(), obs, CFG, RULES, 1000.0)
    assert first.notice is not None and first.notice.node == "g1"
    assert first.notice.deadline > 1000.0
    assert first.going_away_in_s == round(first.notice.deadline - 1000.0, 1)
    signals, again = assess_node(signals, obs, CFG, RULES, 1010.0)
    assert again.notice is None  # already announced
    assert signals.spot_deadline == first.notice.deadline


def test_a_gpu_dip_takes_no_new_pods_only_after_the_debounce() -> None:
    signals, _ = assess_node(NodeSignals(), seen(node("g1", gpu=8)), CFG, RULES, 0.0)
    assert signals.known_gpu == 8 and signals.why == ()
    dipped = seen(node("g1", gpu=8, allocatable_gpu=6))
    signals, _ = assess_node(signals, dipped, CFG, RULES, 10.0)
    assert signals.dip_since == 10.0 and signals.why == ()
    later = 10.0 + CFG.allocatable_debounce_s
    signals, _ = assess_node(signals, dipped, CFG, RULES, later)
    assert any("not allocatable" in why for why in signals.why), signals.why


def no_news(found: Assessment) -> bool:
    return found == Assessment()


@st.composite
def observations(draw: st.DrawFn) -> Observation:
    """A node of the a100-spot flavor in any mix of the states the watch times or reports."""
    taints = []
    if draw(st.booleans()):
        taints.append({"key": draw(st.sampled_from(DEFAULT_SPOT_TAINTS)), "effect": "NoSchedule"})
    if draw(st.booleans()):
        taints.append({"key": OUT_OF_SERVICE, "value": "nodeshutdown", "effect": "NoExecute"})
    if draw(st.booleans()):
        taints.append({"key": "example.com/untolerated", "effect": "NoSchedule"})
    conditions = []
    if draw(st.booleans()):
        kind = draw(st.sampled_from(DEFAULT_GPU_FAILURE_CONDITIONS))
        conditions.append({"type": kind, "status": "True", "reason": "XID 79"})
    gpu = draw(st.integers(0, 8))
    raw = node(
        "g1",
        gpu=gpu,
        allocatable_gpu=draw(st.integers(0, gpu)),
        taints=taints,
        conditions=conditions,
        ready=draw(st.booleans()),
    )
    raw["spec"]["unschedulable"] = draw(st.booleans())
    return seen(raw, unselected=draw(st.booleans()), left_flavor=draw(st.booleans()))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(observations(), st.floats(0.0, 400.0)), min_size=1, max_size=6))
def test_a_replayed_observation_is_no_news_and_the_old_signals_are_left_alone(
    steps: list[tuple[Observation, float]],
) -> None:
    """Whatever the history: judging leaves its input as it was, and judging the same node
    again at the same moment changes nothing and sends nothing (each notice, fault and loss
    is news once)."""
    signals, now = NodeSignals(), 1000.0
    for obs, dt in steps:
        now += dt
        before = dataclasses.replace(signals)
        new, _ = assess_node(signals, obs, CFG, RULES, now)
        assert signals == before
        again, found = assess_node(new, obs, CFG, RULES, now)
        assert again == new
        assert no_news(found), found
        signals = new
