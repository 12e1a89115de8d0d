"""``trainmon status`` against a real exporter process with two fake GPUs and real ranks."""

from __future__ import annotations

import http.server
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import (
    ExporterProcess,
    child_env,
    run_trainer,
    sample,
    trainmon_status,
    wait_for,
)
from tests.fakes.libnvml import CONFIG_ENV, build, h100, write_config
from trainmon_client import init
from trainmon_exporter.views import terminal


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("fake-nvml-status"))


def parse(text: str) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """The --once format, parsed the way a script would: split on runs of 2+ spaces."""
    import re

    sections: dict[str, list[dict[str, str]]] = {}
    current = ""
    header: list[str] = []
    for line in text.splitlines():
        if line.startswith("# "):
            current, header = line[2:].split(" ", 1)[0], []
            sections[current] = []
        elif line.strip():
            cells = re.split(r"\s{2,}", line.strip())
            if not header:
                header = cells
            else:
                sections[current].append(dict(zip(header, cells, strict=True)))
    return sections.get("ranks", []), sections.get("gpus", [])


def test_status_once_and_live_view(
    tmp_path: Path, fake_lib: Path, exporter_process: Callable[..., ExporterProcess]
) -> None:
    cfg = tmp_path / "gpus.conf"
    gpus = [h100(0), h100(1, clock_reasons=0x40, xid="79")]
    write_config(cfg, gpus)
    env = child_env(LD_LIBRARY_PATH=str(fake_lib.parent), **{CONFIG_ENV: str(cfg)})
    ex = exporter_process("--nvml-interval-seconds", "0.2", env=env).start()
    runs = [
        init(
            run="status-demo",
            rank=r,
            world_size=2,
            socket_path=ex.socket,
            num_params=10**8,
            gpu_uuid=str(gpus[r]["uuid"]),
            flush_interval=0.0,
        )
        for r in range(2)
    ]
    for step in range(30):
        for r in runs:
            r.log(step, loss=3.0 - step * 0.01, tokens=2048)
        time.sleep(0.03)  # tokens/s (so MFU) needs the steps to span 0.5 s
    runs[1].log(30, loss=float("nan"), tokens=2048)
    wait_for(
        lambda: (
            all(k["steps_total"] >= 30 for run in ex.runs()["runs"] for k in run["ranks"])
            and len(ex.runs()["runs"][0]["ranks"]) == 2
        )
    )

    out = trainmon_status("--url", ex.url, "--once")
    assert out.returncode == 0, out.stderr
    assert "\x1b[" not in out.stdout  # plain text, no colour codes
    ranks, gpu_table = parse(out.stdout)
    assert [(r["run"], r["rank"]) for r in ranks] == [
        ("status-demo", "0/2"),
        ("status-demo", "1/2"),
    ]
    r0, r1 = ranks
    assert r0["status"] == "running" and r0["step"] == "29" and r0["gpu"] == "0"
    assert r0["gpu_util"].endswith("%") and r0["mfu"].endswith("%")
    assert r0["anomalies"] == "ok"
    # its first step so far; the loop reports no data waits
    assert re.fullmatch(r"\d+\.\d% \(startup, data unmeasured\)", r0["goodput"]), r0
    assert r1["loss"] == "NaN/Inf" and "nonfinite_loss" in r1["anomalies"]
    print(out.stdout)  # docs/status.md shows this capture
    assert [g["gpu"] for g in gpu_table] == ["0", "1"]
    assert gpu_table[1]["slowdown"] == "hw_thermal_slowdown" and gpu_table[1]["xids"] == "1"
    assert gpu_table[0]["name"] == "NVIDIA H100 80GB HBM3"

    # The live view renders the same data with rich.
    from rich.console import Console

    runs_body, gpus_body = terminal.fetch(ex.url)
    console = Console(record=True, width=160, color_system=None)
    console.print(terminal.rich_view(runs_body, gpus_body, ex.url))
    screen = console.export_text()
    assert "status-demo" in screen and "NaN/Inf" in screen and "hw_thermal_slowdown" in screen
    for r in runs:
        r.finish()


def test_a_crashed_rank_shows_no_throughput_anywhere(
    tmp_path: Path, exporter_process: Callable[..., ExporterProcess]
) -> None:
    """A trainer killed mid-run, read within the rate window of its last step."""
    import re

    import httpx

    ex = exporter_process().start()
    out = run_trainer(
        tmp_path / "crash.py",
        "import os, time, trainmon_client\n"
        "run = trainmon_client.init(run='crash-demo', num_params=10**8, flush_interval=0.0)\n"
        "for step in range(40):\n"
        "    run.log(step, loss=3.0 - step * 0.01, tokens=2048)\n"
        "    time.sleep(0.03)\n"
        "time.sleep(0.5)  # the flusher sends the last steps\n"
        "os._exit(1)  # killed: no FINISH\n",
        ex.socket,
    )
    assert out.returncode == 1, out.stderr
    rank = wait_for(
        lambda: (
            (runs := ex.runs()["runs"])
            and runs[0]["ranks"][0]["status"] == "crashed"
            and runs[0]["ranks"][0]
        )
    )
    assert rank["steps_total"] == 40 and rank["seconds_since_last_step"] < 20  # in the window
    assert rank["tokens_per_second"] is None and rank["mfu_ratio"] is None
    assert sample(ex.metrics(), "trainmon_train_tokens_per_second", run="crash-demo", rank="0") == 0
    once = trainmon_status("--url", ex.url, "--once")
    ranks, _ = parse(once.stdout)
    assert ranks[0]["status"] == "crashed"
    assert ranks[0]["tokens_per_s"] == "-" and ranks[0]["mfu"] == "-"
    assert "disconnected without finishing" in ranks[0]["anomalies"]
    page = httpx.get(ex.url + "/", timeout=5).text
    assert "<td class='crashed'>crashed</td>" in page
    row = re.findall(r"<td[^>]*>(.*?)</td>", re.findall(r"<tr>(.*?)</tr>", page)[0])
    assert row[:4] == ["crash-demo", "0/1", row[2], "crashed"] and row[5] == "39"
    assert row[9] == "–" and row[11] == "–"  # tokens/s and MFU


def test_sparklines_from_a_real_exporter(
    exporter_process: Callable[..., ExporterProcess],
) -> None:
    """A trainer that logs a NaN and then reloads a checkpoint: its trend in the API, the page
    and the live view."""
    import httpx
    from rich.console import Console

    from trainmon_exporter.views import sparkline

    ex = exporter_process().start()
    run = init(run="spark-demo", socket_path=ex.socket, flush_interval=0.0)
    for step in range(40):
        run.log(step, loss=float("nan") if step == 30 else 4.0 - step * 0.05, tokens=4096)
        time.sleep(0.01)
    for step in range(20, 25):  # back to a checkpoint of step 20
        run.log(step, loss=3.0, tokens=4096)
    wait_for(lambda: ex.runs()["runs"][0]["ranks"][0]["steps_total"] == 45)
    trend = ex.runs()["runs"][0]["ranks"][0]["trend"]
    assert len(trend["steps"]) == 45 and trend["steps"][-1] == 24
    marks = [(m["kind"], m["step"], trend["steps"][m["index"]]) for m in trend["marks"]]
    assert marks == [("nonfinite", 30, 30), ("restart", 20, 20)]
    assert trend["loss"][30] is None and trend["loss"][0] == 4.0
    rates = [r for r in trend["tokens_per_second"][1:] if r is not None]
    assert len(rates) == 43 and all(r > 0 for r in rates)  # none across the rollback
    # The goodput so far at each point, as the rank's goodput ratio counts it.
    good = [g for g in trend["goodput"] if g is not None]
    assert len(trend["goodput"]) == 45 and good and all(0.0 <= g <= 1.0 for g in good)

    page = httpx.get(ex.url + "/", timeout=5).text
    assert page.count("<svg class='spark'") == 3 and "aria-label='goodput, steps" in page
    assert "NaN/Inf loss at step 30" in page and "restart or rollback at step 20" in page

    runs_body, gpus_body = terminal.fetch(ex.url)
    console = Console(record=True, width=100, color_system=None)
    console.print(terminal.rich_view(runs_body, gpus_body, ex.url))
    screen = console.export_text()
    lines = screen.splitlines()
    trends_at = next(i for i, line in enumerate(lines) if "recent steps, oldest left" in line)
    spark = next(line for line in lines[trends_at:] if "▁" in line or "█" in line)
    marks_line = lines[lines.index(spark) + 1]
    assert "N" in marks_line and "R" in marks_line
    assert any(b in spark for b in sparkline.BLOCKS)
    run.finish()


def test_status_says_when_the_exporter_is_unreachable() -> None:
    out = trainmon_status("--url", "http://127.0.0.1:9", "--once")
    assert out.returncode == 2
    assert out.stderr.startswith("trainmon status: cannot read http://127.0.0.1:9/api/v1/runs")
    assert "Traceback" not in out.stderr


def test_status_says_when_the_answer_is_not_the_exporters_api() -> None:
    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"runs": [{"run": "x"}]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Other) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_port}"
        try:
            with pytest.raises(terminal.StatusError) as err:
                terminal.fetch(url)
        finally:
            server.shutdown()
    assert str(err.value) == (
        f"cannot read {url}/api/v1/runs: not a trainmon exporter's answer (time: Field required)"
    )


class _Serve:
    """A loopback HTTP server answering ``GET path`` with ``bodies[path]`` (JSON)."""

    def __init__(self, bodies: dict[str, object]) -> None:
        import json

        encoded = {p: json.dumps(b).encode() for p, b in bodies.items()}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = encoded.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> str:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_status_once_prints_no_terminal_control_from_the_api() -> None:
    """An exporter's answer (another version, or anything at that address) whose run ids,
    hostnames, metric names, GPU names and errors hold ESC, CSI, OSC and C1 controls."""
    from tests.helpers import views as v

    h = v.HOSTILE
    rank = v.rank(0, hostname=h, health=[h], events=[v.event(h, 3)], values={"loss": 2.5, h: 1.0})
    runs = v.runs(rank, run=h).model_dump(mode="json")
    for gpus in (v.gpus(v.gpu(0, name=h, slowdown_reasons=[h])), v.no_gpus(h, h)):
        with _Serve({"/api/v1/runs": runs, "/api/v1/gpus": gpus.model_dump(mode="json")}) as url:
            out = trainmon_status("--url", url, "--once")
        assert out.returncode == 0, out.stderr
        assert not v.controls(out.stdout) and not v.controls(out.stderr), out
        ranks, _ = parse(out.stdout)
        assert ranks[0]["run"].startswith("a\\x1b[31mred\\x1b]0;owned\\x07b")
        assert ranks[0]["loss"] == "2.5"


def trainmon(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed ``trainmon`` console command (its entry point), as a user runs it."""
    code = "import sys; from trainmon_exporter.views.terminal import cli; sys.exit(cli())"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        check=False,
    )


def test_trainmon_help_and_version_exit_zero() -> None:
    out = trainmon("--help")
    assert out.returncode == 0, out.stderr
    assert "status" in out.stdout and "usage: trainmon" in out.stdout
    out = trainmon("status", "--help")
    assert out.returncode == 0 and "--url" in out.stdout and "--once" in out.stdout
    out = trainmon("--version")
    assert out.returncode == 0 and out.stdout.startswith("trainmon ")
    # No command, or an unknown one, is a usage error with a message, not a traceback.
    for args in ((), ("bogus",)):
        out = trainmon(*args)
        assert out.returncode == 2 and "usage: trainmon" in out.stderr, out
        assert "Traceback" not in out.stderr


def test_status_accepts_host_port_without_scheme(
    exporter_process: Callable[..., ExporterProcess],
) -> None:
    ex = exporter_process().start()
    with init(run="no-scheme", socket_path=ex.socket, flush_interval=0.0) as run:
        run.log(1499, loss=2.5)
        wait_for(lambda: any(r["run"] == "no-scheme" for r in ex.runs()["runs"]))
        hostport = ex.url.removeprefix("http://")
        assert "://" not in hostport
        out = trainmon("status", "--url", hostport, "--once")
        assert out.returncode == 0, out.stderr
        ranks, _ = parse(out.stdout)
        assert ranks[0]["run"] == "no-scheme" and ranks[0]["step"] == "1499"


def test_status_refuses_other_schemes() -> None:
    out = trainmon("status", "--url", "ftp://127.0.0.1:9478", "--once")
    assert out.returncode == 2
    assert "only http:// and https://" in out.stderr and "Traceback" not in out.stderr
