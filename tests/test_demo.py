"""``make demo`` (scripts/demo.py): the exporter, a real training run, live values read back.

Outside a terminal (here: output to a pipe) the demo ends by itself when training ends and
says that its addresses stop answering; with ``--keep`` it serves them until Ctrl-C.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import httpx2 as httpx
import pytest

from tests.conftest import ROOT, child_env, free_port, wait_for

pytestmark = pytest.mark.slow

DEMO = [sys.executable, str(ROOT / "scripts" / "demo.py"), "--steps", "30"]
LIVE = re.compile(r"\[demo-\d+ rank 0\] \w+ +step +\d+ +loss \d+\.\d+")


def answers(url: str) -> bool:
    try:
        return httpx.get(url + "/", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def demo(*args: str) -> subprocess.CompletedProcess[str]:
    """The demo to its end (its output to a pipe), not checked."""
    return subprocess.run(
        [*DEMO, *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
        check=False,
        cwd=ROOT,
    )


@pytest.mark.uid  # the first thing a new user runs: CI runs it as one too
def test_the_demo_shows_live_values_and_ends_by_itself_outside_a_terminal() -> None:
    port = free_port()
    out = demo("--port", str(port))
    assert out.returncode == 0, out.stdout + out.stderr
    url = f"http://127.0.0.1:{port}"
    assert f"status page: {url}/" in out.stdout and f"metrics:     {url}/metrics" in out.stdout
    live = out.stdout.split("after training:")[0]
    assert LIVE.search(live), out.stdout  # a step and its loss while training ran
    assert re.search(r"^  trainmon_train_steps_total\{.*\} 30\.0$", out.stdout, re.M), out.stdout
    # The trainer's closing line points at this exporter, not the default address (where
    # another exporter may serve, as on a node that runs one for everybody).
    assert f"status page ({url}/) or `trainmon status --url {url}`" in out.stdout, out.stdout
    assert f"the exporter stops now, so {url}/ no longer answers" in out.stdout
    assert not answers(url)
    assert "Traceback" not in out.stderr, out.stderr


def test_the_demo_trains_under_trainmon_run_with_no_call_of_its_own() -> None:
    out = demo("--port", str(free_port()), "--trainmon-run")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "training: trainmon-run -- python " in out.stdout and "--no-trainmon" in out.stdout
    assert LIVE.search(out.stdout.split("after training:")[0]), out.stdout
    assert re.search(r"^  trainmon_train_steps_total\{.*\} 30\.0$", out.stdout, re.M), out.stdout
    assert "Traceback" not in out.stderr, out.stderr


def test_with_keep_the_status_page_answers_after_training_until_ctrl_c() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [*DEMO, "--port", str(port), "--keep"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
        cwd=ROOT,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "keeps serving" in line:
                break
        assert any(f"keeps serving {url}/" in ln for ln in lines), "".join(lines)
        time.sleep(2)  # training is over: the page must still answer, and keep answering
        assert proc.poll() is None and answers(url)
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(60) == 0
        wait_for(lambda: not answers(url), timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        if proc.stderr is not None:
            proc.stderr.close()
