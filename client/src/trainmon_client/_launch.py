"""``trainmon-run``: run a training program with trainmon in every Python process it starts.

    trainmon-run [options] [--] python train.py ...
    trainmon-run [options] [--] torchrun --nproc-per-node 8 train.py ...

How: the way ``opentelemetry-instrument`` and ``ddtrace-run`` do it. The launcher puts the
directory of trainmon's ``sitecustomize`` (``trainmon_client/_bootstrap``) first on
``PYTHONPATH``, writes its options into the environment (``TRAINMON_*``), and replaces itself
with the command (``execvp``). Python imports ``sitecustomize`` at start, before the program's
first line, in the command itself and in every Python process it starts (torchrun's ranks,
``mp.spawn``'s workers), since they inherit the environment: each installs the hooks of
:mod:`trainmon_client._autorun`. Because the launcher *becomes* the command, the program keeps
its process id, its exit status and every signal sent to it: nothing stands in between.

The options not taken: a wrapper process that starts the program as a child (it would have to
forward every signal and translate a death by signal into its own, and a ``kill -9`` of the
wrapper would leave the program running); ``python -m trainmon_client.run train.py`` (``runpy``
in place of Python's own start: it covers one process, not torchrun's children, and changes
``sys.argv[0]`` and ``__main__``); a ``.pth`` file installed in site-packages (it would
instrument every Python process of the environment, not one launch).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from trainmon_client._autorun import ENV_AUTORUN, ENV_HOOKS, ENV_METRICS, HOOKS, METRICS
from trainmon_client._version import __version__

BOOTSTRAP = str(Path(__file__).resolve().parent / "_bootstrap")
"""The directory put first on ``PYTHONPATH``: it holds trainmon's ``sitecustomize``."""
FLIGHT_RECORDER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
"""PyTorch's Flight Recorder size (entries), by its current and its earlier name."""


def _names(allowed: Sequence[str]) -> argparse._ActionType:  # type: ignore[name-defined]
    def parse(value: str) -> str:
        for part in value.split(","):
            name = part.strip().lstrip("-+")
            if name and name != "all" and name not in allowed:
                raise argparse.ArgumentTypeError(
                    f"unknown name {name!r}; known: all, {', '.join(allowed)}"
                )
        return value

    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trainmon-run",
        usage="trainmon-run [options] [--] COMMAND [ARGS...]",
        description=(
            "Run a PyTorch training program with trainmon in every Python process it starts, "
            "with no change to its code: steps, loss, learning rate, gradient norm, data "
            "loading and checkpoints from hooks on public PyTorch APIs, and the Hugging Face, "
            "Lightning and other adapters where their frameworks are used. The command keeps "
            "its process id, exit status and signals (trainmon-run replaces itself with it)."
        ),
        epilog=(
            "Each option sets an environment variable the processes read (the variable wins "
            "where the option is not given). Rank, local rank, world size and the run id come "
            "from the launcher's environment (torchrun, Slurm, MPI) as with init(). "
            f"Hooks: {', '.join(HOOKS)}. Metrics: {', '.join(METRICS)}. "
            "See docs/integrations.md."
        ),
    )
    p.add_argument("--run", metavar="ID", help="run id shared by every rank (TRAINMON_RUN)")
    p.add_argument("--socket", metavar="PATH", help="the exporter's socket (TRAINMON_SOCKET)")
    p.add_argument(
        "--flush-interval", metavar="S", help="longest wait before a send (TRAINMON_FLUSH_INTERVAL)"
    )
    p.add_argument(
        "--metrics",
        type=_names(METRICS),
        metavar="LIST",
        help=f"metrics the hooks send: all (default) or some of {','.join(METRICS)}; "
        "-NAME leaves one out (TRAINMON_METRICS)",
    )
    p.add_argument(
        "--hooks",
        type=_names(HOOKS),
        metavar="LIST",
        help=f"hooks to install: all (default) or some of {','.join(HOOKS)} (TRAINMON_HOOKS)",
    )
    p.add_argument(
        "--no-hook",
        action="append",
        default=[],
        choices=HOOKS,
        metavar="HOOK",
        help="leave one hook out (repeatable)",
    )
    p.add_argument(
        "--flight-recorder",
        type=int,
        metavar="N",
        help="keep PyTorch's Flight Recorder on, N entries per rank (sets TORCH_FR_BUFFER_SIZE "
        "unless it is set): the collectives in flight when a rank hangs",
    )
    p.add_argument(
        "--off", action="store_true", help="run the command without trainmon (TRAINMON_AUTORUN=0)"
    )
    p.add_argument("--version", action="version", version=f"trainmon-run {__version__}")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def environment(args: argparse.Namespace, env: dict[str, str]) -> dict[str, str]:
    """The program's environment: ``env`` with trainmon's variables and ``PYTHONPATH`` set."""
    env = dict(env)
    for value, variable in (
        (args.run, "TRAINMON_RUN"),
        (args.socket, "TRAINMON_SOCKET"),
        (args.flush_interval, "TRAINMON_FLUSH_INTERVAL"),
        (args.metrics, ENV_METRICS),
    ):
        if value is not None:
            env[variable] = value
    hooks = args.hooks if args.hooks is not None else env.get(ENV_HOOKS)
    if args.no_hook:
        hooks = ",".join([hooks or "all", *(f"-{h}" for h in args.no_hook)])
    if hooks is not None:
        env[ENV_HOOKS] = hooks
    fr = args.flight_recorder
    if fr is not None and fr > 0 and not any(env.get(v) for v in FLIGHT_RECORDER_VARIABLES):
        env["TORCH_FR_BUFFER_SIZE"] = str(args.flight_recorder)
    env[ENV_AUTORUN] = "0" if args.off else "1"
    env["TRAINMON_AUTORUN_PID"] = str(os.getpid())  # the command keeps this process's id
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != BOOTSTRAP]
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP, *path])
    return env


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the options, then ``execvpe`` the command (returns only on an error)."""
    args = parser().parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser().print_usage(sys.stderr)
        print("trainmon-run: error: no command to run", file=sys.stderr)
        return 2
    env = environment(args, dict(os.environ))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        print(f"trainmon-run: {command[0]}: command not found", file=sys.stderr)
        return 127
    except PermissionError as e:
        print(f"trainmon-run: {command[0]}: {e.strerror}", file=sys.stderr)
        return 126
    except OSError as e:
        print(f"trainmon-run: {command[0]}: {e.strerror}", file=sys.stderr)
        return 126
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
