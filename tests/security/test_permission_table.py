"""The permission table in docs/security.md is what `muster nats-config` generates: each row,
with its placeholders filled in for every team and cluster, names exactly the subjects the
generated authorization allows (and denies) that user."""

from __future__ import annotations

import json
import re
from pathlib import Path

from broker.natsconfig import queues_by_team, render
from tests.security.conftest import CLUSTERS, CONFIG

DOC = Path(__file__).parents[2] / "docs" / "security.md"
Perms = dict[str, tuple[str, ...]]


def generated(conf: str) -> dict[str, Perms]:
    """user -> {"publish": allowed, "subscribe": allowed, "deny": denied, "responses": ...}."""
    users: dict[str, Perms] = {}
    for block in re.split(r"\n\s*\{\n", conf)[1:]:
        user = re.search(r'user: "([^"]+)"', block)
        assert user is not None, block
        pub = re.search(r"publish: \{ allow: (\[.*?\]) \}", block)
        sub = re.search(r"subscribe: \{ allow: (\[.*?\]) \}", block)
        deny = re.search(r"subscribe: \{ deny: (\[.*?\]) \}", block)
        users[user.group(1)] = {
            "publish": tuple(sorted(json.loads(pub.group(1)) if pub else [])),
            "subscribe": tuple(sorted(json.loads(sub.group(1)) if sub else [])),
            "deny": tuple(sorted(json.loads(deny.group(1)) if deny else [])),
            "responses": ("yes",) if "allow_responses" in block else (),
        }
    return users


def documented() -> dict[str, tuple[str, str]]:
    """The table's rows: user pattern -> (publish cell, subscribe cell)."""
    text = DOC.read_text()
    table = text[text.index("## Permission table") :]
    rows: dict[str, tuple[str, str]] = {}
    for line in table.splitlines()[1:]:
        if line.startswith("## "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


def _subjects(cell: str, fill: dict[str, str], queues: list[str]) -> list[str]:
    out: list[str] = []
    for subject in re.findall(r"`([^`]+)`", cell):
        if "<queue>" in subject:
            out += [subject.replace("<queue>", q) for q in queues]
            continue
        for key, value in fill.items():
            subject = subject.replace(f"<{key}>", value)
        if "<team>" in subject:  # a row naming every team's subject (the broker's answers)
            out += [subject.replace("<team>", team) for team in queues_by_team(CONFIG)]
            continue
        out.append(subject)
    return out


def test_the_documented_table_is_the_generated_config() -> None:
    gen = generated(render(CONFIG, CLUSTERS, leaves=CLUSTERS))
    rows = documented()
    teams = queues_by_team(CONFIG)
    expected: dict[str, Perms] = {}
    for user in gen:
        if user.startswith("agent-"):
            pattern, fill, queues = "agent-<cluster>", {"cluster": user[6:]}, []
        elif user.startswith("muster-leaf-"):
            pattern, fill, queues = "muster-leaf-<cluster>", {"cluster": user[12:]}, []
        elif user.startswith("team-"):
            pattern, fill = "team-<team>", {"team": user[5:]}
            queues = teams[user[5:]]
        else:
            pattern, fill, queues = user, {}, []
        assert pattern in rows, f"docs/security.md has no row for {pattern!r}"
        pub_cell, sub_cell = rows[pattern]
        subscribe = _subjects(sub_cell, fill, queues)
        denies = "deny" in sub_cell
        expected[user] = {
            "publish": tuple(sorted(_subjects(pub_cell, fill, queues))),
            "subscribe": () if denies else tuple(sorted(subscribe)),
            "deny": tuple(sorted(subscribe)) if denies else (),
            "responses": ("yes",) if "replies to what it is asked" in pub_cell else (),
        }
    assert expected == gen
    assert sorted(rows) == sorted(
        {"agent-<cluster>", "muster-leaf-<cluster>", "team-<team>", "broker", "admin", "workload"}
    )
