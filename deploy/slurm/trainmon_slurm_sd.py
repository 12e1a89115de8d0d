#!/usr/bin/env python3
"""Prometheus file_sd targets for the trainmon exporters of a Slurm cluster.

Asks Slurm for its nodes (``sinfo --Node``) and writes one target group per node to a
``file_sd_configs`` file, atomically (a temporary file renamed over the old one), and only when
the content changed, so Prometheus re-reads it only then::

    trainmon_slurm_sd.py --output /etc/prometheus/file_sd/trainmon.json             # once
    trainmon_slurm_sd.py --output /etc/prometheus/file_sd/trainmon.json --interval 60
    trainmon_slurm_sd.py --output … --partition gpu --gpu-nodes --port 9478

Each group is ``{"targets": ["<NodeAddr>:<port>"], "labels": {"instance": "<NodeName>:<port>",
"node": "<NodeName>"}}`` (an IPv6 NodeAddr in brackets: ``[fd00::11]:9478``): Prometheus
connects to the address slurmctld itself uses to reach the node's slurmd, and every series
and alert names the node as Slurm does (``scontrol show node``, ``squeue -w``). Nodes Slurm
reports down, powered down or not yet in service (``--skip-states``) are left out, so their
exporters are not reported as unreachable while the node is known to be out; a drained node
still counts (its running jobs are monitored).

If Slurm cannot be asked (slurmctld unreachable, ``sinfo`` missing), the old file is kept: an
empty target list would make Prometheus forget every exporter. The exit status is then 1 with
``--interval 0`` (one pass); with an interval the error is printed and the next pass tries
again. Python 3.9 or newer, standard library only; needs the Slurm client commands and a
``slurm.conf`` (``SLURM_CONF``) on the Prometheus host.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SINFO_FORMAT = "%N|%o|%n|%P|%G|%T"
"""sinfo fields: node name, NodeAddr, NodeHostName, partition, GRES, long state."""
DEFAULT_SKIP_STATES = ("down", "future", "powered_down", "powering_down")
STATE_SUFFIXES = {
    "*": "not_responding",
    "~": "powered_down",
    "#": "powering_up",
    "!": "power_down_pending",
    "%": "powering_down",
    "$": "maintenance",
    "@": "reboot_pending",
    "^": "rebooting",
    "-": "planned",
}
"""The flag characters sinfo appends to a state (``sinfo(1)``, NODE STATE CODES)."""


class SlurmError(Exception):
    """Slurm could not be asked for its nodes; the message says why in one line."""


def parse_sinfo(text: str) -> list[dict[str, str]]:
    """Nodes of ``sinfo --noheader --Node --format='%N|%o|%n|%P|%G|%T'`` output.

    Returns one dict per node (``name``, ``addr``, ``hostname``, ``partitions`` joined by
    commas, ``gres``, ``state``), in sinfo's order; a node in several partitions is one entry.
    The state is lower case with its flag characters spelt out as ``+`` flags
    (``idle~`` → ``idle+powered_down``, ``down*`` → ``down+not_responding``).

    Raises:
        SlurmError: a line that does not have the six fields.
    """
    nodes: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.split("|")
        if len(fields) != 6:
            raise SlurmError(f"unexpected sinfo line {line!r} (want {SINFO_FORMAT})")
        name, addr, hostname, partition, gres, state = (f.strip() for f in fields)
        state = state.lower()
        flags = []
        while state and state[-1] in STATE_SUFFIXES:
            flags.append(STATE_SUFFIXES[state[-1]])
            state = state[:-1]
        state = "+".join([state, *flags])
        partition = partition.rstrip("*")
        if name in nodes:
            parts = nodes[name]["partitions"].split(",")
            if partition not in parts:
                nodes[name]["partitions"] = ",".join([*parts, partition])
            continue
        nodes[name] = {
            "name": name,
            "addr": addr or hostname or name,
            "hostname": hostname or name,
            "partitions": partition,
            "gres": gres,
            "state": state,
        }
    return list(nodes.values())


def host_port(host: str, port: int) -> str:
    """``host:port`` as Prometheus parses a target: an IPv6 address in brackets
    (``fd00::1`` → ``[fd00::1]:9478``), a name or IPv4 address as it is."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def targets(
    nodes: list[dict[str, str]],
    port: int,
    *,
    address: str = "addr",
    gpu_nodes: bool = False,
    skip_states: tuple[str, ...] = DEFAULT_SKIP_STATES,
) -> list[dict[str, Any]]:
    """file_sd target groups for ``nodes`` (from :func:`parse_sinfo`), sorted by node name.

    Args:
        nodes: the cluster's nodes.
        port: the exporters' HTTP port.
        address: what Prometheus connects to: ``addr`` (NodeAddr), ``hostname``
            (NodeHostName) or ``name`` (NodeName).
        gpu_nodes: keep only nodes with a ``gpu`` GRES.
        skip_states: leave out nodes whose state (or one of its ``+`` flags) is one of these.
    """
    groups = []
    for node in sorted(nodes, key=lambda n: n["name"]):
        states = set(node["state"].split("+"))
        if states & set(skip_states):
            continue
        if gpu_nodes and not any(g.startswith("gpu") for g in node["gres"].split(",")):
            continue
        host = node[address]
        groups.append(
            {
                "targets": [host_port(host, port)],
                "labels": {"instance": f"{node['name']}:{port}", "node": node["name"]},
            }
        )
    return groups


def ask_slurm(partition: str | None, timeout: float) -> str:
    """``sinfo`` output for :func:`parse_sinfo` (every partition, hidden ones too).

    Raises:
        SlurmError: sinfo is missing, failed or timed out.
    """
    cmd = ["sinfo", "--all", "--noheader", "--Node", f"--format={SINFO_FORMAT}"]
    if partition:
        cmd.append(f"--partition={partition}")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise SlurmError("sinfo not found: install the Slurm client commands") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"sinfo did not answer within {timeout:g} s") from None
    if out.returncode != 0:
        raise SlurmError(f"sinfo failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


def write_if_changed(path: Path, groups: list[dict[str, Any]]) -> bool:
    """Write ``groups`` as JSON to ``path`` atomically; False if the file already says that."""
    text = json.dumps(groups, indent=2) + "\n"
    try:
        if path.read_text() == text:
            return False
    except OSError:
        pass
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return True


def one_pass(args: argparse.Namespace) -> int:
    """Ask Slurm and update the file; 0 on success, 1 (file kept) if Slurm could not answer."""
    try:
        nodes = parse_sinfo(ask_slurm(args.partition, args.timeout))
    except SlurmError as e:
        print(f"trainmon_slurm_sd: {e}; {args.output} left as it was", file=sys.stderr)
        return 1
    groups = targets(
        nodes,
        args.port,
        address=args.address,
        gpu_nodes=args.gpu_nodes,
        skip_states=tuple(s for s in args.skip_states.split(",") if s),
    )
    if write_if_changed(args.output, groups):
        print(f"trainmon_slurm_sd: {len(groups)} targets in {args.output}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--output", type=Path, required=True, help="the file_sd JSON file to write")
    p.add_argument("--port", type=int, default=9478, help="exporter HTTP port (default 9478)")
    p.add_argument("--partition", help="only these partitions (sinfo --partition syntax)")
    p.add_argument("--gpu-nodes", action="store_true", help="only nodes with a gpu GRES")
    p.add_argument(
        "--address",
        choices=("addr", "hostname", "name"),
        default="addr",
        help="connect to NodeAddr (default), NodeHostName or NodeName",
    )
    p.add_argument(
        "--skip-states",
        default=",".join(DEFAULT_SKIP_STATES),
        help="comma-separated node states to leave out (default: %(default)s)",
    )
    p.add_argument("--interval", type=float, default=0, help="repeat every N s (0: once)")
    p.add_argument("--timeout", type=float, default=30, help="sinfo timeout in s")
    args = p.parse_args(argv)
    if args.interval <= 0:
        return one_pass(args)
    while True:
        one_pass(args)
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
