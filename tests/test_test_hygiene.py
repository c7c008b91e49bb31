"""The core's tests read it through its public read-only views (`Scheduler.allocations`,
`queue_states`, `cohort_states`, `cluster_states`, `machine.views`, ...), never through private
attributes: a test that reaches into `_inv` or `_ledger` keeps passing after the views it should
be checking break, and pins internals that a refactor must be free to change."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE_TESTS = ROOT / "tests" / "core"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_attributes(source: str) -> list[tuple[int, str]]:
    """(line, expression) of every use of an underscore attribute (dunders excepted)."""
    found = [
        (node.lineno, ast.unparse(node))
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and _is_private(node.attr)
    ]
    return sorted(found)


def test_the_scan_finds_private_attributes_and_passes_public_ones() -> None:
    """A control: the scan would catch the reads the core tests used to make."""
    source = (
        "pool = s._inv.clusters['c'].pools['sp']\n"
        "assert not quota_broken(s.queue_states(), s._book)\n"
        "name = type(s).__name__\n"
        "allocs = s.allocations()\n"
        "s._ledger = None\n"
    )
    assert private_attributes(source) == [(1, "s._inv"), (2, "s._book"), (5, "s._ledger")]


def test_core_tests_read_the_core_through_public_views_only() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {expr}"
        for path in sorted(CORE_TESTS.rglob("*.py"))
        for line, expr in private_attributes(path.read_text())
    ]
    assert not found, (
        "tests/core reads private attributes; use the owner's read-only view (Scheduler "
        "allocations(), queue_states(), cohort_states(), cluster_states(), machine.views) or "
        "add a small public query to the owning class in broker/core:\n" + "\n".join(found)
    )
