"""The commands in README.md and docs/ work, and every CLI flag is documented.

Every line of every ``sh``/``bash`` block in the user docs is either run here, exactly as
written (with the repository's virtual environment first on ``PATH``, so ``python``,
``torchrun``, ``trainmon`` are the installed ones), or listed in :data:`SKIP` with the reason it
cannot run on a CI machine. A new command in the docs fails the test until it is one or the
other.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, ExporterProcess, child_env, free_port, short_tmpdir
from tests.helpers.checkout import tracked

DOCS = [ROOT / "README.md", *tracked("docs/*.md"), ROOT / "secrets" / "README.md"]
BLOCK = re.compile(r"^```(?:sh|bash|shell|console)\n(.*?)^```", re.S | re.M)

# Commands that cannot run on a CI machine, by the start of the command, with the reason.
SKIP: dict[str, str] = {
    "make demo": "builds .venv-demo from the package index (network), then trains for minutes; "
    "tests/test_demo.py runs scripts/demo.py with a step limit",
    "make test": "the test suite itself",
    "trainmon-run -- python examples/train_deepspeed.py": "needs DeepSpeed, from the optional "
    "requirements-frameworks.txt; tests/frameworks/test_deepspeed.py runs the example under "
    "trainmon-run where it is installed",
    "make bench": "every benchmark, minutes even with --smoke; tests/benchmarks runs each one "
    "in its --smoke mode",
    "make venv": "creates a virtual environment from the package index (network)",
    "docker ": "needs a Docker engine and images; the compose test runs the stack where one starts",
    "pip install": "installs into the environment from the network; the packaging test builds "
    "and installs the wheels in a clean venv",
    "python3 -m venv /opt/": "installs into /opt (root)",
    "trainmon-exporter --socket /run/trainmon": "a daemon on the fixed port 9478 of all "
    "interfaces under /run (root); tests/integration starts real exporters on free ports",
    "sudo install -d -o 10001": "makes /run/trainmon as root; tests/integration/test_compose_up.py "
    "runs this line from the README before it brings the stack up",
    "sudo useradd ": "creates a system user (root); the shared set-up's files are checked by "
    "tests/deploy/test_systemd_files.py",
    "sudo python3 -m venv /opt/": "installs into /opt (root)",
    "sudo cp deploy/systemd/": "writes to /etc (root)",
    "sudo systemd-tmpfiles ": "creates /run/trainmon (root); tests/deploy/test_systemd_files.py "
    "runs the tmpfiles.d line into a scratch root",
    "sudo systemctl ": "needs systemd as init (root)",
    "sudo usermod ": "changes a user's groups (root)",
    "sudo iptables ": "changes the host's firewall (root)",
    "sudo chgrp 65534 secrets/": "changes a file's group (root); tests/integration/"
    "test_compose_up.py runs the secrets commands and reads the files as nobody",
    "trainmon status": "reads an exporter on the default port 9478 (or another host); "
    "tests/integration/test_status.py runs these commands against a real exporter",
    "trainmon-exporter status": "reads an exporter on the default port 9478; "
    "tests/integration/test_status.py runs it against a real exporter",
    "prometheus ": "a Prometheus server for the whole deployment; tests/rules and "
    "tests/integration run the shipped rules in a real Prometheus",
    "victoria-metrics ": "a long-running storage server; tests/deploy run it on loopback",
    "vmalert ": "needs a VictoriaMetrics and an Alertmanager at the documented addresses",
    "torchrun --standalone --nproc_per_node=8": "eight training processes (a GPU node)",
    "git checkout v": "a release's tag, made when the release is; tests/deploy/test_image_files.py "
    "reads this block and checks the reference it pushes",
    "export SOURCE_DATE_EPOCH=": "part of the release block above",
    "kustomize ": "edits a kustomization for a registry that does not exist here",
    "kubectl apply": "needs a Kubernetes cluster; tests/deploy render and validate the manifests",
    "kubectl create secret": "needs a Kubernetes cluster and the certificate files; "
    "tests/integration/test_tls_scrape.py lays the Secrets out as their volumes would be",
    "cd deploy/kubernetes": "part of the Kubernetes block above",
    "cp deploy/slurm/": "writes to /etc/systemd (root)",
    "systemctl ": "needs systemd as init (root)",
    "export MASTER_ADDR=": "inside a Slurm batch script (needs a Slurm allocation)",
    "srun ": "inside a Slurm batch script (needs a Slurm allocation)",
    "trainmon_slurm_sd.py ": "needs a Slurm controller (scontrol); tests/deploy run it "
    "against a real one",
    "nvidia-smi": "needs an NVIDIA GPU and driver",
    ".venv/bin/python -m pytest -m gpu": "needs an NVIDIA GPU (the tests skip without one)",
    "timeout 540 .venv/bin/python -m pytest -m gpu": "needs an NVIDIA GPU (the tests skip "
    "without one)",
    "python3 -m venv --system-site-packages .venv": "on a GPU machine: replaces the checkout's "
    ".venv with one on that machine's own CUDA build of torch",
    ".venv/bin/pip install -q -e ./client -e ./exporter": "on a GPU machine: installs into that "
    "environment from the package index (network)",
    '.venv/bin/python -c "import torch; print(torch.__version__, torch.cuda': "needs CUDA (a GPU "
    "machine)",
    ".venv/bin/python benchmarks/": "benchmarks take minutes; tests/benchmarks runs every one "
    "in its --smoke mode",
}


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str  # one shell command, continuation lines joined, comments kept

    @property
    def bare(self) -> str:
        """The command without a trailing comment or leading environment assignments."""
        text = re.sub(r"\s+#.*$", "", self.text).strip()
        return re.sub(r"^(?:[A-Z_]+=\S+\s+)+", "", text)


def doc_commands() -> list[Command]:
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for block in BLOCK.finditer(text):
            first = text[: block.start(1)].count("\n") + 1
            lines = block[1].replace("\\\n", " ").splitlines()
            for i, line in enumerate(lines):
                if line.strip() and not line.lstrip().startswith("#"):
                    out.append(Command(doc.relative_to(ROOT).as_posix(), first + i, line.strip()))
    return out


def skip_reason(cmd: Command) -> str | None:
    return next((why for start, why in SKIP.items() if cmd.bare.startswith(start)), None)


RUNNABLE = [c for c in doc_commands() if skip_reason(c) is None]


def test_commands_are_found_and_some_run() -> None:
    cmds = doc_commands()
    assert len(cmds) > 20
    assert any("train_hf_trainer.py" in c.text for c in RUNNABLE)
    assert any(c.bare.startswith("printf") for c in RUNNABLE)


def test_every_skip_reason_is_still_used() -> None:
    used = {start for c in doc_commands() for start in SKIP if c.bare.startswith(start)}
    assert set(SKIP) - used == set(), "skip entries no doc command needs any more"


def environment(socket: str | None = None) -> dict[str, str]:
    """The user's shell after ``make venv``: the venv's ``bin`` first on ``PATH``.

    Its trainers report to ``socket``: the exporter "started above" in the docs, which the
    test starts itself (:func:`docs_exporter`); never the default socket, where this user's
    own exporter may be listening.
    """
    venv_bin = str(Path(sys.executable).parent)
    env = child_env() if socket is None else child_env(TRAINMON_SOCKET=socket)
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "/usr/bin:/bin")
    return env


def command_id(cmd: Command) -> str:
    """``README.md:183`` and the script it runs, if any: ``-k train_hf_trainer`` selects it."""
    script = re.search(r"[\w-]+\.py\b", cmd.text)
    return f"{cmd.doc}:{cmd.line}" + (f"-{script[0]}" if script else "")


TRAINS = re.compile(r"\b(?:torchrun|python)\b.*\bexamples/")
"""A command that runs an example trainer: it reports to the exporter the docs started."""


def docs_exporter(request: pytest.FixtureRequest) -> ExporterProcess:
    return request.getfixturevalue("docs_exporter_module")  # type: ignore[no-any-return]


def assert_every_step_arrived(command: str, metrics: dict[Any, float]) -> None:
    """Each of the command's ranks (``--nproc-per-node``, else 1) logged its ``--steps`` steps
    through ``trainmon-run``'s hooks, all sent and none dropped, by the exporter's counters."""
    nproc = re.search(r"--nproc[-_]per[-_]node[ =](\d+)", command)
    steps = int(re.search(r"--steps (\d+)", command)[1])  # type: ignore[index]
    ranks = {
        dict(labels)["rank"]: value
        for (name, labels), value in metrics.items()
        if name == "trainmon_train_steps_total"
    }
    assert ranks == {str(r): steps for r in range(int(nproc[1]) if nproc else 1)}, ranks
    sent = [v for (name, _), v in metrics.items() if name == "trainmon_client_sent_messages_total"]
    assert sent and min(sent) >= steps, sent
    dropped = {
        k: v for k, v in metrics.items() if k[0] == "trainmon_client_dropped_messages_total" and v
    }
    assert dropped == {}, dropped


@pytest.fixture(scope="module")
def docs_exporter_module() -> Iterator[ExporterProcess]:
    """The exporter the docs start before their trainers (``trainmon-exporter``), on a socket
    and port of the test's own."""
    d = short_tmpdir()
    ex = ExporterProcess(d / "trainmon.sock", free_port()).start()
    yield ex
    ex.stop()
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("cmd", RUNNABLE, ids=command_id)
def test_doc_command_runs(cmd: Command, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    cwd = ROOT
    if re.search(r"\bsecrets/", cmd.text):
        # Commands that write the secrets run in a scratch copy, never on the checkout's files.
        cwd = tmp_path
        (tmp_path / "secrets").mkdir()
        for sibling in RUNNABLE:  # the files a chmod in the same doc expects are written first
            if sibling.doc == cmd.doc and sibling.line < cmd.line and "printf" in sibling.text:
                subprocess.run(["bash", "-c", sibling.text], cwd=cwd, check=True, timeout=10)
    wrapped = cmd.text.startswith("trainmon-run ")
    ex = None
    if TRAINS.search(cmd.text):  # a trainmon-run command gets an exporter of its own, to count
        ex = (
            request.getfixturevalue("exporter_process")().start()
            if wrapped
            else docs_exporter(request)
        )
    out = subprocess.run(
        # Paths under /tmp go to the test's own directory: /tmp/ckpt may be another user's.
        ["bash", "-c", re.sub(r"(?<![\w/.])/tmp/", f"{tmp_path}/", cmd.text)],
        cwd=cwd,
        env=environment(None if ex is None else ex.socket),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, f"{cmd.doc}:{cmd.line}: {cmd.text}\n{out.stdout}\n{out.stderr}"
    assert "Traceback" not in out.stderr, out.stderr
    if ex is not None and wrapped:  # the script is unchanged: what reached the exporter
        assert_every_step_arrived(cmd.text, ex.metrics())
    elif ex is not None:  # the trainer's closing line: it reported to the exporter started above
        assert re.search(rf"records sent to {re.escape(ex.socket)}, 0 dropped", out.stdout), (
            out.stdout + out.stderr
        )
    for target in re.findall(r">\s*(secrets/\S+)", cmd.text):
        assert (cwd / target).read_text(), target


# ---------------------------------------------------------------------------------------------
# Every flag the CLIs accept is in the docs.


def documented_flags() -> set[str]:
    """Flags the docs spell out; ``--[no-]x`` documents ``--x`` and ``--no-x``."""
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *tracked("docs/*.md")])
    flags = set(re.findall(r"--[a-z][\w.-]*[\w]", text))
    for name in re.findall(r"--\[no-\]([a-z][\w.-]*[\w])", text):
        flags |= {f"--{name}", f"--no-{name}"}
    # docs/detection.md documents every analytics setting by name under "--analytics.NAME".
    detection = (ROOT / "docs" / "detection.md").read_text()
    if "--analytics.NAME" in detection:
        for name in re.findall(r"^\| `([a-z0-9_]+)` \|", detection, re.M):
            flags.add("--analytics." + name.replace("_", "-"))
    return flags


def help_flags(*argv: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, *argv, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"(?<![\w-])--[a-z][\w.-]*[\w]", out.stdout)) - {"--help"}


# The ``trainmon`` console command, as its entry point runs it.
TRAINMON = "import sys; from trainmon_exporter.views.terminal import cli; sys.exit(cli())"


@pytest.mark.parametrize(
    "argv",
    [
        ("-m", "trainmon_exporter"),
        ("-c", TRAINMON),
        ("-c", TRAINMON, "status"),
        ("-m", "trainmon_client._launch"),
    ],
    ids=["trainmon-exporter", "trainmon", "trainmon status", "trainmon-run"],
)
def test_every_cli_flag_is_documented(argv: tuple[str, ...]) -> None:
    flags = help_flags(*argv)
    assert flags, "no flags parsed from --help"
    missing = sorted(flags - documented_flags())
    assert not missing, f"flags in --help but not in README.md or docs/: {missing}"


def test_the_flag_check_sees_a_missing_flag() -> None:
    assert "--no-such-flag" not in documented_flags()
    assert {"--nvml-processes", "--no-nvml-processes"} <= documented_flags()


def test_runnable_commands_use_tools_ci_has() -> None:
    # bash builtins and the venv's own programs (python, torchrun) on the documented PATH
    path = environment()["PATH"]
    for cmd in RUNNABLE:
        word = cmd.bare.split()[0]
        assert word in {"printf", "chmod", "cd"} or shutil.which(word, path=path), cmd


def exporter_flag_examples() -> list[str]:
    """Inline examples in the docs that give an exporter flag a value (`--layer-ranks all`)."""
    flags = help_flags("-m", "trainmon_exporter")
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *tracked("docs/*.md")])
    spans = set(re.findall(r"`(--[a-z][^`]*)`", text))
    return sorted(
        s
        for s in spans
        if shlex.split(s)[0] in flags
        and len(shlex.split(s)) > 1
        and not re.fullmatch(
            r"(https?://)?[A-Z:_]+", shlex.split(s)[-1]
        )  # a placeholder (HOST:PORT)
    )


def test_every_exporter_flag_example_is_accepted() -> None:
    from trainmon_exporter.cli import UsageError, load_settings

    examples = exporter_flag_examples()
    assert "--layer-ranks all" in examples
    for example in examples:
        try:
            load_settings(shlex.split(example))
        except UsageError as exc:  # argparse refused it
            pytest.fail(f"the docs show `{example}`, which trainmon-exporter refuses ({exc})")


def test_a_refused_example_is_caught() -> None:
    from trainmon_exporter.cli import UsageError, load_settings

    with pytest.raises(UsageError, match="unrecognized arguments: false"):
        load_settings(["--nvml-processes", "false"])
