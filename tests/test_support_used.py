"""The tests share their helpers through ``tests/support`` only (issue 24): no test module defines
its own wait loop, free port or spec builder, and none imports another test module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SUPPORT = TESTS / "support"
# What tests/support provides once (waiting, specs) and datagen_cli.local.redis_server.free_port.
SHARED_HELPER = re.compile(
    r"^_?(free_port|wait_until\w*|wait_for\w*|eventually|spec|make_spec|job_spec|spec_json)$"
)


def _test_code() -> list[Path]:
    """Every module under tests/ but tests/support: test modules and conftest files."""
    return sorted(p for p in TESTS.rglob("*.py") if SUPPORT not in p.parents)


def _name(path: Path) -> str:
    return str(path.relative_to(TESTS))


def _imported_modules(tree: ast.Module) -> list[str]:
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append("." * node.level + (node.module or ""))
    return found


def test_test_code_is_only_test_modules_and_conftest_files() -> None:
    helpers = [_name(p) for p in _test_code() if not (p.name.startswith("test_") or p.name == "conftest.py")]
    assert helpers == [], "shared test code belongs in tests/support"


def test_no_test_module_defines_a_wait_loop_free_port_or_spec_builder() -> None:
    defined = [
        f"{_name(path)}:{node.lineno} {node.name}"
        for path in _test_code()
        for node in ast.walk(ast.parse(path.read_text("utf-8")))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and SHARED_HELPER.match(node.name)
    ]
    assert defined == [], "use tests/support (wait, specs) and datagen_cli.local.redis_server.free_port"


def test_test_code_imports_no_test_module() -> None:
    siblings = {p.stem for p in _test_code()}
    wrong = [
        f"{_name(path)}: {module}"
        for path in [*_test_code(), *sorted(SUPPORT.rglob("*.py"))]
        for module in _imported_modules(ast.parse(path.read_text("utf-8")))
        if module.startswith(".")
        or (module.startswith("tests.") and not module.startswith("tests.support"))
        or module.split(".")[0] in siblings
    ]
    assert wrong == [], "import shared test code from tests.support, fixtures from conftest.py"
