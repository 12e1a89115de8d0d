"""What a hung rank tells the exporter: its Python stacks and its collective state.

The exporter judges a rank hung (docs/hangs.md) and sends a CAPTURE_REQUEST on the rank's
connection; the flusher thread reads it (:mod:`~trainmon_client._transport`) and answers it
(:mod:`~trainmon_client._sender`) with :func:`capture`'s JSON, a CAPTURE record. Everything
here runs on the flusher thread, never on the training thread, and needs no ptrace, no signal
and no help from the thread it describes:

- **Stacks**: ``sys._current_frames()``, the frame every thread is executing, walked to its
  outermost caller: file, line and function per frame, each marked ``user`` when it lies
  outside the standard library, site-packages and trainmon itself (the exporter exports the
  training thread's innermost such frame). This works while the training thread waits in a
  C++ call that released the GIL (a collective, a CUDA synchronisation, a data-loader queue),
  and while it spins in pure Python (the interpreter hands the GIL over every
  ``sys.getswitchinterval()``, 5 ms). It cannot work while native code holds the GIL and never
  lets go: then this thread never runs, nothing answers, and the exporter says so.
- **CPU**: for each thread, the share of a core it used over :data:`CPU_SAMPLE_S` before the
  capture and its scheduler state (Linux ``/proc/self/task/<tid>/stat``): a thread in a
  busy loop reads about 1.0, one asleep in a collective about 0 (a CUDA synchronisation that
  spin-waits reads 1.0 too, so the frame is the evidence, the CPU a hint).
- **Collectives**: where ``torch.distributed`` is initialised, PyTorch's Flight Recorder
  (``torch._C._distributed_c10d._dump_fr_trace_json``, and ``_dump_nccl_trace_json`` where
  NCCL is built in): per process group the last collective sequence ids enqueued, started and
  completed, and the oldest collective not completed (name such as ``gloo:all_reduce``, tensor
  shapes, dtypes, how long since it was enqueued). torch is never imported here: only a
  ``torch.distributed`` the trainer already imported is read. The recorder keeps
  ``TORCH_FR_BUFFER_SIZE`` entries (on by default in torch 2.13); ``TORCH_FR_BUFFER_SIZE=0``
  turns it off, which the answer says (``recorder_off``).

Bounds: at most :data:`MAX_THREADS` threads and :data:`MAX_FRAMES` frames per thread (the
innermost kept), file names and functions cut to :data:`MAX_TEXT`, and the whole answer within
the ``max_bytes`` the exporter asked for: other threads' frames go first, then the training
thread's outermost frames (:func:`fit`). Nothing here raises: a part that fails is left out
and named in ``notes``.
"""

from __future__ import annotations

import json
import os
import site
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["CPU_SAMPLE_S", "MAX_FRAMES", "MAX_TEXT", "MAX_THREADS", "capture", "fit", "is_user"]

CPU_SAMPLE_S = 0.1
"""Seconds over which each thread's CPU share is sampled before the stacks are taken."""
MAX_THREADS = 64
"""Threads described at most (the training thread always)."""
MAX_FRAMES = 128
"""Frames kept per thread, the innermost ones."""
MAX_TEXT = 256
"""Characters kept of a file name (its end) or a function name (its start)."""
MAX_GROUPS = 32
"""Process groups described at most (those with a collective pending first)."""
MAX_SHAPES = 8
"""Tensor shapes kept per pending collective."""
_OWN_DIR = os.path.dirname(os.path.abspath(__file__))
_library_prefixes: tuple[str, ...] | None = None
_user_cache: dict[str, bool] = {}


def _prefixes() -> tuple[str, ...]:
    """Directories whose files are not the user's code: stdlib, site-packages, trainmon."""
    global _library_prefixes
    if _library_prefixes is None:
        dirs = {_OWN_DIR}
        paths = sysconfig.get_paths()
        for key in ("stdlib", "platstdlib", "purelib", "platlib"):
            if paths.get(key):
                dirs.add(paths[key])
        try:
            dirs.update(site.getsitepackages())
        except AttributeError:  # an old virtualenv's site module
            pass
        user_site = getattr(site, "USER_SITE", None)
        if user_site:
            dirs.add(user_site)
        _library_prefixes = tuple(
            sorted({os.path.join(os.path.abspath(d), "") for d in dirs if d}, key=len)
        )
    return _library_prefixes


def is_user(filename: str) -> bool:
    """Whether ``filename`` (a code object's ``co_filename``) is the user's code.

    Not the user's: the standard library, any ``site-packages`` or ``dist-packages``
    directory, frozen and built-in modules (``<frozen ...>``), and trainmon's own files.
    """
    known = _user_cache.get(filename)
    if known is not None:
        return known
    library_dir = any(os.sep + d + os.sep in filename for d in ("site-packages", "dist-packages"))
    if library_dir or filename.startswith(("<frozen", "<built-in")):
        user = False
    else:
        path = os.path.join(os.path.abspath(filename), "") if os.path.isabs(filename) else ""
        user = not (path and any(path.startswith(p) for p in _prefixes()))
    if len(_user_cache) < 4096:
        _user_cache[filename] = user
    return user


def _cut(text: str, tail: bool = False) -> str:
    if len(text) <= MAX_TEXT:
        return text
    return "..." + text[-(MAX_TEXT - 3) :] if tail else text[: MAX_TEXT - 3] + "..."


def _frames(frame: Any) -> tuple[list[list[Any]], int]:
    """``[file, line, function, user]`` from the outermost caller to ``frame``; frames left out."""
    out: list[list[Any]] = []
    omitted = 0
    f = frame
    while f is not None:
        if len(out) < MAX_FRAMES:
            code = f.f_code
            name = getattr(code, "co_qualname", code.co_name)
            line = f.f_lineno
            out.append(
                [
                    _cut(code.co_filename, tail=True),
                    line if isinstance(line, int) else 0,
                    _cut(name),
                    is_user(code.co_filename),
                ]
            )
        else:
            omitted += 1
        f = f.f_back
    out.reverse()
    return out, omitted


_TICK = 0.0


def _thread_cpu(native_ids: list[int]) -> dict[int, tuple[str, float]]:
    """``{native id: (scheduler state, CPU seconds so far)}`` from ``/proc`` (Linux; else {})."""
    global _TICK
    if not _TICK:
        try:
            _TICK = float(os.sysconf("SC_CLK_TCK"))
        except (ValueError, OSError, AttributeError):
            _TICK = 100.0
    out: dict[int, tuple[str, float]] = {}
    for tid in native_ids:
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        rest = raw[raw.rfind(b")") + 2 :].split()
        try:
            out[tid] = (rest[0].decode("ascii", "replace"), (int(rest[11]) + int(rest[12])) / _TICK)
        except (IndexError, ValueError):
            continue
    return out


def _threads(training: int | None, notes: list[str]) -> tuple[list[dict[str, Any]], int]:
    """Every thread but this one, the training thread first; and how many were left out."""
    me = threading.get_ident()
    known = {t.ident: t for t in threading.enumerate()}
    natives: dict[int | None, int] = {}
    for ident, thread in known.items():
        native = getattr(thread, "native_id", None)  # Python 3.8+ on Linux, macOS, Windows
        if ident != me and native is not None:
            natives[ident] = native
    before = _thread_cpu(list(natives.values()))
    t0 = time.perf_counter()
    if before:
        time.sleep(CPU_SAMPLE_S)  # releases the GIL: the threads run as they would
    after = _thread_cpu(list(natives.values()))
    elapsed = time.perf_counter() - t0
    frames = sys._current_frames()
    if training is not None and training not in frames:
        notes.append("the thread that called Run.log() has ended")
    main = threading.main_thread().ident
    order = sorted(
        (ident for ident in frames if ident != me), key=lambda i: (i != training, i != main, i)
    )
    threads = []
    for ident in order[:MAX_THREADS]:
        t = known.get(ident)
        stack, omitted = _frames(frames[ident])
        native = natives.get(ident)
        state = cpu = None
        if native is not None and native in after:
            state = after[native][0]
            if native in before and elapsed > 0:
                cpu = round(min(max((after[native][1] - before[native][1]) / elapsed, 0.0), 1.0), 2)
        threads.append(
            {
                "name": _cut(t.name if t is not None else f"thread-{ident}"),
                "id": ident,
                "training": ident == training,
                "state": state,
                "cpu": cpu,
                "frames": stack,
                "omitted": omitted,
            }
        )
    del frames  # frames keep their locals alive
    return threads, max(0, len(order) - MAX_THREADS)


def _as_int(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1


def _shapes(v: Any) -> list[Any]:
    return list(v[:MAX_SHAPES]) if isinstance(v, list) else []


def _groups(dumps: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """One object per process group of the recorder's dumps (see ``CAPTURE_FIELDS``)."""
    groups: dict[str, dict[str, Any]] = {}
    for dump in dumps:
        for pg, status in (dump.get("pg_status") or {}).items():
            g = groups.setdefault(
                str(pg),
                {"id": str(pg), "name": "", "enqueued": -1, "started": -1, "completed": -1},
            )
            if isinstance(status, dict):
                for key, field in (
                    ("enqueued", "last_enqueued_collective"),
                    ("started", "last_started_collective"),
                    ("completed", "last_completed_collective"),
                ):
                    g[key] = max(g[key], _as_int(status.get(field)))
        pending: dict[str, dict[str, Any]] = {}
        for e in dump.get("entries") or ():
            if not isinstance(e, dict):
                continue
            pg = str(e.get("pg_id", ""))
            g = groups.setdefault(
                pg, {"id": pg, "name": "", "enqueued": -1, "started": -1, "completed": -1}
            )
            names = e.get("process_group")
            if isinstance(names, list) and len(names) > 1 and not g["name"]:
                g["name"] = _cut(str(names[1]))
            p2p = bool(e.get("is_p2p"))
            seq = _as_int(e.get("p2p_seq_id" if p2p else "collective_seq_id"))
            if e.get("retired") or e.get("state") == "completed":
                if not p2p:  # the recorder's own count may lag its entries (gloo)
                    g["completed"] = max(g["completed"], seq)
                continue
            if pg in pending:
                continue  # entries come oldest first: the first one pending is what blocks
            created = e.get("time_created_ns")
            pending[pg] = {
                "seq": seq,
                "op": _cut(str(e.get("profiling_name", ""))),
                "p2p": p2p,
                "sizes": _shapes(e.get("input_sizes")),
                "out_sizes": _shapes(e.get("output_sizes")),
                "dtypes": [str(d) for d in _shapes(e.get("input_dtypes"))],
                "state": str(e.get("state", "")),
                "seconds": round(now - created / 1e9, 3) if isinstance(created, int) else None,
            }
        for pg, p in pending.items():
            groups[pg]["pending"] = p
    out = sorted(groups.values(), key=lambda g: ("pending" not in g, _as_int(g["id"]), g["id"]))
    for g in out:
        g.setdefault("pending", None)
    return out


def _collectives(notes: list[str]) -> dict[str, Any] | None:
    """The Flight Recorder's state where ``torch.distributed`` is initialised, else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if not dist.is_available() or not dist.is_initialized():
            return None
        c10d = sys.modules["torch"]._C._distributed_c10d
    except Exception:
        return None
    size = os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"))
    dumpers = [
        getattr(c10d, name, None) for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json")
    ]
    dumps = []
    errors = []
    for dump in dumpers:
        if dump is None:
            continue
        try:
            dumps.append(json.loads(dump(True, False)))
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:200])
    if not dumps:
        detail = "; ".join(errors) or "this torch has no Flight Recorder dump"
        notes.append(f"collective state unavailable: {detail}")
        return {"state": "error", "detail": detail, "groups": [], "groups_omitted": 0}
    groups = _groups(dumps, time.time())
    state, detail = "ok", "; ".join(errors)
    if not groups and size is not None and size.strip() == "0":
        state = "recorder_off"
        detail = (
            "PyTorch's Flight Recorder is off (TORCH_FR_BUFFER_SIZE=0): set "
            "TORCH_FR_BUFFER_SIZE=2000 in the trainer's environment"
        )
        notes.append(detail)
    return {
        "state": state,
        "detail": detail,
        "groups": groups[:MAX_GROUPS],
        "groups_omitted": max(0, len(groups) - MAX_GROUPS),
    }


def _encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":"), allow_nan=False, default=str).encode()


def fit(body: dict[str, Any], max_bytes: int) -> bytes:
    """``body`` as JSON of at most ``max_bytes`` bytes, cut where it must be.

    In order, until it fits: the other threads keep their innermost 8 frames, then lose
    them all, then are left out; the training thread keeps its innermost 32 frames, then 8;
    the process groups without a pending collective are left out. What was cut is counted
    (``omitted``, ``threads_omitted``, ``groups_omitted``) and noted. A body that still does
    not fit is replaced by one that says so.
    """
    raw = _encode(body)
    if len(raw) <= max_bytes:
        return raw
    notes: list[str] = body.setdefault("notes", [])
    notes.append(f"cut to fit the exporter's {max_bytes} bytes")

    def keep(training: bool, n: int) -> None:
        for t in body.get("threads") or ():
            if t["training"] is training and len(t["frames"]) > n:
                t["omitted"] += len(t["frames"]) - n
                t["frames"] = t["frames"][len(t["frames"]) - n :] if n else []

    def drop_threads() -> None:
        threads = body.get("threads") or []
        kept = [t for t in threads if t["training"]]
        body["threads_omitted"] = body.get("threads_omitted", 0) + len(threads) - len(kept)
        body["threads"] = kept

    def drop_groups() -> None:
        c = body.get("collectives")
        if isinstance(c, dict):
            groups = c.get("groups") or []
            kept = [g for g in groups if g.get("pending")][:4]
            c["groups_omitted"] = c.get("groups_omitted", 0) + len(groups) - len(kept)
            c["groups"] = kept

    steps: list[Callable[[], None]] = [
        lambda: keep(False, 8),
        lambda: keep(False, 0),
        drop_threads,
        lambda: keep(True, 32),
        lambda: keep(True, 8),
        drop_groups,
    ]
    for step in steps:
        step()
        raw = _encode(body)
        if len(raw) <= max_bytes:
            return raw
    small = {"time": body.get("time"), "notes": [f"the capture did not fit in {max_bytes} bytes"]}
    return _encode(small)[:max_bytes]


def capture(training: int | None, max_bytes: int) -> bytes:
    """The CAPTURE answer (JSON, at most ``max_bytes``): stacks, CPU, collective state.

    ``training``: the ``threading.get_ident()`` of the thread that calls ``Run.log()``
    (None: not known yet). Takes about :data:`CPU_SAMPLE_S` plus a millisecond per hundred
    frames and the recorder's dump. Never raises.
    """
    t0 = time.perf_counter()
    body: dict[str, Any] = {"time": time.time(), "notes": []}
    notes: list[str] = body["notes"]
    try:
        body["threads"], body["threads_omitted"] = _threads(training, notes)
    except Exception as exc:
        notes.append(f"stacks unavailable: {type(exc).__name__}: {exc}"[:300])
    try:
        body["collectives"] = _collectives(notes)
    except Exception as exc:
        notes.append(f"collective state unavailable: {type(exc).__name__}: {exc}"[:300])
    body["seconds"] = round(time.perf_counter() - t0, 4)
    return fit(body, max_bytes)
