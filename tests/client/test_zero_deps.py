"""trainmon-client installs alone, with no runtime dependency, and imports no heavy module."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from ..conftest import ROOT


@pytest.mark.slow
def test_client_installs_alone_in_a_bare_venv(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True, system_site_packages=False)
    py = env_dir / "bin" / "python"
    # No build isolation: setuptools comes from this interpreter, so no network is needed.
    pip = subprocess.run(
        [
            py,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            str(ROOT / "client"),
        ],
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": _setuptools_path()},
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr
    code = (
        "import sys, importlib.metadata as md\n"
        "required = [r for r in md.requires('trainmon-client') or [] if 'extra ==' not in r]\n"
        "assert not required, required  # only the optional extras (hf, lightning)\n"
        "import trainmon_client\n"
        "r = trainmon_client.init(run='bare', socket_path='/nonexistent/t.sock')\n"
        "r.log(0, loss=1.0, tokens=3)\n"
        "r.finish()\n"
        "heavy = {'torch', 'numpy', 'pydantic', 'fastapi', 'prometheus_client'}\n"
        "heavy &= set(sys.modules)\n"
        "assert not heavy, heavy\n"
        "others = [d.metadata['Name'] for d in md.distributions()\n"
        "          if d.metadata['Name'] not in ('pip', 'setuptools', 'trainmon-client')]\n"
        "print('extra distributions:', others)\n"
        "assert not others, others\n"
    )
    # The bare environment alone: no PYTHONPATH of the calling shell (a source tree on it
    # would show its packages' metadata as installed).
    bare = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, check=False, env=bare)
    assert out.returncode == 0, out.stdout + out.stderr
    # trainmon-run too: a program without torch runs under it untouched, and imports nothing
    # heavy (the hooks wait for `import torch`).
    probe = "import sys; print(sorted({'torch', 'numpy', 'logging.handlers'} & set(sys.modules)))"
    launched = subprocess.run(
        [env_dir / "bin" / "trainmon-run", "--", py, "-c", probe],
        capture_output=True,
        text=True,
        check=False,
        env=bare,
    )
    assert launched.returncode == 0 and launched.stdout.strip() == "[]", launched.stderr


def _setuptools_path() -> str:
    import setuptools

    return str(Path(setuptools.__file__).parent.parent)


def test_import_does_not_pull_heavy_modules() -> None:
    code = (
        "import sys, trainmon_client\n"
        "heavy = {'torch', 'numpy', 'pydantic', 'fastapi', 'prometheus_client'}\n"
        "heavy &= set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_config_named_adapters_import_nothing_of_their_framework() -> None:
    """torchtune's and torchtitan's adapters are named in a config: importing them is cheap."""
    code = (
        "import sys, trainmon_client.torchtune, trainmon_client.torchtitan\n"
        "heavy = {'torch', 'numpy', 'torchtune', 'torchtitan'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
