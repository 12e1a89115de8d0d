"""The code's structure, checked: the dependency rules docs/architecture.md states.

Read from the sources with :mod:`ast` (nothing is imported): module-level imports only, since
imports inside functions and under ``TYPE_CHECKING`` are the deliberate lazy ones.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from .conftest import ROOT
from .helpers.checkout import tracked

PACKAGES = {
    "trainmon_client": ROOT / "client" / "src" / "trainmon_client",
    "trainmon_exporter": ROOT / "exporter" / "src" / "trainmon_exporter",
}
LONG = 500
"""Lines past which a module must say at its top why it is one module."""
CLIENT_MOST = 900
"""Lines no client module may pass: the public API and the sender each stay one read."""


def modules() -> dict[str, Path]:
    out = {}
    for pkg, root in PACKAGES.items():
        for path in tracked("**/*.py", under=root):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((pkg, *parts))] = path
    return out


def module_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports when it is imported (top level, not TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for h in getattr(node, "handlers", []):
                    visit(h.body)
                visit(getattr(node, "finalbody", []))
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    up = up[: len(up) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                for a in node.names:  # `from pkg import submodule` imports the submodule
                    sub = f"{base}.{a.name}"
                    found.add(sub if sub in known else base)

    visit(tree.body)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: module_imports(name, path, set(mods)) for name, path in mods.items()}


def test_no_import_cycles() -> None:
    g = graph()
    visiting: list[str] = []
    done: set[str] = set()
    cycles: list[list[str]] = []

    def walk(node: str) -> None:
        if node in done:
            return
        if node in visiting:
            cycles.append([*visiting[visiting.index(node) :], node])
            return
        visiting.append(node)
        for nxt in sorted(g[node]):
            walk(nxt)
        visiting.pop()
        done.add(node)

    for node in sorted(g):
        walk(node)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


STATE_ROOMS = ("evidence", "rank", "admission", "ledger", "records", "store", "statefile")
"""The push-side state's rooms, lowest first (docs/architecture.md: a rank knows no store)."""


def test_the_state_rooms_import_downward_only() -> None:
    g = graph()
    rooms = [f"trainmon_exporter.state.{r}" for r in STATE_ROOMS]
    upward = [(m, i) for k, m in enumerate(rooms) for i in sorted(g[m]) if i in rooms[k + 1 :]]
    assert not upward, upward


def test_the_client_never_imports_the_exporter() -> None:
    g = graph()
    bad = [
        (m, i)
        for m, imps in g.items()
        if m.startswith("trainmon_client")
        for i in imps
        if i.startswith("trainmon_exporter")
    ]
    assert not bad


@pytest.mark.parametrize(
    ("owner", "library"),
    [("trainmon_exporter.nvml", "pynvml"), ("trainmon_exporter.app", "fastapi")],
)
def test_one_module_owns_each_heavy_library(owner: str, library: str) -> None:
    users = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(n == library or n.startswith(library + ".") for n in names):
                users.append(name)
    assert set(users) <= {owner}, users


def test_long_modules_say_why_at_their_top() -> None:
    unexplained = []
    for name, path in modules().items():
        text = path.read_text()
        if text.count("\n") > LONG:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "Why this module" not in doc:
                unexplained.append(f"{name} ({text.count(chr(10))} lines)")
    assert not unexplained, unexplained


def test_no_client_module_passes_the_most_lines() -> None:
    long = [
        f"{name} ({lines} lines)"
        for name, path in modules().items()
        if name.startswith("trainmon_client")
        and (lines := path.read_text().count("\n")) > CLIENT_MOST
    ]
    assert not long, long


def test_only_the_run_reaches_its_sender() -> None:
    """Integrations and adapters use the public ``Run`` API; the sending machinery is the run's."""
    importers = {m for m, imps in graph().items() if "trainmon_client._sender" in imps}
    assert importers == {"trainmon_client._run"}
    # ... and the sender knows its run as SendingRun: no import of _run, even for types.
    tree = ast.parse(modules()["trainmon_client._sender"].read_text())
    froms = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "trainmon_client._run" not in froms


def test_log_never_calls_into_the_sender() -> None:
    """``Run.log()``, the hot path, reads the run's own attributes (docs/architecture.md)."""
    tree = ast.parse(modules()["trainmon_client._run"].read_text())
    run = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Run")
    log = next(n for n in run.body if isinstance(n, ast.FunctionDef) and n.name == "log")
    assert "_sender" not in ast.unparse(log)


def test_no_test_module_imports_another() -> None:
    offenders = []
    for path in tracked("**/*.py", under=ROOT / "tests"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if any(part.startswith("test_") for part in mod.split(".")):
                    offenders.append(f"{path.relative_to(ROOT)}: from {'.' * node.level}{mod}")
    for path in tracked("**/*.py", under=ROOT / "benchmarks"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and "test_" in (node.module or ""):
                offenders.append(f"{path.relative_to(ROOT)}: from {node.module}")
    assert not offenders, offenders


def test_docs_architecture_names_every_module() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for name, path in modules().items():
        if path.name == "__init__.py":
            if path.parent.name in PACKAGES:
                continue  # the distribution's own package
            wanted = [f"`{path.parent.name}/`"]
        elif path.parent.name in PACKAGES:
            wanted = [f"`{path.name}`"]
        else:  # a module of a subpackage: by file name or by its stem in the subpackage's row
            wanted = [f"`{path.name}`", f"`{path.stem}`"]
        if not any(w in doc for w in wanted):
            missing.append(name)
    assert not missing, f"docs/architecture.md does not place: {missing}"
