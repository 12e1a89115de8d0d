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
from typing import NamedTuple

from trainmon_client import _names as N

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
    return fixed[: N.MAX_NAME_CHARS]


DEFAULT_SOCKET = "/run/trainmon/trainmon.sock"
"""The node-wide socket path: a root exporter's, or a service's whose directory an admin made."""


def _writable_by_others(st: os.stat_result) -> bool:
    """Whether users other than the owner may add, rename or remove the directory's entries.

    Group or other write permission, unless the directory is sticky (``/tmp``): there only the
    owner of an entry may rename or remove it, so this user's own entries stay its own.
    """
    return bool(st.st_mode & 0o022) and not st.st_mode & stat.S_ISVTX


def runtime_dir_problem(path: str, euid: int | None = None) -> str | None:
    """Why the runtime directory ``path`` cannot hold this user's socket, or None when it can.

    ``$XDG_RUNTIME_DIR`` is inherited, and can name a directory another user made (a shell
    after ``su``, a shared job script, a container's environment): a trainer there would send
    its metrics to whoever listens, and an exporter would listen where that user can swap
    the socket. So, as the XDG Base Directory specification has it, the directory must be
    this user's: ``path`` (an absolute path, symbolic links resolved) is a directory owned by
    ``euid`` that no one else may write; every directory above it is owned by root or
    ``euid`` and writable by no one else unless sticky; and its ``trainmon`` directory, where
    it exists, is a directory (not a link) owned by ``euid`` or root that no one else may
    write.

    Args:
        path: the resolved ``$XDG_RUNTIME_DIR``.
        euid: whose it must be (default ``os.geteuid()``).
    """
    euid = os.geteuid() if euid is None else euid
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"it cannot be read ({exc.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != euid:
        return f"it belongs to uid {st.st_uid}, not to this user (uid {euid})"
    if st.st_mode & 0o022:
        return f"other users may write it (mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700)"
    parent = os.path.dirname(path)
    while True:
        try:
            up = os.stat(parent)
        except OSError as exc:
            return f"{parent} cannot be read ({exc.strerror})"
        if up.st_uid not in (euid, 0) or _writable_by_others(up):
            return (
                f"{parent} above it may be changed by another user (uid {up.st_uid}, mode "
                f"{stat.S_IMODE(up.st_mode):04o})"
            )
        if parent == os.path.dirname(parent):
            break
        parent = os.path.dirname(parent)
    sub = os.path.join(path, "trainmon")
    try:
        st = os.lstat(sub)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{sub} cannot be read ({exc.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{sub} is not a directory"
    if st.st_uid not in (euid, 0) or st.st_mode & 0o022:
        return (
            f"{sub} may be changed by another user (uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):04o})"
        )
    return None


def runtime_socket(
    env: Mapping[str, str], euid: int | None = None
) -> tuple[str | None, str | None]:
    """``($XDG_RUNTIME_DIR/trainmon/trainmon.sock, None)`` where that directory is this user's.

    The path has symbolic links resolved, so a link someone else can change never stands
    between the check and the connection. Else ``(None, why)``: ``why`` is None when no
    absolute ``$XDG_RUNTIME_DIR`` is set, else why it is not trusted
    (:func:`runtime_dir_problem`).
    """
    runtime = env.get("XDG_RUNTIME_DIR", "").strip()
    if not runtime or not os.path.isabs(runtime):
        return None, None
    real = os.path.realpath(runtime)
    problem = runtime_dir_problem(real, euid)
    if problem is not None:
        return None, f"XDG_RUNTIME_DIR={runtime} is not used for the socket: {problem}"
    return os.path.join(real, "trainmon", "trainmon.sock"), None


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


class SocketChoice(NamedTuple):
    """The socket a side picks by default, and what a user may need to know about the pick."""

    path: str
    fallback: str | None = None
    """Why not ``/run/trainmon``, where it exists but is of no use to this user (``this user
    may not create a socket there (uid 1000)``); None where the node-wide path was taken or no
    such directory exists. Worth saying only where it matters: in the exporter's start-up
    line, and in the client's warning when nothing listens at the path it took."""
    distrust: str | None = None
    """Why ``$XDG_RUNTIME_DIR`` was not used (:func:`runtime_dir_problem`), or None. Worth a
    warning whenever it happens: the user's own runtime directory is not what it should be."""


def choose_socket(
    side: str, env: Mapping[str, str] | None = None, euid: int | None = None
) -> SocketChoice:
    """The default socket of ``side`` (``"client"`` or ``"exporter"``), by the one rule.

    1. :data:`DEFAULT_SOCKET` (``/run/trainmon/trainmon.sock``) for root; where this user may
       create a socket in ``/run/trainmon`` (its own exporter goes there); and, for a client,
       where a socket there accepts this user (the shared set-up, a root or service exporter);
    2. else ``$XDG_RUNTIME_DIR/trainmon/trainmon.sock`` where that directory is this user's
       own (:func:`runtime_socket`): an exporter and a trainer of the same login meet there
       with no setting;
    3. else :data:`DEFAULT_SOCKET` (a client sends nothing and its drop counts say so; an
       exporter's socket check says which path to pass).

    Both sides meet wherever a trainer may connect. No side prints anything here: the caller
    says what matters when it matters (:class:`SocketChoice`).

    Args:
        side: ``"client"`` or ``"exporter"``.
        env: the environment to read (default ``os.environ``).
        euid: the effective uid (default ``os.geteuid()``); permissions are the process's own.
    """
    env = os.environ if env is None else env
    euid = os.geteuid() if euid is None else euid
    system = DEFAULT_SOCKET
    directory = os.path.dirname(system)
    if euid == 0 or can_create_in(directory) or (side == "client" and can_connect_to(system)):
        return SocketChoice(system)
    runtime, distrust = runtime_socket(env, euid)
    if runtime is None:
        return SocketChoice(system, None, distrust)
    fallback = None
    if os.path.isdir(directory):
        fallback = (
            "this user may not create a socket there"
            if side == "exporter"
            else "it holds no socket this user may connect to"
        ) + f" (uid {euid})"
    return SocketChoice(runtime, fallback)


def default_socket(env: Mapping[str, str] | None = None, euid: int | None = None) -> str:
    """The client's socket path when none is given (``socket_path``, ``TRAINMON_SOCKET``).

    :func:`choose_socket` for the client: ``/run/trainmon/trainmon.sock`` where this user may
    use it, else its own ``$XDG_RUNTIME_DIR/trainmon/trainmon.sock``. A runtime directory that
    is not this user's own is not used, with a warning (once per process); the fallback from
    an ``/run/trainmon`` of no use to this user is said only if nothing listens where the
    client went (:mod:`trainmon_client._transport`).

    The exporter's rule (``trainmon_exporter._defaults.default_socket``) differs only in that
    it needs to create the socket: both meet wherever a trainer may connect.

    Args:
        env: the environment to read (default ``os.environ``).
        euid: the effective uid (default ``os.geteuid()``); permissions are the process's own.
    """
    choice = choose_socket("client", env, euid)
    if choice.distrust is not None:
        note(None, "socket", choice.distrust)
    return choice.path


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
    if namespace and not N.valid_namespace(namespace):
        note(issues, key, f"{key}={namespace[:60]!r} is not a Kubernetes namespace; ignored")
        namespace = ""
    pod = env.get("POD_NAME", "").strip()
    if pod and not N.valid_pod(pod):
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


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.I)
"""A UUID as ``str(uuid.uuid4())`` writes it: ``torchrun --standalone``'s rendezvous id."""


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
    ``TORCHELASTIC_RUN_ID`` (unless it is the static rendezvous's ``"none"``; a UUID, which
    ``torchrun --standalone`` makes up for every launch, becomes ``<script>-<its first 8 hex
    digits>``: as unique on one node, the same on every rank, and it says what ran); otherwise
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
    prog = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "python"
    prog = "".join(c if c.isalnum() or c in "_-." else "_" for c in prog)[:48].lstrip("-.")
    prog = prog or "python"
    elastic = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if _UUID.fullmatch(elastic):
        elastic = f"{prog}-{elastic[:8].lower()}"
    slurm = env.get("SLURM_JOB_ID", "").strip()
    candidates = (
        ("TRAINMON_RUN", env.get("TRAINMON_RUN", "").strip()),
        ("SLURM_JOB_ID", f"slurm-{slurm}" if slurm else ""),
        ("TORCHELASTIC_RUN_ID", elastic if elastic.lower() != "none" else ""),
    )
    for key, value in candidates:
        if not value:
            continue
        if N.valid_run_id(value):
            return value
        fixed = sanitise_run_id(value)
        shown = value[:60]
        if fixed:
            note(issues, key, f"{key}={shown!r} is not a valid run id; using {fixed!r}")
            return fixed
        note(issues, key, f"{key}={shown!r} is not a valid run id; ignored")
    pid = os.getppid() if world_size > 1 else os.getpid()
    started = _process_start(pid) or time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    digest = hashlib.sha1(f"{socket.gethostname()}:{pid}:{started}".encode()).hexdigest()[:4]
    return f"{prog}-{stamp}-{digest}"
