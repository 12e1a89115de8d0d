"""A hung rank's evidence: what its client captured when the exporter asked (docs/hangs.md).

When a rank is judged hung, the exporter sends its connection a CAPTURE_REQUEST and keeps an
:class:`Evidence` for it, ``pending`` until the client's CAPTURE answers (``captured``) or
``hang_capture_timeout_seconds`` pass (``no_answer``: native code holding the GIL, a stopped
process, or a client that predates capture). A capture is checked against :class:`Capture`
(types, counts and lengths bounded) before it is kept; one that breaks it is refused whole.

What the exporter exports of it while the rank is hung (the views show all of it): the
training thread's innermost frame in the user's code as one label (:meth:`Evidence.label`),
the collective its process groups wait in (:meth:`Evidence.collective`) and their sequence ids
(:meth:`Evidence.sequences`). File paths and function names are the trainer's own text: they
reach ``/metrics`` only as the frame label, cut to a file's base name and the characters of
:func:`label_part`.
"""

from __future__ import annotations

import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal, NamedTuple

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)

from trainmon_client import _protocol as P

if TYPE_CHECKING:
    from trainmon_exporter.state.rank import RankState

__all__ = [
    "CAPTURE_RESULTS",
    "EVIDENCE_DROPS",
    "EXPORTED_GROUPS",
    "NO_ANSWER_FRAME",
    "SEQUENCE_STATES",
    "STATUSES",
    "Capture",
    "Evidence",
    "Frame",
    "GpuEvidence",
    "HangEvidence",
    "label_part",
]

CAPTURE_RESULTS = ("captured", "no_answer", "not_sent")
"""``result`` values of ``trainmon_hang_captures_total``: what became of each request."""
EVIDENCE_DROPS = ("unsolicited", "late", "too_large", "invalid", "budget", "evicted")
"""``reason`` values of ``trainmon_hang_evidence_dropped_total``: a CAPTURE that answers no
request of its connection (or one already answered); one that came after the wait ran out and
the rank had stepped again (it shows where the rank is now, not where it hung: the evidence
stays "no answer"); one over ``hang_capture_max_bytes``; one that breaks its layout; one that
does not fit ``hang_evidence_max_bytes`` (every byte held by ranks hung now); and older
evidence of a rank no longer hung, evicted to make room."""
STATUSES = ("pending", "captured", "no_answer")
"""What became of a request: asked and waiting, answered, or no answer in time."""
SEQUENCE_STATES = ("enqueued", "started", "completed")
"""``state`` label values of ``trainmon_hang_collective_sequence``."""
EXPORTED_GROUPS = 4
"""Process groups of a rank whose sequence ids are exported (those with a collective pending
first, then by id): a bound on the series a hung rank adds."""
NO_ANSWER_FRAME = "(no answer)"
"""The frame label of a rank that did not answer in time: it differs from every frame, so a
rank that cannot answer (native code holding the GIL) is named like one stuck elsewhere."""
_LABEL_PART = re.compile(r"[^A-Za-z0-9_.:<>-]+")
_TEXT_LIMIT = 1024

Text = Annotated[StrictStr, Field(max_length=_TEXT_LIMIT)]
Shape = Annotated[list[StrictInt], Field(max_length=16)]


class Thread(BaseModel):
    """One thread of a capture (the wire's ``threads`` entries, ``CAPTURE_FIELDS``)."""

    model_config = ConfigDict(extra="ignore")

    name: Text = ""
    id: StrictInt = 0
    training: StrictBool = False
    state: Annotated[StrictStr, Field(max_length=8)] | None = None
    cpu: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    frames: Annotated[list[tuple[Text, StrictInt, Text, StrictBool]], Field(max_length=512)] = []
    """``(file, line, function, user)``, outermost first."""
    omitted: Annotated[StrictInt, Field(ge=0)] = 0


class Pending(BaseModel):
    """The oldest collective of a process group that has not completed."""

    model_config = ConfigDict(extra="ignore")

    seq: StrictInt
    op: Annotated[StrictStr, Field(max_length=128)] = ""
    p2p: StrictBool = False
    sizes: Annotated[list[Shape], Field(max_length=16)] = []
    out_sizes: Annotated[list[Shape], Field(max_length=16)] = []
    dtypes: Annotated[list[Annotated[StrictStr, Field(max_length=32)]], Field(max_length=16)] = []
    state: Annotated[StrictStr, Field(max_length=32)] = ""
    seconds: Annotated[float, Field(allow_inf_nan=False)] | None = None


class Group(BaseModel):
    """One process group in PyTorch's Flight Recorder (-1: the recorder does not track it)."""

    model_config = ConfigDict(extra="ignore")

    id: Annotated[StrictStr, Field(max_length=64)]
    name: Text = ""
    enqueued: StrictInt = -1
    started: StrictInt = -1
    completed: StrictInt = -1
    pending: Pending | None = None


class Collectives(BaseModel):
    """torch.distributed's state: ``ok``, ``recorder_off`` or ``error``, and the groups."""

    model_config = ConfigDict(extra="ignore")

    state: Literal["ok", "recorder_off", "error"]
    detail: Text = ""
    groups: Annotated[list[Group], Field(max_length=64)] = []
    groups_omitted: Annotated[StrictInt, Field(ge=0)] = 0


class Capture(BaseModel):
    """A CAPTURE's JSON object as the exporter keeps it (``_protocol.CAPTURE_FIELDS``).

    Raises ``pydantic.ValidationError`` on a wrong type or a bound passed (512 frames per
    thread, 128 threads, 64 groups, 1,024 characters of text); unknown keys are ignored.
    """

    model_config = ConfigDict(extra="ignore")

    time: Annotated[float, Field(allow_inf_nan=False)] | None = None
    seconds: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    threads: Annotated[list[Thread], Field(max_length=128)] = []
    threads_omitted: Annotated[StrictInt, Field(ge=0)] = 0
    collectives: Collectives | None = None
    notes: Annotated[list[Text], Field(max_length=16)] = []


class Frame(NamedTuple):
    """One frame of a stack: file (as the trainer's Python names it), line, function."""

    file: str
    line: int
    function: str

    @property
    def text(self) -> str:
        """``function (file base name:line)``, as py-spy prints a frame."""
        return f"{self.function} ({os.path.basename(self.file)}:{self.line})"


class GpuEvidence(NamedTuple):
    """The rank's GPU when its capture arrived (the NVML sampler's last pass; None: unread).

    Power and SM activity, not utilisation: a GPU deadlocked in an NCCL kernel reads 100 %
    utilisation (a kernel is resident) while its power falls toward idle and few SMs work.
    """

    power_watts: float | None
    power_limit_watts: float | None
    sm_active_ratio: float | None


def label_part(text: str, limit: int = 64) -> str:
    """``text`` with only letters, digits and ``_ . : < > -``, others as ``_``, cut to ``limit``."""
    return _LABEL_PART.sub("_", text)[:limit]


@dataclass(slots=True)
class Evidence:
    """One hang episode's request and what answered it.

    Attributes:
        request_id: the CAPTURE_REQUEST's id; only a CAPTURE echoing it is taken.
        requested_mono: when it was sent (exporter ``time.monotonic()``).
        requested_at: the same, Unix seconds.
        step: the rank's last step when it was judged hung.
        status: one of :data:`STATUSES`.
        capture: the checked answer (None until ``captured``).
        answered_at: when it arrived (Unix s).
        size: its bytes of JSON (what the per-exporter bound counts).
        gpu: the rank's GPU when it arrived (None: no GPU known or sampled).
        native: ``py-spy dump`` of the process (the optional native stacks), or None.
        note: why something is missing (no answer, no native stacks...), for the views.
    """

    request_id: int
    requested_mono: float
    requested_at: float
    step: int | None
    status: str = "pending"
    capture: Capture | None = None
    answered_at: float | None = None
    size: int = 0
    gpu: GpuEvidence | None = None
    native: str | None = None
    note: str = ""

    def training(self) -> Thread | None:
        """The thread that calls ``Run.log()`` (the first one marked ``training``), or None."""
        if self.capture is None:
            return None
        return next((t for t in self.capture.threads if t.training), None)

    def frames(self) -> list[Frame]:
        """The training thread's stack, outermost first ([] without one)."""
        t = self.training()
        return [] if t is None else [Frame(f, n, fn) for f, n, fn, _ in t.frames]

    def frame(self) -> Frame | None:
        """The training thread's innermost frame in the user's code.

        Its innermost frame of any code when none is the user's (a loop inside a
        framework's ``fit()``); None without a training thread.
        """
        t = self.training()
        if t is None or not t.frames:
            return None
        users = [f for f in t.frames if f[3]]
        file, line, function, _ = (users or t.frames)[-1]
        return Frame(file, line, function)

    def label(self) -> str | None:
        """The ``frame`` label of ``trainmon_hang_frame_info``; None while nothing is known.

        ``function (file:line)`` with the file's base name, each part through
        :func:`label_part`; :data:`NO_ANSWER_FRAME` when the rank did not answer, or
        answered without a training thread's stack.
        """
        if self.status == "no_answer":
            return NO_ANSWER_FRAME
        if self.status != "captured":
            return None
        f = self.frame()
        if f is None:
            return NO_ANSWER_FRAME
        base = os.path.basename(f.file)
        return f"{label_part(f.function)} ({label_part(base)}:{f.line})"

    def groups(self) -> list[Group]:
        """The process groups the recorder described (pending ones first, as sent)."""
        c = None if self.capture is None else self.capture.collectives
        return [] if c is None else list(c.groups)

    def pending(self) -> Pending | None:
        """The collective the rank waits in: the first group's pending one, or None."""
        return next((g.pending for g in self.groups() if g.pending is not None), None)

    def collective(self) -> str:
        """The ``collective`` label: the pending collective's name (``gloo:all_reduce``) or ""."""
        p = self.pending()
        return "" if p is None else label_part(p.op, 64)

    def sequences(self) -> list[tuple[str, str, int]]:
        """``(group id, state, sequence id)`` to export: :data:`EXPORTED_GROUPS` groups at most.

        A state the recorder does not track (-1) is left out.
        """
        out = []
        for g in self.groups()[:EXPORTED_GROUPS]:
            for state, value in zip(
                SEQUENCE_STATES, (g.enqueued, g.started, g.completed), strict=True
            ):
                if value >= 0:
                    out.append((label_part(g.id), state, value))
        return out


class HangEvidence:
    """The evidence one store holds (:attr:`Store.hangs <trainmon_exporter.state.store.Store>`).

    Request ids, the requests still waiting for an answer, what each answer became (counted by
    :data:`CAPTURE_RESULTS` and :data:`EVIDENCE_DROPS`), and the byte bound: one answer at
    most ``capture_max_bytes``, every rank's together at most ``evidence_max_bytes``. Works
    under the store's lock; each rank's episode lives in its ``RankState.hang``.

    Attributes:
        gpu_probe: reads a rank's GPU (by UUID) from the NVML sampler's last pass when its
            answer arrives; None: no GPU sampling.
    """

    def __init__(self, capture_max_bytes: int, evidence_max_bytes: int) -> None:
        self.capture_max_bytes = capture_max_bytes
        self.evidence_max_bytes = evidence_max_bytes
        self.bytes = 0
        self.requests = 0
        self.results: dict[str, int] = dict.fromkeys(CAPTURE_RESULTS, 0)
        self.dropped: dict[str, int] = dict.fromkeys(EVIDENCE_DROPS, 0)
        self.gpu_probe: Callable[[str], GpuEvidence | None] | None = None
        self._last_id = 0
        self._held: OrderedDict[tuple[str, int], RankState] = OrderedDict()  # oldest first
        self._waiting: dict[tuple[str, int], RankState] = {}

    def begin(self, state: RankState, now_mono: float) -> int:
        """A hang episode of ``state`` starts: its request id; its evidence is ``pending``.

        The evidence of the rank's previous episode goes (one episode per rank).
        """
        self._last_id = (self._last_id + 1) & 0xFFFFFFFF
        self.forget(state)
        state.hang = Evidence(self._last_id, now_mono, time.time(), state.step)
        self._waiting[state.key] = state
        self.requests += 1
        return self._last_id

    def not_sent(self, state: RankState, why: str) -> None:
        """The request of :meth:`begin` could not be sent (``why``): no answer at once."""
        ev = state.hang
        if ev is not None and ev.status == "pending":
            ev.status, ev.note = "no_answer", why
            self.results["not_sent"] += 1
        self._waiting.pop(state.key, None)

    def expire(self, timeout_s: float, now_mono: float) -> list[RankState]:
        """Requests older than ``timeout_s`` with no answer become ``no_answer``; those ranks.

        An answer that comes later is still taken.
        """
        out = []
        for key, s in list(self._waiting.items()):
            ev = s.hang
            if ev is None or ev.status != "pending":
                del self._waiting[key]
            elif now_mono - ev.requested_mono >= timeout_s:
                del self._waiting[key]
                ev.status = "no_answer"
                ev.note = (
                    f"no answer within {timeout_s:g} s of the request: native code may hold "
                    "the GIL (a C extension that never releases it), the process may be "
                    "stopped or swapping, or its client predates capture (client "
                    f"{s.client_version or 'unknown'})"
                )
                self.results["no_answer"] += 1
                out.append(s)
        return out

    def observe(self, state: RankState, record: P.Capture) -> bool:
        """Take a CAPTURE of ``state``'s connection; False (and a count) when it is refused.

        Taken only as the answer to the rank's last request (its id), once, and after the
        wait ran out only while the rank is still hung. Refused whole: ``unsolicited``,
        ``late``, ``too_large``, ``invalid`` (breaks :class:`Capture`), ``budget``
        (every byte of the bound is held by ranks hung now). Evidence of ranks no longer hung
        is evicted first to make room, oldest answer first (``evicted``). The record carries
        no run or rank: it is the rank its connection's HELLO bound, whatever it says.
        """
        ev = state.hang
        reason = None
        capture = None
        if ev is None or record.request_id != ev.request_id or ev.status == "captured":
            reason = "unsolicited"
        elif ev.status == "no_answer" and not state.analytics.hung:
            reason = "late"
            ev.note += "; an answer came after the rank had stepped again (not kept)"
        elif record.size > self.capture_max_bytes:
            reason = "too_large"
        else:
            try:
                capture = Capture.model_validate(record.fields)
            except ValidationError:
                reason = "invalid"
        if ev is not None and reason is None and not self._room_for(record.size):
            reason = "budget"
            ev.note = (
                f"an answer of {record.size} bytes came, but the exporter's "
                f"hang_evidence_max_bytes ({self.evidence_max_bytes}) is held by hung ranks"
            )
        if reason is not None or ev is None or capture is None:
            self.dropped[reason or "invalid"] += 1
            return False
        if ev.status == "no_answer":
            self.results["no_answer"] -= 1  # it came late: the request was answered
        ev.status, ev.capture, ev.size, ev.note = "captured", capture, record.size, ""
        ev.answered_at = time.time()
        if self.gpu_probe is not None and state.gpu_uuid:
            ev.gpu = self.gpu_probe(state.gpu_uuid)
        self.bytes += record.size
        self._held[state.key] = state
        self._waiting.pop(state.key, None)
        self.results["captured"] += 1
        return True

    def native(self, state: RankState, request_id: int, text: str | None, note: str) -> None:
        """Attach py-spy's native stacks (or why there are none) to the episode's evidence.

        Counted in the bytes held (``budget`` when they do not fit); left out when the rank's
        episode has moved on.
        """
        ev = state.hang
        if ev is None or ev.request_id != request_id:
            return
        size = 0 if text is None else len(text.encode())
        if text is not None and not self._room_for(size):
            self.dropped["budget"] += 1
            text, note = None, "native stacks: over hang_evidence_max_bytes"
        ev.native = text
        if note:
            ev.note = f"{ev.note}; {note}" if ev.note else note
        if size:
            ev.size += size
            self.bytes += size
            self._held[state.key] = state

    def forget(self, state: RankState) -> None:
        """Drop ``state``'s evidence (a new episode, eviction, or the rank expired)."""
        if self._held.pop(state.key, None) is not None and state.hang is not None:
            self.bytes -= state.hang.size
        self._waiting.pop(state.key, None)
        state.hang = None

    def _room_for(self, size: int) -> bool:
        """Make room for ``size`` bytes, evicting the evidence of ranks no longer hung."""
        if self.bytes + size <= self.evidence_max_bytes:
            return True
        for s in list(self._held.values()):
            if self.bytes + size <= self.evidence_max_bytes:
                break
            if not s.analytics.hung:
                self.forget(s)
                self.dropped["evicted"] += 1
        return self.bytes + size <= self.evidence_max_bytes
