"""Tests read the code through its public read-only views (`Scheduler.allocations`,
`queue_states`, `machine.views`, `KubeBackend.node_signals`, `attempt_pods`, ...), never through
private attributes: a test that reaches into `_inv` or `_nodes` keeps passing after the views it
should be checking break, and pins internals that a refactor must be free to change. A test
helper's own state (`self._x` inside its class) is its business."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The only reads past a public surface, each on purpose and with its reason. Any other private
# read fails the test below, and so does an entry here that no longer occurs.
DELIBERATE: dict[tuple[str, str], str] = {
    # shell/natsio.py reads these nats-py internals (nats-py has no public form of them); this
    # test pins them for each nats-py release it allows.
    ("tests/shell/test_natsio.py", "nc._flush_pending"): "nats-py internal the shims call",
    ("tests/shell/test_natsio.py", "js._prefix"): "nats-py internal the shims read",
    ("tests/shell/test_natsio.py", "js._nc"): "nats-py internal the shims read",
    # A processing step that never returns (the broker stuck on a poison message until
    # killed) can only be injected at the submission boundary itself; a public hook in the
    # broker for it would exist for this test alone.
    ("tests/broker/test_dead_letters.py", "Broker._submit_guarded"): "fault injection",
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own(node: ast.Attribute) -> bool:
    """`self._x` or `cls._x`: a helper class using its own state."""
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def private_attributes(source: str) -> list[tuple[int, str]]:
    """(line, expression) of every use of another object's underscore attribute (dunders
    and a class's own `self._x` excepted)."""
    found = [
        (node.lineno, ast.unparse(node))
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and not _own(node)
    ]
    return sorted(found)


def test_the_scan_finds_private_attributes_and_passes_public_ones() -> None:
    """A control: the scan would catch the reads the core and kube tests used to make, and
    passes a helper's own state and the public views."""
    source = (
        "pool = s._inv.clusters['c'].pools['sp']\n"
        "assert not quota_broken(s.queue_states(), s._book)\n"
        "name = type(s).__name__\n"
        "allocs = s.allocations()\n"
        "s._ledger = None\n"
        "wait_for(lambda: backend._nodes['g1'].dip_since is None)\n"
        "self._rng.random() + self.runtime._sent_at[1]\n"
        "pods = backend.attempt_pods('j', 1)\n"
    )
    assert private_attributes(source) == [
        (1, "s._inv"),
        (2, "s._book"),
        (5, "s._ledger"),
        (6, "backend._nodes"),
        (7, "self.runtime._sent_at"),
    ]


def _reads() -> list[tuple[str, int, str]]:
    return [
        (path.relative_to(ROOT).as_posix(), line, expr)
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for line, expr in private_attributes(path.read_text())
    ]


def test_tests_read_the_code_through_public_views_only() -> None:
    found = _reads()
    allowed = DELIBERATE.keys()
    offences = [f"{rel}:{line}: {expr}" for rel, line, expr in found if (rel, expr) not in allowed]
    assert not offences, (
        "tests read private attributes; use the owner's read-only view (Scheduler "
        "allocations(), queue_states(), machine.views, KubeBackend node_signals(), "
        "attempt_pods(), ...) or add a small public query to the owning class:\n"
        + "\n".join(offences)
    )
    stale = allowed - {(rel, expr) for rel, _, expr in found}
    assert not stale, f"these reads are gone; drop them from DELIBERATE: {sorted(stale)}"


def _deploy_paths(source: str) -> list[int]:
    """Lines that build a path into deploy/ by hand (`... / "deploy"`)."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Div)
        and isinstance(node.right, ast.Constant)
        and node.right.value == "deploy"
    ]


def test_paths_into_deploy_start_from_support_deploy() -> None:
    """One definition of where the shipped manifests live (`tests.support.DEPLOY`), so a move
    of deploy/ is one edit, not a hunt."""
    assert _deploy_paths('DOCKERFILE = ROOT / "deploy" / "Dockerfile"\n') == [1]
    support = ROOT / "tests" / "support.py"
    found = [
        f"{path.relative_to(ROOT).as_posix()}:{line}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if path != support
        for line in _deploy_paths(path.read_text())
    ]
    assert not found, f"use tests.support.DEPLOY for these paths into deploy/: {found}"
