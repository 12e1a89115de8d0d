"""Goodput against the trainers' own clocks: real trainers, exporters and a real Prometheus.

Each scenario runs real trainer processes (``timed_trainer.py``, ``gloo_trainer.py``,
``lightning_trainer.py``, which write down what they measured) against real exporters, and a
real Prometheus evaluating the shipped recording rules (1 s intervals) scrapes them all. The
job's goodput and badput by kind are then read three ways: what the trainers measured (the
truth, by the definitions of docs/goodput.md), what the rules record
(``run:trainmon_train_goodput:ratio``, ``run:trainmon_train_badput_seconds:sum``) and what
the JSON API of the exporter where the run ends shows.

- ``moved``: a rank killed on one node and restarted on another (a second exporter);
- ``ttl``: a rank killed and restarted after longer than the exporter's series TTL;
- ``exporter_restart``: the exporter killed (``SIGKILL``) and restarted mid-run;
- ``gloo4``: four ranks over gloo, one of them with a slow loader;
- ``lightning``: a Lightning fit with a slow dataset, checkpoints and validation.

``benchmarks/goodput_job.py`` prints the figures of docs/goodput.md with it;
``tests/integration/test_goodput_job.py`` runs shorter versions and holds them to the
promise: goodput within 3 points of the truth, every badput kind within 15 % (of those the
truth puts at a second or more: below that, the exporter's 0.1 s drain is the error).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import yaml

from trainmon_exporter.local import LocalExporter, free_port

ROOT = Path(__file__).resolve().parents[2]
HELPERS = ROOT / "tests" / "helpers"
RULES = ROOT / "deploy" / "prometheus" / "trainmon.rules.yml"
SCENARIOS = ("moved", "ttl", "exporter_restart", "gloo4", "lightning")
KINDS_COMPARED = (
    "startup",
    "data_loading",
    "checkpoint_save",
    "checkpoint_restore",
    "evaluation",
    "wasted_progress",
    "recovery",
)
MIN_COMPARED_S = 1.0
"""Badput kinds the truth puts below this (seconds per rank) are shown, not judged."""


@dataclass
class Result:
    """One scenario's job goodput and badput (seconds per rank), three ways."""

    scenario: str
    run: str
    truth: dict[str, float]
    rules: dict[str, float]
    api: dict[str, float]
    """The API's ``job`` figures (read from Prometheus: ``prometheus_url``)."""
    api_local: dict[str, float]
    """The API's own figures, over the ranks of the exporter where the run ended."""
    local_is_job: bool = True
    """Every rank of the run was on that exporter: its own figures are the job's too."""
    seconds: float = 0.0

    def problems(self, points: float = 0.03, rel: float = 0.15) -> list[str]:
        """What breaks the promise, one line each (empty: kept)."""
        out = []
        judged = [("rules", self.rules), ("api", self.api)]
        if self.local_is_job:
            judged.append(("api (this node)", self.api_local))
        for name, got in judged:
            if not got:
                out.append(f"{self.scenario}: no {name} figures")
                continue
            if abs(got["ratio"] - self.truth["ratio"]) > points:
                out.append(
                    f"{self.scenario}: {name} goodput {got['ratio']:.3f}, truth "
                    f"{self.truth['ratio']:.3f}"
                )
            for kind in KINDS_COMPARED:
                want = self.truth.get(kind, 0.0)
                if want >= MIN_COMPARED_S and abs(got.get(kind, 0.0) - want) > rel * want:
                    out.append(
                        f"{self.scenario}: {name} {kind} {got.get(kind, 0.0):.2f} s, truth "
                        f"{want:.2f} s"
                    )
        return out

    def table(self) -> str:
        """The scenario's figures as rows of a Markdown table (seconds per rank)."""
        rows = []
        for key in ("ratio", *KINDS_COMPARED):
            t = self.truth.get(key)
            if t is None or (key != "ratio" and t < 0.05 and (self.rules.get(key) or 0) < 0.05):
                continue
            fmt = "{:.1%}" if key == "ratio" else "{:.2f}"
            cells = [
                fmt.format(v) if v is not None else "–"
                for v in (t, self.rules.get(key), self.api.get(key), self.api_local.get(key))
            ]
            rows.append(f"| {self.scenario} | {key} | " + " | ".join(cells) + " |")
        return "\n".join(rows)


def events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Lab:
    """Exporters (by name) and one Prometheus with the shipped rules scraping them all."""

    def __init__(self, names: tuple[str, ...], args: dict[str, tuple[str, ...]]) -> None:
        if shutil.which("prometheus") is None:
            raise RuntimeError("prometheus is not installed (Debian package prometheus)")
        self.tmp = Path(tempfile.mkdtemp(prefix="tm-gp-"))
        self.prom_port = free_port()
        self.args = {**args, "": ("--prometheus-url", f"http://127.0.0.1:{self.prom_port}")}
        self.exporters: dict[str, LocalExporter] = {}
        self.ports = {n: free_port() for n in names}
        for name in names:
            (self.tmp / name).mkdir()
            self.exporters[name] = self._exporter(name).start()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {
                    "job_name": "trainmon",
                    "static_configs": [
                        {"targets": [f"127.0.0.1:{p}" for p in self.ports.values()]}
                    ],
                }
            ],
        }
        (self.tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.prom_log = (self.tmp / "prom.log").open("wb")
        self.prom = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={self.tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.prom_port}",
            ],
            stdout=self.prom_log,
            stderr=subprocess.STDOUT,
        )
        self.wait(lambda: len(self.query('up{job="trainmon"} == 1')) == len(names), 60)

    def _exporter(self, name: str) -> LocalExporter:
        ex = LocalExporter(
            *self.args.get(name, ()),
            *self.args.get("*", ()),
            *self.args[""],
            port=self.ports[name],
            socket_path=self.tmp / name / "t.sock",
            capture_output=True,
        )
        want = self.ports[name]
        if ex.port != want:
            # The port of an exporter just killed is in TIME_WAIT: LocalExporter's probe (no
            # SO_REUSEADDR) calls it taken, but uvicorn binds it. Prometheus scrapes this one.
            cmd = ex._cmd
            cmd[cmd.index("--listen") + 1] = f"127.0.0.1:{want}"
            ex.port, ex.url = want, f"http://127.0.0.1:{want}"
        return ex

    def socket(self, name: str) -> str:
        return self.exporters[name].socket

    def kill_and_restart(self, name: str, down: float) -> None:
        """``SIGKILL`` the exporter ``name``, wait ``down`` seconds, start it again (same socket
        and state file)."""
        old = self.exporters[name]
        assert old.proc is not None
        old.proc.send_signal(signal.SIGKILL)
        old.stop()  # collects what it wrote, closes its pipes
        time.sleep(down)
        self.exporters[name] = self._exporter(name).start()

    def query(self, expr: str) -> list[dict[str, Any]]:
        q = urllib.parse.urlencode({"query": expr})
        url = f"http://127.0.0.1:{self.prom_port}/api/v1/query?{q}"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return json.loads(r.read())["data"]["result"]  # type: ignore[no-any-return]
        except OSError:
            return []

    def rules(self, run: str, ranks: int) -> dict[str, float]:
        """The recorded job figures of ``run`` (badput in seconds per rank)."""
        ratio = self.query(f'run:trainmon_train_goodput:ratio{{run="{run}"}}')
        if not ratio:
            return {}
        out = {"ratio": float(ratio[0]["value"][1])}
        acc = self.query(f'run:trainmon_train_accounted_seconds:sum{{run="{run}"}}')
        if acc:
            out["wall"] = float(acc[0]["value"][1]) / ranks
        for s in self.query(f'run:trainmon_train_badput_seconds:sum{{run="{run}"}}'):
            out[s["metric"]["kind"]] = float(s["value"][1]) / ranks
        return out

    def api(self, name: str, run: str, ranks: int) -> tuple[dict[str, float], dict[str, float]]:
        """The JSON API's figures of ``run`` on the exporter ``name``: ``(the job's, read from
        Prometheus; the ranks that exporter holds)``."""
        for view in self.exporters[name].get_json("/api/v1/runs")["runs"]:
            if view["run"] == run and view["goodput_ratio"] is not None:
                local = {"ratio": float(view["goodput_ratio"])}
                local.update({k: v / ranks for k, v in view["badput_seconds"].items()})
                job = view.get("job") or {}
                whole = {}
                if job.get("goodput_ratio") is not None:
                    whole = {"ratio": float(job["goodput_ratio"])}
                    whole.update({k: v / ranks for k, v in job["badput_seconds"].items()})
                return whole, local
        return {}, {}

    def settle(self, run: str, ranks: int, name: str) -> None:
        """Wait until the exporter ``name`` saw every rank of ``run`` go, and Prometheus
        recorded the final figures (read from ``/metrics``: the API's job figures are cached)."""
        pattern = re.compile(
            rf'^trainmon_run_up{{[^}}]*run="{re.escape(run)}"[^}}]*}} (\S+)$', re.M
        )

        def gone() -> bool:
            text = self.exporters[name].get("/metrics").decode()
            ups = pattern.findall(text)
            return len(ups) == ranks and all(float(u) == 0 for u in ups)

        self.wait(gone, 60)
        time.sleep(2.5)  # two scrapes, then the rules' evaluation

    @staticmethod
    def wait(cond: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError("condition not met in time")
            time.sleep(0.2)

    def close(self) -> None:
        self.prom.terminate()
        try:
            self.prom.wait(10)
        except subprocess.TimeoutExpired:
            self.prom.kill()
        self.prom_log.close()
        for ex in self.exporters.values():
            with_output = ex.stop()
            if os.environ.get("GOODPUT_LAB_DEBUG"):
                print(with_output, file=sys.stderr)
        shutil.rmtree(self.tmp, ignore_errors=True)


def child_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TRAINMON_RUN", "TRAINMON_SOCKET")
        and not k.startswith("SLURM_")
    }
    env.update(extra, PYTHONUNBUFFERED="1")
    return env


def trainer(
    script: str, socket: str, run: str, truth: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            str(HELPERS / script),
            "--socket",
            socket,
            "--run",
            run,
            "--truth",
            str(truth),
            *args,
        ],
        env=env or child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen[str], want: int = 0, timeout: float = 300) -> None:
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != want:
        raise RuntimeError(f"trainer exited {proc.returncode}, not {want}:\n{out[-3000:]}")


# ----------------------------------------------------------------------------- truths


def timed_truth(ev: list[dict[str, Any]]) -> dict[str, float]:
    """The job's figures (one rank) by docs/goodput.md's definitions from timed_trainer.py's
    events: the first step of each process is start-up; a process killed loses its steps after
    the checkpoint the next one restores, and the step in progress."""
    inits = [e["t"] for e in ev if e["ev"] == "init"]
    kills = [e["t"] for e in ev if e["ev"] == "kill"]
    (end,) = [e["t"] for e in ev if e["ev"] == "finish"]
    steps = [e for e in ev if e["ev"] == "step"]
    restores = [e for e in ev if e["ev"] == "restore"]
    out = dict.fromkeys(KINDS_COMPARED, 0.0)
    out["wall"] = end - inits[0]
    out["data_loading"] = sum(e["wait"] for e in steps)
    out["checkpoint_save"] = sum(e["seconds"] for e in ev if e["ev"] == "save")
    out["checkpoint_restore"] = sum(e["seconds"] for e in restores)
    bounds = [*inits[1:], float("inf")]
    procs = [
        (
            init,
            [e for e in steps if init <= e["t"] < hi],
            [e for e in restores if init <= e["t"] < hi],
            next((k for k in kills if init <= k < hi), None),
        )
        for init, hi in zip(inits, bounds, strict=True)
    ]
    good = 0.0
    for i, (init, mine, restored, kill) in enumerate(procs):
        if not mine:
            continue
        out["startup"] += mine[0]["t"] - init - mine[0]["wait"]
        out["startup"] -= sum(e["seconds"] for e in restored)
        resume = None  # where the next process goes on from
        if i + 1 < len(procs):
            _, nxt_steps, nxt_restored, _ = procs[i + 1]
            if nxt_restored:
                resume = nxt_restored[0]["step"]
            elif nxt_steps:
                resume = nxt_steps[0]["step"] - 1
        for e in mine[1:]:
            if kill is not None and resume is not None and e["step"] > resume:
                out["wasted_progress"] += e["compute"]
            else:
                good += e["compute"]
        if kill is not None:
            out["wasted_progress"] += kill - mine[-1]["t"]
            out["recovery"] += bounds[i] - kill
    out["ratio"] = good / out["wall"]
    return out


def gloo_truth(ev: list[dict[str, Any]], ranks: int) -> dict[str, float]:
    """The job's figures (seconds per rank) from gloo_trainer.py's events: the job goes at its
    slowest loader's pace, so each step's data loading is the longest wait of any rank."""
    init = min(e["t"] for e in ev if e["ev"] == "init")
    end = max(e["t"] for e in ev if e["ev"] == "finish")
    steps: dict[int, list[dict[str, Any]]] = {}
    for e in ev:
        if e["ev"] == "step":
            steps.setdefault(e["step"], []).append(e)
    saves: dict[int, float] = {}
    for e in ev:
        if e["ev"] == "save":
            saves[e["step"]] = saves.get(e["step"], 0.0) + e["seconds"] / ranks
    order = sorted(steps)
    logged = {s: max(e["t"] for e in steps[s]) for s in order}
    out = dict.fromkeys(KINDS_COMPARED, 0.0)
    out["wall"] = end - init
    out["data_loading"] = sum(max(e["wait"] for e in steps[s]) for s in order)
    out["checkpoint_save"] = sum(saves.values())
    first = order[0]
    out["startup"] = logged[first] - init - max(e["wait"] for e in steps[first])
    good = 0.0
    for prev, s in pairwise(order):
        good += logged[s] - logged[prev] - max(e["wait"] for e in steps[s]) - saves.get(prev, 0.0)
    out["ratio"] = good / out["wall"]
    return out


def lightning_truth(ev: list[dict[str, Any]]) -> dict[str, float]:
    """The fit's figures from lightning_trainer.py's events."""
    (init,) = [e["t"] for e in ev if e["ev"] == "init"]
    (end,) = [e["t"] for e in ev if e["ev"] == "finish"]
    batches = [e for e in ev if e["ev"] == "batch"]
    fetches = [e for e in ev if e["ev"] == "fetch"]
    out = dict.fromkeys(KINDS_COMPARED, 0.0)
    out["wall"] = end - init
    out["data_loading"] = sum(e["seconds"] for e in fetches)
    out["checkpoint_save"] = sum(e["seconds"] for e in ev if e["ev"] == "save")
    out["evaluation"] = sum(e["seconds"] for e in ev if e["ev"] == "eval")
    out["startup"] = batches[0]["t"] - init - fetches[0]["seconds"]
    out["ratio"] = sum(e["seconds"] for e in batches[1:]) / out["wall"]
    return out


# ----------------------------------------------------------------------------- scenarios


def killed_and_restarted(
    lab: Lab, run: str, first: str, then: str, steps: int, wait: float
) -> Path:
    """A rank killed on exporter ``first`` halfway between two checkpoints, restarted ``wait``
    seconds later on exporter ``then`` from its last checkpoint; the truth file's path."""
    truth = lab.tmp / f"{run}.jsonl"
    save = steps // 3
    every = ("--last", str(steps), "--save-every", str(save))
    kill = ("--first", "1", "--kill-after", str(save + save // 2 + 1))
    finish(trainer("timed_trainer.py", lab.socket(first), run, truth, *kill, *every), want=-9)
    time.sleep(wait)
    again = ("--first", str(save + 1), "--startup", "0.5", "--restore", "0.4")
    finish(trainer("timed_trainer.py", lab.socket(then), run, truth, *again, *every))
    lab.settle(run, 1, then)
    return truth


def moved(lab: Lab, steps: int = 30, pause: float = 3.0) -> Result:
    """Killed on node a, restarted on node b from its checkpoint ``pause`` seconds later."""
    run = "gp-moved"
    truth = killed_and_restarted(lab, run, "a", "b", steps, pause)
    return Result(
        "moved",
        run,
        timed_truth(events(truth)),
        lab.rules(run, 1),
        *lab.api("b", run, 1),
        local_is_job=False,
    )


def ttl(lab: Lab, steps: int = 30, ttl_s: float = 5.0) -> Result:
    """Killed, and restarted on the same node after longer than its series TTL."""
    run = "gp-ttl"
    # the rank's state expires first (the sweep runs every ttl / 4)
    truth = killed_and_restarted(lab, run, "c", "c", steps, ttl_s + 3.0)
    return Result("ttl", run, timed_truth(events(truth)), lab.rules(run, 1), *lab.api("c", run, 1))


def exporter_restart(lab: Lab, steps: int = 60, down: float = 1.0) -> Result:
    """The exporter SIGKILLed a third of the way in, and started again ``down`` s later."""
    run, truth = "gp-restart", lab.tmp / "restart.jsonl"
    proc = trainer(
        "timed_trainer.py",
        lab.socket("d"),
        run,
        truth,
        "--first",
        "1",
        "--last",
        str(steps),
        "--save-every",
        "10",
    )
    lab.wait(
        lambda: truth.exists() and sum(1 for e in events(truth) if e["ev"] == "step") >= steps // 3,
        120,
    )
    lab.kill_and_restart("d", down)
    finish(proc)
    lab.settle(run, 1, "d")
    return Result(
        "exporter_restart",
        run,
        timed_truth(events(truth)),
        lab.rules(run, 1),
        *lab.api("d", run, 1),
    )


def gloo4(lab: Lab, steps: int = 40) -> Result:
    """Four ranks over gloo; rank 3's loader is 15 times slower than the others'."""
    run, truth = "gp-gloo", lab.tmp / "gloo.jsonl"
    port = free_port()
    procs = [
        trainer(
            "gloo_trainer.py",
            lab.socket("e"),
            run,
            truth,
            "--port",
            str(port),
            "--steps",
            str(steps),
            "--slow-rank",
            "3",
            env=child_env(RANK=str(r), WORLD_SIZE="4", OMP_NUM_THREADS="1"),
        )
        for r in range(4)
    ]
    for p in procs:
        finish(p)
    lab.settle(run, 4, "e")
    return Result(
        "gloo4", run, gloo_truth(events(truth), 4), lab.rules(run, 4), *lab.api("e", run, 4)
    )


def lightning(lab: Lab, steps: int = 40) -> Result:
    """A Lightning fit whose dataset takes 20 ms an item, 4 items a batch."""
    run, truth = "gp-lightning", lab.tmp / "lightning.jsonl"
    (lab.tmp / "ckpt").mkdir(exist_ok=True)
    finish(
        trainer(
            "lightning_trainer.py",
            lab.socket("f"),
            run,
            truth,
            "--dir",
            str(lab.tmp / "ckpt"),
            "--steps",
            str(steps),
        )
    )
    lab.settle(run, 1, "f")
    return Result(
        "lightning", run, lightning_truth(events(truth)), lab.rules(run, 1), *lab.api("f", run, 1)
    )


RUNNERS: dict[str, Callable[..., Result]] = {
    "moved": moved,
    "ttl": ttl,
    "exporter_restart": exporter_restart,
    "gloo4": gloo4,
    "lightning": lightning,
}
EXPORTER_ARGS: dict[str, tuple[str, ...]] = {
    "*": (
        "--state-save-interval-seconds",
        "0.5",
        "--no-collectors.gpu",
        "--no-collectors.rank-gpu",
    ),
    "c": ("--series-ttl-seconds", "5", "--rank-retention-seconds", "1"),
}
"""Flags of every exporter (``*``) and of one: ``c`` (the ``ttl`` scenario's) expires a rank
that left 5 s after it left (the run's figures are read within that of its end)."""
EXPORTERS = {
    "moved": ("a", "b"),
    "ttl": ("c",),
    "exporter_restart": ("d",),
    "gloo4": ("e",),
    "lightning": ("f",),
}


def run_scenarios(names: tuple[str, ...], **sizes: int) -> Iterator[Result]:
    """Run the scenarios ``names`` in one lab (:data:`EXPORTER_ARGS`).

    ``sizes``: keyword arguments of each runner (``steps``) that apply to it.
    """
    wanted = tuple(n for s in names for n in EXPORTERS[s])
    lab = Lab(wanted, EXPORTER_ARGS)
    try:
        for name in names:
            t0 = time.monotonic()
            result = RUNNERS[name](lab, **sizes)
            result.seconds = time.monotonic() - t0
            yield result
    finally:
        lab.close()
