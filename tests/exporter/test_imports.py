"""What importing a part of the exporter loads: the terminal view must start fast."""

from __future__ import annotations

import json
import subprocess
import sys

from ..conftest import child_env

# Modules only the daemon needs (the HTTP server, the exposition, NVML).
HEAVY = ("fastapi", "starlette", "uvicorn", "prometheus_client", "pynvml")


def loaded_after(code: str) -> set[str]:
    """The top-level package names in ``sys.modules`` after running ``code`` in a fresh Python."""
    names = "sorted({m.split('.')[0] for m in sys.modules})"
    probe = f"{code}\nimport json, sys\nprint(json.dumps({names}))"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        check=True,
    )
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_the_package_loads_its_public_names_on_first_use() -> None:
    assert not loaded_after("import trainmon_exporter") & set(HEAVY)
    import trainmon_exporter
    from trainmon_exporter.app import create_app
    from trainmon_exporter.cli import main
    from trainmon_exporter.settings import Settings

    assert trainmon_exporter.create_app is create_app
    assert trainmon_exporter.main is main
    assert trainmon_exporter.Settings is Settings
    assert set(trainmon_exporter.__all__) <= set(dir(trainmon_exporter))


def test_the_terminal_view_loads_none_of_the_daemon() -> None:
    loaded = loaded_after("import trainmon_exporter.views.terminal")
    assert "pydantic" in loaded  # the probe sees what it should (the view model is pydantic)
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
    assert "pydantic_settings" not in loaded  # the settings model is the daemon's
    # ``trainmon --help`` goes through the whole command line: still no daemon.
    help_page = "from trainmon_exporter.views.terminal import cli\ncli(['status', '--help'])"
    assert not loaded_after(help_page) & set(HEAVY)


def test_the_old_module_of_the_terminal_still_runs_it() -> None:
    # A ``trainmon`` script installed before views/terminal.py imports trainmon_exporter.status.
    assert not loaded_after("import trainmon_exporter.status") & set(HEAVY)
    from trainmon_exporter import status
    from trainmon_exporter.views import terminal

    assert status.cli is terminal.cli and status.main is terminal.main
