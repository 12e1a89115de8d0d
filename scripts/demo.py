"""``make demo``: start the exporter, train the example model, show what the exporter sees.

Usage: python scripts/demo.py [--steps N] [--ranks 2] [--trainmon-run] [--keep | --no-keep]
                              [--port P]

Prints where /metrics and the status page are, then live values read back from the
exporter's JSON API while the real training run goes on, then a few /metrics lines. In a
terminal the exporter then keeps serving those addresses until Ctrl-C; elsewhere (output to a
pipe or a file, or CI set in the environment) the demo stops it and ends, and says so.
Ctrl-C during training stops the training cleanly (the run is reported as finished).
With ``--trainmon-run`` the trainer makes no trainmon call of its own (``--no-trainmon``) and
runs under ``trainmon-run``, whose hooks report it (``make demo DEMO_ARGS=--trainmon-run``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from trainmon_exporter.local import LocalExporter

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_char_transformer.py"


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as r:
        return bytes(r.read())


def show(url: str) -> None:
    data = json.loads(get(url + "/api/v1/runs"))
    for run in data["runs"]:
        for r in run["ranks"]:
            loss = r["values"].get("loss")
            tps = r["tokens_per_second"]
            ovh = r["client_overhead_ratio"]
            good = (r.get("goodput") or {}).get("ratio")
            print(
                f"  [{run['run']} rank {r['rank']}] {r['status']:8s} step {r['step']!s:>5}  "
                f"loss {'-' if loss is None else f'{loss:.3f}'}  "
                f"tokens/s {'-' if tps is None else f'{tps:,.0f}'}  "
                f"goodput {'-' if good is None else f'{good * 100:.0f}%'}  "
                f"client overhead {'-' if ovh is None else f'{ovh * 100:.3f}%'}",
                flush=True,
            )


def seen_a_step(url: str) -> bool:
    """Whether the exporter has received a step from any rank yet."""
    data = json.loads(get(url + "/api/v1/runs"))
    return any(r["step"] is not None for run in data["runs"] for r in run["ranks"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="training steps (0: until Ctrl-C)")
    ap.add_argument("--ranks", type=int, default=1, help="processes (torchrun, gloo) if > 1")
    ap.add_argument("--port", type=int, default=9478)
    ap.add_argument(
        "--trainmon-run",
        action="store_true",
        help="train without the two lines, under trainmon-run (no code change)",
    )
    ap.add_argument(
        "--keep",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep the exporter serving after training until Ctrl-C "
        "(default: yes in a terminal, no when the output goes elsewhere or CI is set)",
    )
    args = ap.parse_args()
    interactive = sys.stdin.isatty() and sys.stdout.isatty() and not os.environ.get("CI")
    keep = interactive if args.keep is None else args.keep

    exporter = LocalExporter(port=args.port)
    url, sock = exporter.url, exporter.socket
    trainer: subprocess.Popen[bytes] | None = None
    try:
        exporter.start()
        print(
            f"\ntrainmon exporter is up\n  metrics:     {url}/metrics\n"
            f"  status page: {url}/\n  JSON API:    {url}/api/v1/runs\n"
            f"  socket:      {sock}\n",
            flush=True,
        )
        env = dict(os.environ, TRAINMON_SOCKET=str(sock), TRAINMON_RUN=f"demo-{int(time.time())}")
        cmd = [sys.executable, str(EXAMPLE), "--steps", str(args.steps), "--status-url", url]
        if args.ranks > 1:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc_per_node={args.ranks}",
                *cmd[1:],
            ]
        shown = " ".join(cmd[1:])
        if args.trainmon_run:  # the script's own trainmon calls off; the hooks report
            shown = f"trainmon-run -- python {shown} --no-trainmon"
            cmd = [sys.executable, "-m", "trainmon_client._launch", "--", *cmd, "--no-trainmon"]
        print(f"training: {shown}\n", flush=True)
        trainer = subprocess.Popen(cmd, env=env)
        first = True
        while trainer.poll() is None:
            # Every second until the first step arrives, then every 3 s.
            time.sleep(1 if first else 3)
            if first and not seen_a_step(url):
                continue
            first = False
            print("live values read back from the exporter:", flush=True)
            show(url)
        print("\nafter training:", flush=True)
        show(url)
        wanted = (
            "trainmon_run_up",
            "trainmon_train_steps_total",
            "trainmon_train_loss",
            "trainmon_train_loss_ema",
            "trainmon_train_tokens_per_second",
            "trainmon_train_step_time_median_seconds",
            "trainmon_eval_loss",
            "trainmon_checkpoints_total",
            "trainmon_train_nonfinite_values_total",
            "trainmon_client_overhead_ratio",
        )
        lines = [
            ln
            for ln in get(url + "/metrics").decode().splitlines()
            if ln.split("{", 1)[0] in wanted
        ]
        print("\nfrom /metrics:\n  " + "\n  ".join(lines), flush=True)
        if keep:
            print(
                f"\ntraining finished; the exporter keeps serving {url}/ and {url}/metrics "
                "until Ctrl-C",
                flush=True,
            )
            assert exporter.proc is not None
            exporter.proc.wait()
        else:
            print(
                f"\ntraining finished; the exporter stops now, so {url}/ no longer answers "
                "(in a terminal, or with --keep, it serves until Ctrl-C)",
                flush=True,
            )
        return 0 if trainer.returncode == 0 else 1
    except KeyboardInterrupt:
        print("\nstopping", flush=True)
        if trainer is not None and trainer.poll() is None:
            trainer.send_signal(signal.SIGINT)
            trainer.wait(30)
            show(url)
        return 0
    finally:
        exporter.stop()


if __name__ == "__main__":
    raise SystemExit(main())
