"""Where a training process learns its rank, world size, run id and flush interval.

Values from the environment never make ``init()`` raise (a job name with quotes, spaces or a
newline in ``TRAINMON_RUN``, a ``RANK`` that is not a number): each bad one is replaced or
ignored, with one warning per variable and value on the ``trainmon_client`` logger, and noted
in the caller's ``issues`` list (the run counts them in ``Run.refused`` and keeps them in
``Run.sanitised_env``). Only a bad explicit argument to ``init()`` raises.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import math
import os
import re
import socket
import stat
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from trainmon_client import _protocol as P

log = logging.getLogger("trainmon_client")

_warned: set[str] = set()


def note(issues: list[str] | None, key: str, message: str) -> None:
    """Record a sanitised environment value ``key`` in ``issues``; warn once per message."""
    if issues is not None:
        issues.append(key)
    if message not in _warned:
        _warned.add(message)
        log.warning("trainmon: %s", message)


CLIENT_VARIABLES = (
    "TRAINMON_RUN",
    "TRAINMON_SOCKET",
    "TRAINMON_FLUSH_INTERVAL",
    "TRAINMON_EXPORTER_UID",
    # trainmon-run's, in the processes it starts (trainmon_client._autorun, _launch)
    "TRAINMON_AUTORUN",
    "TRAINMON_AUTORUN_PID",
    "TRAINMON_HOOKS",
    "TRAINMON_METRICS",
)
"""The ``TRAINMON_*`` variables the client reads."""
EXPORTER_NEAR_CLIENT = frozenset({"TRAINMON_SOCKET_GROUP", "TRAINMON_SOCKET_MODE"})
"""The exporter's variables close enough to a client's to be taken for a misspelling of it: set
on a trainer (a shared environment file), they must not warn. The client cannot import the
exporter's settings; ``tests/client/test_env.py`` recomputes this set from them."""


def misspelt_variables(env: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """``(variable, suggestion)`` for each misspelt client variable; one warning about each.

    A variable is misspelt when the client does not read it, it is not one of the exporter's
    (:data:`EXPORTER_NEAR_CLIENT`; nested settings, with ``__``, are all the exporter's), and
    :func:`difflib.get_close_matches` finds a client variable close to it (ratio 0.6, the
    exporter's own rule for its variables), case-insensitively: ``TRAINMON_RUN`` with a letter
    doubled, or in lower case, gets ``TRAINMON_RUN`` suggested. Others (the exporter's, a
    script's own) are left alone.
    """
    env = os.environ if env is None else env
    suffixes = {k.removeprefix("TRAINMON_"): k for k in CLIENT_VARIABLES}
    found = []
    for key in sorted(env):
        upper = key.upper()
        if (
            not upper.startswith("TRAINMON_")
            or key in CLIENT_VARIABLES
            or upper in EXPORTER_NEAR_CLIENT
            or "__" in upper
        ):
            continue
        close = difflib.get_close_matches(upper.removeprefix("TRAINMON_"), suffixes, 1, 0.6)
        if close:
            found.append((key, suffixes[close[0]]))
            note(
                None,
                key,
                f"{key} is not a variable trainmon reads; did you mean {suffixes[close[0]]}?",
            )
    return found


_RUN_BAD = re.compile(r"[^A-Za-z0-9_.:@+\-]")


def sanitise_run_id(value: str) -> str:
    """``value`` made a valid run id; ``""`` if nothing is left.

    Each character a run id may not hold becomes ``_``, leading ``. : @ + -`` go, and it is cut
    to 128 characters.
    """
    fixed = _RUN_BAD.sub("_", value.strip()).lstrip(".:@+-")
    return fixed[: P.MAX_NAME_CHARS]


DEFAULT_SOCKET = "/run/trainmon/trainmon.sock"
"""The node-wide socket path: a root exporter's, or a service's whose directory an admin made."""


def runtime_socket(env: Mapping[str, str]) -> str | None:
    """``$XDG_RUNTIME_DIR/trainmon/trainmon.sock``, or None without an absolute runtime dir."""
    runtime = env.get("XDG_RUNTIME_DIR", "").strip()
    if runtime and os.path.isabs(runtime):
        return os.path.join(runtime, "trainmon", "trainmon.sock")
    return None


def _access(path: str, mode: int) -> bool:
    effective = os.access in os.supports_effective_ids
    return os.access(path, mode, effective_ids=effective)


def can_create_in(directory: str) -> bool:
    """Whether this process may create a socket in ``directory`` (it exists; write and search)."""
    return os.path.isdir(directory) and _access(directory, os.W_OK | os.X_OK)


def can_connect_to(path: str) -> bool:
    """Whether ``path`` is a socket this process may connect to (write permission on it)."""
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode) and _access(path, os.W_OK)
    except OSError:  # missing, or a directory on the way this user may not search
        return False


def fallback_notice(side: str, runtime: str) -> str:
    """The one line either side prints when it leaves an unusable ``/run/trainmon``."""
    directory = os.path.dirname(DEFAULT_SOCKET)
    why = (
        "it may not create a socket there"
        if side == "exporter"
        else "it holds no socket it may connect to"
    )
    return (
        f"{directory} exists but {why} (uid {os.geteuid()}); using {runtime} instead "
        "(TRAINMON_SOCKET sets another path)"
    )


def default_socket(env: Mapping[str, str] | None = None, euid: int | None = None) -> str:
    """The client's socket path when none is given (``socket_path``, ``TRAINMON_SOCKET``).

    1. :data:`DEFAULT_SOCKET` (``/run/trainmon/trainmon.sock``) for root; for anyone where a
       socket there accepts this user (write permission: the shared set-up, a root or service
       exporter); and where this user may create a socket in ``/run/trainmon`` (its own
       exporter would be there, by the exporter's rule);
    2. else ``$XDG_RUNTIME_DIR/trainmon/trainmon.sock`` (a login session), where an exporter of
       the same user meets it with no set-up. Leaving an ``/run/trainmon`` that exists but is
       of no use to this user (an admin's set-up for other users, a container recipe run once)
       warns once;
    3. else :data:`DEFAULT_SOCKET` (nothing is sent; the drop counts say so).

    The exporter's rule (``trainmon_exporter._defaults.default_socket``) differs only in that
    it needs to create the socket: both meet wherever a trainer may connect.

    Args:
        env: the environment to read (default ``os.environ``).
        euid: the effective uid (default ``os.geteuid()``); permissions are the process's own.
    """
    env = os.environ if env is None else env
    euid = os.geteuid() if euid is None else euid
    system = DEFAULT_SOCKET
    directory = os.path.dirname(system)
    if euid == 0 or can_connect_to(system) or can_create_in(directory):
        return system
    runtime = runtime_socket(env)
    if runtime is None:
        return system
    if os.path.isdir(directory):
        note(None, "socket", fallback_notice("client", runtime))
    return runtime


# (rank, local rank, world size) variables, first match wins: torchrun / torch.distributed,
# Slurm (srun), Open MPI, MPICH / Intel MPI (PMI).
_LAUNCHERS = (
    ("RANK", "LOCAL_RANK", "WORLD_SIZE"),
    ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE"),
)


def _slurm_task(env: Mapping[str, str]) -> bool:
    """Whether this process is a task of a Slurm job step (started by ``srun``).

    A batch script itself also sees ``SLURM_PROCID=0`` and the job's ``SLURM_NTASKS`` (measured
    with ``sbatch -n4``, Slurm 22.05), but it is one process, not rank 0 of N: only tasks of a
    step have ``SLURM_STEP_ID`` (``SLURM_STEPID`` in old releases).
    """
    return bool(env.get("SLURM_STEP_ID", "").strip() or env.get("SLURM_STEPID", "").strip())


def _int(env: Mapping[str, str], key: str, issues: list[str] | None, least: int = 0) -> int | None:
    """``env[key]`` as an int of at least ``least``; None when unset, or bad (then noted)."""
    value = env.get(key)
    if value is None or value.strip() == "":
        return None
    try:
        number = int(value)
    except ValueError:
        number = least - 1
    if number < least:
        note(issues, key, f"{key}={value[:60]!r} is not an integer >= {least}; ignored")
        return None
    return number


def detect_ranks(
    env: Mapping[str, str] | None = None, issues: list[str] | None = None
) -> tuple[int, int, int]:
    """Return ``(rank, local_rank, world_size)`` from the launcher's environment.

    Looks at torchrun's ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``, then Slurm (tasks started by
    ``srun`` only, not the batch script itself), Open MPI and PMI; without any, a single
    process: ``(0, 0, 1)``. A variable that is set but is not a non-negative integer (a
    positive one for the size) is ignored as if unset, with a warning, and noted in ``issues``.
    """
    env = os.environ if env is None else env
    for rank_key, local_key, size_key in _LAUNCHERS:
        if rank_key == "SLURM_PROCID" and not _slurm_task(env):
            continue
        rank = _int(env, rank_key, issues)
        if rank is None:
            continue
        local = _int(env, local_key, issues)
        size = _int(env, size_key, issues, least=1)
        return rank, rank if local is None else local, max(size or 1, rank + 1)
    return 0, 0, 1


SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
"""The namespace file Kubernetes mounts into a pod with its service-account token."""


def detect_pod(
    env: Mapping[str, str] | None = None,
    issues: list[str] | None = None,
    namespace_file: str | None = None,
) -> tuple[str, str]:
    """``(namespace, pod)`` of a client that runs in a Kubernetes pod; ``""`` for each unknown.

    The namespace is ``POD_NAMESPACE``, else the service-account file ``namespace_file``
    (default :data:`SERVICE_ACCOUNT_NAMESPACE`, mounted in every pod that has a token);
    ``POD_NAMESPACE`` set to an empty value reads no file and reports no namespace. The pod is
    ``POD_NAME``. Both variables are the
    downward API's usual names: ``env: [{name: POD_NAMESPACE, valueFrom: {fieldRef:
    {fieldPath: metadata.namespace}}}, {name: POD_NAME, valueFrom: {fieldRef: {fieldPath:
    metadata.name}}}]``. The exporter labels the rank's series with the namespace and its
    ``trainmon_rank_info`` with both, so that one namespace's run never mixes with another's
    of the same id. A value that is not a Kubernetes name (an RFC 1123 label for the
    namespace, a subdomain for the pod) is ignored with a warning and noted in ``issues``.
    """
    env = os.environ if env is None else env
    namespace = env.get("POD_NAMESPACE", "").strip()
    key = "POD_NAMESPACE"
    if "POD_NAMESPACE" not in env:
        key = namespace_file = namespace_file or SERVICE_ACCOUNT_NAMESPACE
        try:
            with open(namespace_file) as f:
                namespace = f.read(256).strip()
        except (OSError, UnicodeDecodeError):
            namespace = ""
    if namespace and not P.valid_namespace(namespace):
        note(issues, key, f"{key}={namespace[:60]!r} is not a Kubernetes namespace; ignored")
        namespace = ""
    pod = env.get("POD_NAME", "").strip()
    if pod and not P.valid_pod(pod):
        note(issues, "POD_NAME", f"POD_NAME={pod[:60]!r} is not a Kubernetes pod name; ignored")
        pod = ""
    return namespace, pod


def detect_flush_interval(env: Mapping[str, str], issues: list[str]) -> float:
    """``TRAINMON_FLUSH_INTERVAL`` (seconds, within [0, 60]), else 0.5 with a warning."""
    raw = env.get("TRAINMON_FLUSH_INTERVAL", "").strip()
    if not raw:
        return 0.5
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if 0.0 <= value <= 60.0:
        return value
    note(
        issues,
        "TRAINMON_FLUSH_INTERVAL",
        f"TRAINMON_FLUSH_INTERVAL={raw[:60]!r} is not a number of seconds within [0, 60]; "
        "using 0.5",
    )
    return 0.5


def _process_start(pid: int) -> float | None:
    """Start time of ``pid`` in Unix seconds, from ``/proc`` (Linux); None elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def detect_run_id(
    world_size: int, env: Mapping[str, str] | None = None, issues: list[str] | None = None
) -> str:
    """A run id shared by every rank of one launch.

    Order: ``TRAINMON_RUN``; ``SLURM_JOB_ID`` (as ``slurm-<id>``); torchrun's
    ``TORCHELASTIC_RUN_ID`` (unless it is the static rendezvous's ``"none"``); otherwise
    generated as ``<script>-<YYYYmmdd-HHMMSS>-<4 hex>`` from the start of the launching
    process: the process itself when alone, the parent (torchrun's agent) when
    ``world_size > 1`` so that all local ranks agree. Ranks on other nodes cannot agree on a
    generated id: multi-node launches without a rendezvous id should pass ``run=`` or set
    ``TRAINMON_RUN``.

    Inside a Slurm job the job id comes before the rendezvous id: every task on every node of
    the job sees the same one, it survives a requeue (a rendezvous id such as ``$RANDOM`` in
    the batch script does not), and it is the id ``squeue``, ``sacct`` and dcgm-exporter's
    ``hpc_job`` label use. An array element has its own job id.

    A value that is not a valid run id (quotes, spaces, newlines, over 128 characters) is
    sanitised (:func:`sanitise_run_id`), with a warning, and noted in ``issues``; one with
    nothing valid left is skipped. The result is always a valid run id.
    """
    env = os.environ if env is None else env
    elastic = env.get("TORCHELASTIC_RUN_ID", "").strip()
    slurm = env.get("SLURM_JOB_ID", "").strip()
    candidates = (
        ("TRAINMON_RUN", env.get("TRAINMON_RUN", "").strip()),
        ("SLURM_JOB_ID", f"slurm-{slurm}" if slurm else ""),
        ("TORCHELASTIC_RUN_ID", elastic if elastic.lower() != "none" else ""),
    )
    for key, value in candidates:
        if not value:
            continue
        if P.valid_run_id(value):
            return value
        fixed = sanitise_run_id(value)
        shown = value[:60]
        if fixed:
            note(issues, key, f"{key}={shown!r} is not a valid run id; using {fixed!r}")
            return fixed
        note(issues, key, f"{key}={shown!r} is not a valid run id; ignored")
    prog = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "python"
    prog = "".join(c if c.isalnum() or c in "_-." else "_" for c in prog)[:48].lstrip("-.")
    prog = prog or "python"
    pid = os.getppid() if world_size > 1 else os.getpid()
    started = _process_start(pid) or time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    digest = hashlib.sha1(f"{socket.gethostname()}:{pid}:{started}".encode()).hexdigest()[:4]
    return f"{prog}-{stamp}-{digest}"
