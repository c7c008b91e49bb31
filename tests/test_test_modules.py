"""No test module imports another: importing a `test_*` module runs its module state again
under a second name and ties unrelated tests together. Shared helpers live in a module named
for what it holds (`tests/<dir>/helpers.py`, `tests/support.py`, `tests/world.py`)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _is_test_module(dotted: str) -> bool:
    return dotted.rsplit(".", 1)[-1].startswith("test_")


def _test_imports(source: str, package: str) -> Iterator[tuple[int, str]]:
    """(line, module) for every import of a `test_*` module in `source`, wherever it stands.

    `package` is the dotted package of the file, to resolve relative imports."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if any(_is_test_module(part) for part in alias.name.split(".")):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            if any(_is_test_module(part) for part in module.split(".")):
                yield node.lineno, module
                continue
            for alias in node.names:
                if _is_test_module(alias.name):
                    yield node.lineno, f"{module}.{alias.name}"


def _offences() -> list[tuple[str, int, str]]:
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        package = ".".join(Path(rel).parent.parts)
        for line, module in _test_imports(path.read_text(), package):
            found.append((rel, line, module))
    return found


def test_no_test_module_imports_another() -> None:
    offences = [f"{rel}:{line} imports {module}" for rel, line, module in _offences()]
    assert not offences, (
        "test modules import other test modules; move the shared helper into a helpers "
        "module (tests/<dir>/helpers.py, tests/support.py or tests/world.py) and import it "
        "from there:\n" + "\n".join(offences)
    )


def test_the_finder_sees_every_form_of_import() -> None:
    source = (
        "import tests.core.test_machine\n"
        "from tests.broker.test_submit import job\n"
        "from tests.kube import test_deploy\n"
        "def f():\n"
        "    from .test_sim import SMALL\n"
        "from tests.core.helpers import flavor\n"
        "import pytest\n"
    )
    assert list(_test_imports(source, "tests.load")) == [
        (1, "tests.core.test_machine"),
        (2, "tests.broker.test_submit"),
        (3, "tests.kube.test_deploy"),
        (5, "tests.load.test_sim"),
    ]
