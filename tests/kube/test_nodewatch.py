"""`assess_node` judges one node with no watch, no API server and no clock of its own: the
node watch's rules can be driven step by step with the time as an argument."""

from __future__ import annotations

import msgspec

from agents.kube.decode import KNode
from agents.kube.nodes import Rules, match_flavor
from agents.kube.nodewatch import NodeEntry, assess_node
from tests.kube.conftest import make_config, node


def entry_of(raw: dict[str, object]) -> tuple[NodeEntry, Rules]:
    cfg = make_config()
    knode = msgspec.convert(raw, KNode)
    flavor = match_flavor(knode, cfg.flavors)
    assert flavor is not None
    return NodeEntry(knode, flavor), Rules(cfg)


def test_a_reclaim_taint_is_news_once_with_a_deadline_from_when_it_was_seen() -> None:
    cfg = make_config()
    taint = {"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}
    entry, rules = entry_of(node("g1", taints=[taint]))
    assert entry.flavor is not None
    first = assess_node(entry, entry.flavor, (), cfg, rules, 1000.0)
    assert first.notice is not None and first.notice.node == "g1"
    assert first.notice.deadline > 1000.0
    assert first.going_away_in_s == round(first.notice.deadline - 1000.0, 1)
    again = assess_node(entry, entry.flavor, (), cfg, rules, 1010.0)
    assert again.notice is None  # already announced
    assert entry.spot_deadline == first.notice.deadline


def test_a_gpu_dip_takes_no_new_pods_only_after_the_debounce() -> None:
    cfg = make_config()
    entry, rules = entry_of(node("g1", gpu=8))
    assert entry.flavor is not None
    assess_node(entry, entry.flavor, (), cfg, rules, 0.0)
    assert entry.known_gpu == 8 and entry.why == []
    entry.raw = msgspec.convert(node("g1", gpu=8, allocatable_gpu=6), KNode)
    assess_node(entry, entry.flavor, (), cfg, rules, 10.0)
    assert entry.dip_since == 10.0 and entry.why == []
    later = 10.0 + cfg.allocatable_debounce_s
    assess_node(entry, entry.flavor, (), cfg, rules, later)
    assert any("not allocatable" in why for why in entry.why), entry.why
