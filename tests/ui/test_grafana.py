"""The shipped Grafana dashboard only queries metrics (and labels) the broker or an agent
really exports."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from agents.config import FakeClusterConfig
from agents.fake.cluster import FakeCluster
from agents.kube.backend import KubeBackend
from agents.metrics import AgentMetrics
from agents.runtime import AgentRuntime
from tests.broker.conftest import Harness
from tests.kube.conftest import make_config
from tests.support import DEPLOY

DASHBOARD = DEPLOY / "grafana" / "muster.json"
FUNCTIONS = frozenset(
    {"sum", "max", "min", "avg", "count", "rate", "increase", "irate", "clamp_min", "topk"}
)
GROUPING = frozenset({"by", "without", "on", "ignoring"})
TARGET_LABELS = frozenset({"job", "instance"})  # added by Prometheus at scrape time
TOKEN = re.compile(
    r"""\s*(?:
      (?P<labels>\{[^}]*\})
    | (?P<range>\[[^\]]*\])
    | (?P<var>\$\w+)
    | (?P<number>\d+(?:\.\d+)?(?:e-?\d+)?)
    | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
    | (?P<op>[()+\-*/,]|[<>=!]=?)
    )""",
    re.VERBOSE,
)
MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*')


class PromQLError(ValueError):
    pass


def parse(expr: str) -> tuple[set[str], set[str]]:
    """Metric names and label names an expression uses; raises PromQLError on what it does not
    understand (so a typo cannot slip through as an unknown token)."""
    metrics: set[str] = set()
    labels: set[str] = set()
    tokens = []
    pos = 0
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        if m is None or m.end() == pos:
            if expr[pos:].strip() == "":
                break
            raise PromQLError(f"cannot read {expr[pos : pos + 20]!r} in {expr!r}")
        kind = m.lastgroup
        assert kind is not None
        tokens.append((kind, m.group(kind)))
        pos = m.end()
    depth = 0
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        nxt = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if kind == "op" and text == "(":
            depth += 1
        elif kind == "op" and text == ")":
            depth -= 1
            if depth < 0:
                raise PromQLError(f"unbalanced ')' in {expr!r}")
        elif kind == "labels":
            body = text[1:-1]
            for part in filter(None, (p for p in _split_matchers(body))):
                mm = MATCHER.fullmatch(part)
                if mm is None:
                    raise PromQLError(f"bad label matcher {part!r} in {expr!r}")
                labels.add(mm.group(1))
        elif kind == "ident":
            if text in GROUPING:
                if nxt != "(":
                    raise PromQLError(f"{text} needs a label list in {expr!r}")
                close = next(j for j in range(i + 2, len(tokens)) if tokens[j][1] == ")")
                labels.update(t for k, t in tokens[i + 2 : close] if k == "ident")
                i = close + 1
                continue
            if nxt == "(" or nxt in GROUPING:  # a call, or `sum by (...) (...)`
                if text not in FUNCTIONS:
                    raise PromQLError(f"unknown function {text!r} in {expr!r}")
            else:
                metrics.add(text)
        i += 1
    if depth != 0:
        raise PromQLError(f"unbalanced '(' in {expr!r}")
    return metrics, labels


def _split_matchers(body: str) -> list[str]:
    parts, current, quoted = [], "", False
    for ch in body:
        if ch == '"' and not current.endswith("\\"):
            quoted = not quoted
        if ch == "," and not quoted:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p for p in parts if p.strip()]


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", []) if "expr" in t]


def test_the_parser_catches_typos() -> None:
    assert parse('sum by (state) (muster_jobs{state="queued"})') == ({"muster_jobs"}, {"state"})
    for bad in ("sum(muster_jobs", "sumx(muster_jobs)", "muster_jobs{state=queued}", "by muster"):
        with pytest.raises(PromQLError):
            parse(bad)


async def test_every_query_names_an_exported_metric_and_label(harness: Harness) -> None:
    broker = await harness.start_broker()
    exported: dict[str, set[str]] = {}  # sample name -> its label names
    for family in broker.metrics.registry.collect():
        for sample in family.samples:
            exported.setdefault(sample.name, set()).update(sample.labels)
    assert "muster_jobs" in exported  # the broker leads: every family is there
    # Agents: a fake one, and a kube one that has counted one bad object from its API server.
    kube = KubeBackend("k1", make_config())
    kube.bad_input.note("Node", "no name")
    runtimes = {
        "c1": AgentRuntime(FakeCluster("c1", FakeClusterConfig()), harness.nc),
        "k1": AgentRuntime(kube, harness.nc),
    }
    for family in AgentMetrics(lambda: runtimes).registry.collect():
        for sample in family.samples:
            exported.setdefault(sample.name, set()).update(sample.labels)
    assert {"muster_agent_runtime_total", "muster_agent_bad_input_total"} <= set(exported)
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = _exprs(dashboard)
    assert len(exprs) >= 10
    variables = [
        v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"
    ]
    for query in variables:
        m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query)
        assert m is not None and m.group(1) in exported, query
    for expr in exprs:
        metrics, labels = parse(expr)
        assert metrics, f"no metric in {expr!r}"
        for name in metrics:
            assert name in exported, f"{expr!r} queries {name!r}, which is not exported"
        known = set().union(*(exported[n] for n in metrics)) | TARGET_LABELS
        assert labels <= known, f"{expr!r} uses labels {labels - known} not on {metrics}"
