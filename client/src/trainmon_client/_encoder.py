"""Encoding and batching: the steps ``log()`` queued and the rare records in, packets out.

Pure: no socket, no clock, no thread, no counter of the run's. The run hands in what a STEP
header needs from outside (the clock offset, the overhead and the drop totals so far), takes
whole packets out (:meth:`Encoder.take_packets`) and adds what the encoder refused, which it
returns as counts, to its own totals. The encoder owns what only encoding needs:

- the name table: custom metric, operation and layer names interned to field ids, within
  :data:`MAX_CUSTOM_NAMES` and :data:`MAX_LAYER_NAMES`. A NAME record announces a name on the
  connection it is interned on; :meth:`Encoder.hello_packets` announces every name again
  after a (re)connect;
- the *plan* cache: the :class:`struct.Struct` and field ids of each distinct tuple of
  ``log()`` keyword names, so that encoding a step is one ``pack`` call;
- the cumulative STEP totals (steps, tokens, samples, the previous step's time, the
  ``data_time`` so far and the checkpoints saved) and the cumulative TRACK totals of each
  operation;
- the open packet: records are appended until the next one would take it past
  :data:`FLUSH_BYTES`; then it is closed and another opened. Each closed packet keeps its
  count of data records (what dropping it loses).

Not thread-safe: the run calls it under its lock. The bytes are a contract
(``tests/golden/client.packets.hex``); ``tests/client/test_encoder.py`` tests them with no
socket.
"""

from __future__ import annotations

import logging
import math
import operator
from collections import deque
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

from trainmon_client import _names as N
from trainmon_client import _protocol as P

__all__ = [
    "FLUSH_BYTES",
    "MAX_CUSTOM_NAMES",
    "MAX_LAYER_NAMES",
    "Encoder",
    "as_step",
    "carries_names",
]

log = logging.getLogger("trainmon_client")

FLUSH_BYTES = 48 * 1024
"""A packet is closed before it grows past this many bytes, well below ``MAX_PACKET_BYTES``."""
MAX_CUSTOM_NAMES = 1024
"""Distinct custom metric and operation names one client interns; later ones are refused."""
MAX_LAYER_NAMES = 1024
"""Room kept for watched layers' names beyond the custom names."""
MAX_PLANS = 4096
"""Distinct key tuples whose plan is cached; beyond it a plan is built for each step."""


def carries_names(packet: bytes) -> bool:
    """Whether ``packet`` holds a NAME record: dropping it means announcing the names again.

    A packet of steps alone does not: re-announcing every name after each of them would add up
    to :data:`MAX_CUSTOM_NAMES` records to the next flush, the one a full socket buffer can
    least afford. A packet that cannot be read counts as carrying names.
    """
    try:
        return any(rtype == P.NAME for rtype, _ in P.iter_records(packet))
    except P.ProtocolError:
        return True


def as_step(step: Any) -> int | None:
    """A valid step number (0 to :data:`~trainmon_client._protocol.MAX_STEP`), or None.

    Accepts an int, a NumPy or tensor integer, or an integral float. Refuses strings (``'5'``)
    and booleans (``True``, NumPy and tensor booleans), which convert to numbers but are not
    step numbers.
    """
    if type(step) is int:
        return step if 0 <= step <= P.MAX_STEP else None
    if isinstance(step, (str, bytes, bytearray, bool)) or "bool" in str(
        getattr(step, "dtype", type(step).__name__)
    ):
        return None
    try:
        value = operator.index(step)
    except Exception:
        try:
            f = float(step)
        except Exception:
            return None
        if not f.is_integer():
            return None
        value = int(f)
    return value if 0 <= value <= P.MAX_STEP else None


class _Plan(NamedTuple):
    """How one tuple of ``log()`` keyword names is encoded; built once per distinct tuple."""

    struct_pack: Callable[..., bytes]
    payload_length: int
    ids: tuple[int, ...]
    value_index: tuple[int, ...] | None  # None: every key is a field, in order
    tokens_index: int  # -1 when absent
    samples_index: int
    batch_index: int
    seq_index: int
    refused: int  # keys dropped at every call (bad name, over the name cap)
    data_index: int = -1  # data_time's position: its running total is appended


class Encoder:
    """The run's encoder: names, plans, cumulative totals and the packets being filled.

    Args:
        connected: whether a connection is up now. A name interned while one is announces
            itself with a NAME record in the open packet; otherwise the next HELLO carries it.
        max_custom_names: custom metric and operation names interned at most.
        max_layer_names: layer names interned at most (a separate allowance).

    Example:
        >>> from collections import deque
        >>> enc = Encoder(lambda: True)
        >>> queue = deque([(1, 10.0, {"loss": 2.5, "my_signal": 0.5, "tokens": 64})])
        >>> enc.add_steps(queue, (), 1_700_000_000.0, 0.0, 0, 0, 0)
        (0, 0)
        >>> [(len(packet), records) for packet, records in enc.take_packets()]
        [(121, 1)]
    """

    def __init__(
        self,
        connected: Callable[[], bool],
        *,
        max_custom_names: int = MAX_CUSTOM_NAMES,
        max_layer_names: int = MAX_LAYER_NAMES,
    ) -> None:
        self._connected = connected
        self.max_custom_names = max_custom_names
        self.max_layer_names = max_layer_names
        self._header = P.packet_header()
        self._buf = bytearray(self._header)
        self._buf_records = 0
        self._buf_data = 0  # data records (not NAME/HELLO/FINISH) in _buf: what a drop loses
        self._full: list[tuple[bytes, int]] = []  # closed packets and their data records
        self._plans: dict[tuple[str, ...], _Plan] = {}
        self._names: dict[str, int] = {}
        self._n_custom_names = 0
        self._n_layer_names = 0
        self._ops: dict[int, list[float]] = {}  # TRACK name id -> [seconds_total, count]
        self.steps = 0
        """Steps encoded so far (``steps_total`` of the last STEP record)."""
        self.tokens = 0.0
        """Cumulative tokens (``tokens_total``)."""
        self.samples = 0.0
        """Cumulative samples (``samples_total``)."""
        self.data_time = 0.0
        """Cumulative ``data_time`` of the steps encoded (``data_time_total``)."""
        self._checkpoint: tuple[float, float] | None = None  # (last saved step, seconds so far)
        self._plans_saved: dict[tuple[str, ...], _Plan] = {}  # plans once a save was reported
        self._prev_t = math.nan

    # ------------------------------------------------------------------------- names

    @property
    def names(self) -> dict[str, int]:
        """Every name interned so far and its field id (a copy)."""
        return dict(self._names)

    def intern(self, name: str, layer: bool = False) -> int:
        """Field id for a custom name, or 0 when it is refused (bad name or over its cap).

        The caller counts refusals (per call, through the plan).
        """
        field_id = self._names.get(name)
        if field_id is not None:
            return field_id
        if layer:
            if not N.valid_name(name) or self._n_layer_names >= self.max_layer_names:
                return 0
            self._n_layer_names += 1
        else:
            if not N.valid_metric_name(name) or self._n_custom_names >= self.max_custom_names:
                return 0
            self._n_custom_names += 1
        field_id = P.FIRST_CUSTOM_ID + len(self._names)
        self._names[name] = field_id
        if self._connected():  # otherwise the next connect sends it after HELLO
            self.add(P.encode_name(field_id, name))
        return field_id

    def add_names(self) -> None:
        """Announce every name again in the open packet (one that carried them was dropped)."""
        for name, field_id in self._names.items():
            self.add(P.encode_name(field_id, name))

    def hello_packets(self, hello: dict[str, Any]) -> list[bytes]:
        """The packets that open a connection: HELLO (``hello``: its fields), then every NAME."""
        packets = []
        current = bytearray(self._header) + P.encode_hello(hello)
        for name, field_id in self._names.items():
            record = P.encode_name(field_id, name)
            if len(current) + len(record) > FLUSH_BYTES:
                packets.append(bytes(current))
                current = bytearray(self._header)
            current += record
        packets.append(bytes(current))
        return packets

    # ------------------------------------------------------------------------- packets

    def add(self, record: bytes, data: bool = False) -> None:
        """Append one encoded record to the open packet (``data``: a record the totals count)."""
        if len(self._buf) + len(record) > FLUSH_BYTES:
            self._full.append((bytes(self._buf), self._buf_data))
            self._buf = bytearray(self._header)
            self._buf_records = 0
            self._buf_data = 0
        self._buf += record
        self._buf_records += 1
        self._buf_data += data

    def take_packets(self) -> list[tuple[bytes, int]]:
        """Close the open packet; return every packet and its data-record count, oldest first."""
        packets = self._full
        self._full = []
        if self._buf_records:
            packets.append((bytes(self._buf), self._buf_data))
        self._buf = bytearray(self._header)
        self._buf_records = 0
        self._buf_data = 0
        return packets

    # ------------------------------------------------------------------------- records

    def checkpointed(self, step: int, seconds: float) -> None:
        """A checkpoint of ``step`` was saved in ``seconds`` (NaN: unknown).

        Every later STEP carries the last saved step and the saves' seconds so far
        (``checkpoint_step``, ``checkpoint_time_total``).
        """
        total = self._checkpoint[1] if self._checkpoint is not None else 0.0
        if math.isfinite(seconds) and seconds > 0:
            total += seconds
        last = self._checkpoint[0] if self._checkpoint is not None else -1.0
        self._checkpoint = (float(max(step, last)), total)

    def add_steps(
        self,
        pending: deque[tuple[Any, float, dict[str, Any]]],
        held: Collection[int],
        to_wall: float,
        overhead: float,
        dropped_disconnected: int,
        dropped_backpressure: int,
        refused: int,
    ) -> tuple[int, int]:
        """Encode the steps ``log()`` queued into the open packet, taking them off ``pending``.

        Stops before the first step whose metrics dict is in ``held`` (its device values are
        still being copied): steps are sent in order, so it and the later ones stay queued.

        Args:
            pending: the queue of ``(step, perf_counter at the call, metrics)``.
            held: ``id()`` of the metrics dicts still waiting for device copies.
            to_wall: add to a ``perf_counter`` reading to get Unix time.
            overhead: ``overhead_seconds_total`` of these steps.
            dropped_disconnected: ``dropped_disconnected_total`` of these steps.
            dropped_backpressure: ``dropped_backpressure_total`` of these steps.
            refused: the run's refused values so far; each step carries it plus what this
                call refused up to and including that step.

        Returns:
            ``(values or steps refused, steps that could not be encoded)`` by this call.
        """
        total_refused = refused
        encode_errors = 0
        while pending:
            if held and id(pending[0][2]) in held:
                break
            step, t0, metrics = pending.popleft()
            if type(step) is not int or not 0 <= step <= P.MAX_STEP:
                step = as_step(step)  # NumPy / tensor integers, integral floats, or None
                if step is None:
                    total_refused += 1
                    continue
            keys = tuple(metrics)
            saved = self._checkpoint
            plan = (self._plans if saved is None else self._plans_saved).get(keys)
            if plan is None:
                plan = self._plan(keys, saved is not None)
            vals = list(metrics.values())
            tokens, samples, data = self.tokens, self.samples, self.data_time
            step_refused = plan.refused
            try:
                if plan.tokens_index >= 0:
                    add = vals[plan.tokens_index]
                elif plan.batch_index >= 0 and plan.seq_index >= 0:
                    add = vals[plan.batch_index] * vals[plan.seq_index]
                else:
                    add = 0
                if 0 <= add < math.inf:  # NaN, negative or infinite: never into the total
                    tokens += add
                else:
                    step_refused += 1
                if plan.samples_index >= 0:
                    add = vals[plan.samples_index]
                elif plan.batch_index >= 0:
                    add = vals[plan.batch_index]
                else:
                    add = 0
                if 0 <= add < math.inf:
                    samples += add
                else:
                    step_refused += 1
                fields = vals if plan.value_index is None else [vals[i] for i in plan.value_index]
                if plan.data_index >= 0:
                    add = vals[plan.data_index]
                    if 0 <= add < math.inf:
                        data += add
                    fields.append(data)
                if saved is not None:
                    fields += saved
                record = plan.struct_pack(
                    P.STEP,
                    plan.payload_length,
                    step,
                    self.steps + 1,
                    t0 + to_wall,
                    t0 - self._prev_t,
                    tokens,
                    samples,
                    overhead,
                    dropped_disconnected,
                    dropped_backpressure,
                    total_refused + step_refused,
                    *plan.ids,
                    *fields,
                )
            except Exception:  # e.g. an int beyond a float's range: this step only
                encode_errors += 1
                log.debug("trainmon_client: a step could not be encoded", exc_info=True)
                continue
            self.tokens, self.samples, self.data_time = tokens, samples, data
            total_refused += step_refused
            self.steps += 1
            self._prev_t = t0
            self.add(record, data=True)
        return total_refused - refused, encode_errors

    def eval_record(
        self, step: Any, when: float, values: dict[str, Any]
    ) -> tuple[bytes | None, int]:
        """An EVAL record of ``values`` (floats) for ``step`` at ``when`` (Unix seconds).

        Returns:
            ``(record, values refused)``; the record is None when the step is refused (then
            counted in the refusals).
        """
        ids: list[int] = []
        vals: list[float] = []
        refused = 0
        for key, value in values.items():
            field_id = P.STANDARD_FIELDS.get(key) or self.intern(key)
            if field_id:
                ids.append(field_id)
                vals.append(value)
            else:
                refused += 1
        s = as_step(step)
        if s is None:
            return None, refused + 1
        return P.encode_fields(P.EVAL, P.EVAL_HEADER.pack(s, when), ids, vals), refused

    def track_started(self, field_id: int) -> bytes:
        """The TRACK record of an operation (its interned name's id) that starts now."""
        totals = self._ops.setdefault(field_id, [0.0, 0])
        return P.encode_track(field_id, True, totals[0], int(totals[1]))

    def track_stopped(self, field_id: int, seconds: float) -> bytes:
        """The TRACK record of an operation that ran ``seconds`` and has stopped."""
        totals = self._ops[field_id]
        totals[0] += seconds
        totals[1] += 1
        return P.encode_track(field_id, False, totals[0], int(totals[1]))

    def layer_ids(
        self, names: list[str], codes: list[int], values: list[float]
    ) -> tuple[list[int], list[float], int]:
        """Intern a LAYERS table's layer names; drop the rows of the names refused.

        Args:
            names: one name per row.
            codes: the stat codes (columns).
            values: the row-major ``len(names) x len(codes)`` table.

        Returns:
            ``(layer ids, values of the rows kept, layers refused)``.
        """
        ids = [self.intern(n, layer=True) for n in names]
        if all(ids):
            return ids, values, 0
        keep = [r for r, i in enumerate(ids) if i]
        k = len(codes)
        kept = [v for row in keep for v in values[row * k : (row + 1) * k]]
        return [ids[r] for r in keep], kept, len(ids) - len(keep)

    # ------------------------------------------------------------------------- plans

    def _plan(self, keys: tuple[str, ...], saved: bool = False) -> _Plan:
        """Build (and cache) the encoding of one key tuple; interns new custom names.

        The cumulative fields follow the caller's: ``data_time_total`` when ``data_time`` is
        among the keys, ``checkpoint_step`` and ``checkpoint_time_total`` once a save was
        reported (``saved``).
        """
        ids: list[int] = []
        index: list[int] = []
        refused = 0
        special = {"tokens": -1, "samples": -1, "batch_size": -1, "seq_len": -1}
        for i, key in enumerate(keys):
            if key in ("tokens", "samples"):
                special[key] = i
                continue
            if key in ("batch_size", "seq_len"):
                special[key] = i
            field_id = P.STANDARD_FIELDS.get(key) or self.intern(key)
            if field_id:
                ids.append(field_id)
                index.append(i)
            else:
                refused += 1
        all_fields = len(index) == len(keys)
        data_index = -1
        if "data_time" in keys and "data_time_total" not in keys:
            data_index = keys.index("data_time")
            ids.append(P.FIELD_DATA_TIME_TOTAL)
            all_fields = False  # the fields are a list the cumulative ones are appended to
        if saved and "checkpoint_step" not in keys and "checkpoint_time_total" not in keys:
            ids += (P.FIELD_CHECKPOINT_STEP, P.FIELD_CHECKPOINT_TIME_TOTAL)
            all_fields = False
        s = P.step_struct(len(ids))
        plan = _Plan(
            struct_pack=s.pack,
            payload_length=P.step_payload_length(len(ids)),
            ids=tuple(ids),
            value_index=None if all_fields else tuple(index),
            tokens_index=special["tokens"],
            samples_index=special["samples"],
            batch_index=special["batch_size"],
            seq_index=special["seq_len"],
            refused=refused,
            data_index=data_index,
        )
        plans = self._plans_saved if saved else self._plans
        if len(plans) < MAX_PLANS:
            plans[keys] = plan
        return plan
