"""The layering docs/architecture.md describes holds in the code: no import cycles anywhere
(imports inside functions and under TYPE_CHECKING count too), the core imports only itself and
the wire contract, the broker never imports the agents, only the state table (states.py) writes a
job's state in the core, every function hop the document names in its walks still exists, the
broker's executor and both simulators share one effect sequencer (and no other module keeps a
Cancel-before-Dispatch barrier), and the config loader, its importers and the simulator's
modules stay under 600 lines each."""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("broker", "agents", "load", "schemas", "shell", "muster", "kinds")


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> Iterator[str]:
    """Every project module `path` imports, wherever the import statement stands."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                if child in MODULES:
                    yield child
                elif node.module in MODULES:
                    yield node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    yield alias.name


GRAPH = {name: sorted(set(_imports(path))) for name, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in GRAPH:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            edges = GRAPH[node]
            if i < len(edges):
                work.append((node, i + 1))
                nxt = edges[i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return found


def test_the_module_graph_has_no_cycles() -> None:
    assert _cycles() == []


def test_the_cycle_finder_sees_a_cycle() -> None:
    GRAPH["schemas"] = [*GRAPH["schemas"], "shell"]
    GRAPH["shell"] = [*GRAPH["shell"], "schemas"]
    try:
        assert ["schemas", "shell"] in _cycles()
    finally:
        GRAPH["schemas"] = GRAPH["schemas"][:-1]
        GRAPH["shell"] = GRAPH["shell"][:-1]


def test_the_core_imports_only_itself_and_the_wire_contract() -> None:
    outside = {
        (name, dep)
        for name, deps in GRAPH.items()
        if name.startswith("broker.core")
        for dep in deps
        if not dep.startswith(("broker.core", "schemas"))
    }
    assert outside == set()


# Modules split by duty and kept so: the config loader and its importers, one per source system.
SIZED = ("broker.config", "broker.imports")
# Packages split by duty, every module of them: the simulator (its parts and the package).
SIZED_PACKAGES = ("load.sim",)
# The broker shell, split by duty (docs/architecture.md, "The broker shell by duty").
BROKER_SHELL = {
    f"broker.{name}"
    for name in [
        "service",
        "fields",
        "process",
        "executor",
        "intakeloop",
        "intake",
        "rendezvous",
        "agentio",
        "agentlink",
        "ackwait",
        "pacing",
        "lease",
    ]
}
MAX_LINES = 600
# The kube backend, split by duty: the backend and the modules that took its duties.
KUBE_SPLIT = {
    f"agents.kube.{m}"
    for m in ("backend", "nodewatch", "usage", "attempts", "objects", "fencing", "watches")
}


def test_the_split_modules_stay_under_the_size_limit() -> None:
    sized = {
        n: p
        for n, p in MODULES.items()
        if n == SIZED[0] or n.startswith(SIZED[1]) or n in BROKER_SHELL
    }
    # the loader, the package, base and three sources; every module of the broker shell
    assert len(sized) >= 5 + len(BROKER_SHELL), sorted(sized)
    for package in SIZED_PACKAGES:
        split = {n: p for n, p in MODULES.items() if n == package or n.startswith(package + ".")}
        assert len(split) >= 5, sorted(split)  # not one module any more
        sized |= split
    sized |= {n: p for n, p in MODULES.items() if n in KUBE_SPLIT}
    assert set(sized) >= KUBE_SPLIT, sorted(KUBE_SPLIT - set(sized))
    too_long = {
        name: lines
        for name, path in sized.items()
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert too_long == {}, f"split these by duty (at most {MAX_LINES} lines each)"


def test_the_broker_never_imports_the_agents() -> None:
    assert [
        (n, d)
        for n, ds in GRAPH.items()
        if n.startswith("broker")
        for d in ds
        if d.startswith("agents")
    ] == []


# `.state` written in the core by anything but the job state table: a pool's circuit breaker
# (health.py) has a state of its own.
NOT_JOB_STATE = {("broker.core.health", "b.state")}


def _writes(name: str, source: str, attr: str) -> set[tuple[str, str, str]]:
    """(module, enclosing function, target) of every assignment to an attribute named `attr`
    in `source`, and of every `setattr(x, attr, ...)`."""
    found: set[tuple[str, str, str]] = set()

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            func = node.name
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value == attr
        ):
            found.add((name, func, f"setattr({ast.unparse(node.args[0])})"))
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and sub.attr == attr:
                    found.add((name, func, ast.unparse(sub)))
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(ast.parse(source), "")
    return found


def _core_writes(attr: str) -> set[tuple[str, str, str]]:
    return {
        write
        for name, path in MODULES.items()
        if name.startswith("broker.core")
        for write in _writes(name, path.read_text(), attr)
    }


def test_only_the_state_table_writes_a_jobs_state() -> None:
    writes = {
        (name, target) for name, _, target in _core_writes("state") if name != "broker.core.states"
    }
    assert writes - NOT_JOB_STATE == set()


def test_a_preemption_is_set_in_one_place() -> None:
    """`record.preempting` is the one source of a job's preemption; the lifecycle's index of
    preempting jobs is written with it."""
    assert {(n, f) for n, f, _ in _core_writes("preempting")} == {
        ("broker.core.lifecycle", "_set_preempting")
    }


def test_the_write_finder_sees_writes() -> None:
    source = (
        'r.state = "queued"\ndef f():\n    a.b.state, x = 1, 2\nsetattr(rec, "state", "failed")\n'
    )
    want = {("m", "", "r.state"), ("m", "f", "a.b.state"), ("m", "", "setattr(rec)")}
    assert _writes("m", source, "state") == want
    assert _writes("m", "x = r.state\nf(state=1)\n", "state") == set()


SEARCHED = ("broker.core", "broker", "schemas")
SHORT_NAMES = {name.rpartition(".")[2] for name in MODULES if name.rpartition(".")[0] in SEARCHED}
WALKS = ("One JobSpec, from the submit subject to the Dispatch", "One spot notice, to the resumed")


def _walk_references() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    refs: list[str] = []
    for title in WALKS:
        start = text.index(title)
        end = text.find("\n#", start)
        section = text[start : end if end > 0 else None]
        refs += re.findall(r"`([a-z_]+(?:\.[A-Za-z_]+)+)`", section)
    return [ref for ref in refs if ref.split(".")[0] in SHORT_NAMES]


def _resolve(dotted: str) -> object:
    """`service.Broker._submit_one` names a module of the broker (or its core) and an attribute
    path within it."""
    module_name, *attrs = dotted.split(".")
    for package in SEARCHED:
        try:
            obj: object = importlib.import_module(f"{package}.{module_name}")
        except ModuleNotFoundError:
            continue
        for attr in attrs:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_walks_name_function_hops() -> None:
    assert len(_walk_references()) > 30


@pytest.mark.parametrize("dotted", _walk_references())
def test_each_hop_of_the_walks_exists(dotted: str) -> None:
    assert callable(_resolve(dotted)), dotted


def test_the_simulated_agents_obey_the_real_command_gate() -> None:
    """The VOPR's agents decide which commands to obey with the runtime's own gate, and no
    module but the gate keeps the rules' state (a copy would let the simulation pass while
    the shell broke)."""
    for user in ("agents.runtime", "load.vopr"):
        assert "agents.gate" in GRAPH[user], f"{user} does not use agents.gate"
    keepers = [
        name
        for name, path in MODULES.items()
        if name != "agents.gate" and re.search(r"\bcancelled_upto\b", path.read_text())
    ]
    assert keepers == []


def _barrier_reads(path: Path) -> list[int]:
    """Lines reading `Send.after_cancel_of` other than to hand it to a `.dispatch(...)` call
    (the sequencer's barrier): a module that looks at it otherwise keeps its own barrier."""
    tree = ast.parse(path.read_text())
    handed: set[int] = set()
    for node in ast.walk(tree):
        call = node if isinstance(node, ast.Call) else None
        if call and isinstance(call.func, ast.Attribute) and call.func.attr == "dispatch":
            handed.update(id(a) for a in [*call.args, *(k.value for k in call.keywords)])
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "after_cancel_of"
        and id(node) not in handed
    ]


def test_the_shell_and_both_simulators_carry_out_effects_with_one_sequencer() -> None:
    """The broker's executor and both simulators order effects with the same sans-IO
    `broker.sequencer`, and no other module outside the core keeps a Cancel-before-Dispatch
    barrier (a copy would let the simulations pass while the shell broke), nor edits the
    checkpoint token the core stamped on a Dispatch."""
    for user in ("broker.executor", "load.vopr", "load.sim.loop"):
        assert "broker.sequencer" in GRAPH[user], f"{user} does not use broker.sequencer"
    outside = {
        name: path
        for name, path in MODULES.items()
        if not name.startswith("broker.core") and name != "broker.sequencer"
    }
    keepers = {name: lines for name, path in outside.items() if (lines := _barrier_reads(path))}
    assert keepers == {}
    stampers = [
        name
        for name, path in outside.items()
        if name.startswith("broker") and re.search(r"\bcheckpoint_token=", path.read_text())
    ]
    assert stampers == []
