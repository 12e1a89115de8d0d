"""A test that runs only as a normal user carries the marker ``uid``.

CI runs as root, so such a test runs there only in the second, unprivileged pass
(``.ci/nonroot -m uid``); without the marker it would never run at all.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT
from tests.helpers.checkout import tracked


def _skips_as_root(decorator: ast.expr) -> bool:
    """``@pytest.mark.skipif(os.geteuid() == 0, ...)`` and the like."""
    text = ast.unparse(decorator)
    return "skipif" in text and any(
        f"{call}() == 0" in text or f"0 == os.{call}()" in text for call in ("geteuid", "getuid")
    )


def _marked_uid(decorators: list[ast.expr]) -> bool:
    return any(ast.unparse(d) == "pytest.mark.uid" for d in decorators)


def _module_marked_uid(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            return "pytest.mark.uid" in ast.unparse(node.value)
    return False


def root_skipping_tests_without_the_marker(path: Path, base: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text())
    if _module_marked_uid(tree):
        return []
    return [
        f"{path.relative_to(base)}::{node.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test")
        and any(_skips_as_root(d) for d in node.decorator_list)
        and not _marked_uid(node.decorator_list)
    ]


def test_tests_that_skip_as_root_are_marked_uid() -> None:
    files = tracked("**/test_*.py", under=ROOT / "tests")
    assert ROOT / "tests" / "exporter" / "test_cli.py" in files
    found = [t for f in files for t in root_skipping_tests_without_the_marker(f)]
    assert found == [], "tests CI would never run (add @pytest.mark.uid): " + ", ".join(found)


def test_the_check_sees_an_unmarked_test(tmp_path: Path) -> None:
    source = (
        "import os\nimport pytest\n\n"
        '@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")\n'
        "def test_a(): ...\n\n"
        "@pytest.mark.uid\n"
        '@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")\n'
        "def test_b(): ...\n\n"
        '@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")\n'
        "def test_c(): ...\n"
    )
    path = tmp_path / "test_probe.py"
    path.write_text(source)
    assert root_skipping_tests_without_the_marker(path, tmp_path) == ["test_probe.py::test_a"]
