"""Device tensors without host-device synchronisation: an asynchronous copy and an event.

``float(cuda_tensor)`` (or ``.item()``) waits for every kernel queued before it, so a training
loop that logs ``loss`` as a CUDA tensor would stall its CPU once per step and lose the overlap
of host and device. Instead, :meth:`trainmon_client.Run.log` and the watcher hand device
tensors to :func:`copy_async`:

1. each value is converted to float64 *on the device* and stacked into one vector (kernel
   launches: asynchronous);
2. the vector is copied into page-locked ("pinned") host memory with ``non_blocking=True``
   (``cudaMemcpyAsync``, asynchronous because the destination is pinned);
3. a ``torch.cuda.Event`` is recorded on the device's current stream after the copy.

The values are read later, only once ``event.query()`` (``cudaEventQuery``: a poll that never
waits) says the copy is done: at the next ``log()`` or flush. Only ``finish()`` waits
(``event.synchronize()``), off the training loop's path. Copies run in stream order, so the
value recorded is the tensor's value at the ``log()`` call even if the loop changes the tensor
in place afterwards.

Nothing here imports torch: the tensor's own module is used (``sys.modules["torch"]``), so the
client keeps no dependency on torch.

:class:`DeviceCopies` is the run's side of this: it converts the values ``log()``, ``eval()`` and
``checkpoint()`` are given (:meth:`DeviceCopies.snapshot`), keeps the copies in flight in order,
holds back the steps they belong to, and applies the values that have landed
(:meth:`DeviceCopies.resolve`). It counts what it refuses through a :class:`Tally` (the run).
The torch probes the run needs at a flush (:func:`torch_gpu_uuid`, :func:`add_allocator_stats`)
live here too: the one place that knows torch.
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = [
    "MAX_WAITING",
    "REFUSED",
    "Deferred",
    "DeviceCopies",
    "Tally",
    "add_allocator_stats",
    "copy_async",
    "is_device_tensor",
    "recorded_event",
    "torch_gpu_uuid",
]

log = logging.getLogger("trainmon_client")

MAX_WAITING = 1024
"""Device-to-host copies in flight at most; beyond it a CUDA tensor is read with ``float()``."""
REFUSED: Any = object()
"""What :meth:`DeviceCopies.coerce` returns for a value it refused (and counted)."""
_PLAIN = frozenset({float, int})


def is_device_tensor(value: Any) -> bool:
    """True for a torch tensor on a CUDA device (``tensor.is_cuda``); False for anything else.

    Other accelerators (MPS, XLA) are converted with ``float()``, which may synchronise.
    """
    return getattr(value, "is_cuda", False) is True


class _Completed:
    """The event of a copy that was synchronous (a tensor not on a CUDA device)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def recorded_event(torch: Any, device: Any) -> Any:
    """An event recorded on ``device``'s current stream after the work queued so far.

    Tests without a GPU replace this function with one whose event they complete by hand.
    ``torch.cuda.Event()`` (``cudaEventCreateWithFlags(cudaEventDisableTiming)``) and
    ``record`` (``cudaEventRecord``); on other devices the copy already happened.
    """
    if device.type != "cuda":
        return _Completed()
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class Deferred:
    """Values of device tensors on their way to host memory.

    Attributes:
        host: float64 host tensor of shape ``[n]`` (pinned when CUDA is available) that the
            copy writes into; read only after :meth:`ready`.
        event: recorded after the copy; ``query()`` polls it, ``synchronize()`` waits for it.
        apply: called once with the ``n`` values (a list of floats) when they have arrived,
            or with None when reading them failed.
        owner: what the values belong to (the client's pending step), or None.
    """

    __slots__ = ("apply", "event", "host", "owner")

    def __init__(self, host: Any, event: Any, apply: Callable[[list[float] | None], None]) -> None:
        self.host = host
        self.event = event
        self.apply = apply
        self.owner: Any = None

    def ready(self) -> bool:
        """Whether the copy is complete (``cudaEventQuery``; never waits)."""
        return bool(self.event.query())

    def wait(self) -> None:
        """Block until the copy is complete (``cudaEventSynchronize``). Not for the hot path."""
        self.event.synchronize()

    def values(self) -> list[float]:
        """The copied values, in the order given to :func:`copy_async` (host memory read)."""
        return [float(v) for v in self.host.tolist()]


def copy_async(
    tensors: Sequence[Any], apply: Callable[[list[float] | None], None], flatten: bool = False
) -> Deferred:
    """Start copying ``tensors`` to host memory; return the :class:`Deferred` that tracks it.

    Args:
        tensors: one-element device tensors (any dtype), or with ``flatten=True`` one tensor of
            any shape whose elements are copied in row-major order.
        apply: called with the values once they are on the host.
        flatten: copy the elements of ``tensors[0]`` instead of one value per tensor.

    Raises:
        RuntimeError, ValueError: a tensor with more than one element (without ``flatten``),
            or a failing CUDA call; the caller counts it.
    """
    torch = sys.modules["torch"]
    with torch.no_grad():
        if flatten:
            flat = tensors[0].detach().reshape(-1).to(torch.float64)
        else:
            device = tensors[0].device
            flat = torch.stack(
                [
                    t.detach().reshape(()).to(device=device, dtype=torch.float64, non_blocking=True)
                    for t in tensors
                ]
            )
        host = torch.empty(
            flat.shape, dtype=torch.float64, pin_memory=bool(torch.cuda.is_available())
        )
        host.copy_(flat, non_blocking=True)
    return Deferred(host, recorded_event(torch, flat.device), apply)


class Tally(Protocol):
    """Where the parts of a run count what they refuse or fail at (the run implements it)."""

    def count_refused(self, n: int = 1) -> None:
        """Count ``n`` values (or whole records) refused for a bad name, type or step."""

    def count_internal_error(self) -> None:
        """Count one failure inside trainmon itself, swallowed so that training goes on."""


class DeviceCopies:
    """The copies in flight of one run, oldest first, and the pending steps they hold back.

    Not thread-safe: the run calls it under its lock. The run keeps a reference to
    :attr:`waiting` for the one check on ``log()``'s hot path (``if run._waiting``).

    Attributes:
        waiting: the :class:`Deferred` copies in flight, oldest first.
        owners: ``id()`` of each pending step's metrics dict that copies will fill, and how
            many; the encoder holds those steps (and every later one) back.
    """

    def __init__(self, tally: Tally) -> None:
        self._tally = tally
        self.waiting: deque[Deferred] = deque()
        self.owners: dict[int, int] = {}

    def has_room(self, value: Any) -> bool:
        """Whether ``value`` is a CUDA tensor to copy asynchronously (room permitting)."""
        return is_device_tensor(value) and len(self.waiting) < MAX_WAITING

    def snapshot(self, metrics: dict[str, Any], defer: bool = True) -> dict[str, Any]:
        """Convert every value that is not a plain float/int now (tensors may change later).

        With ``defer``, CUDA tensors are not read: they hold a 0.0 placeholder and an
        asynchronous copy fills them in (:meth:`resolve`) before the step is encoded.
        Values that are refused are left out and counted.
        """
        out: dict[str, Any] = {}
        keys: list[str] = []
        tensors: list[Any] = []
        for k, v in metrics.items():
            if v.__class__ in _PLAIN:
                out[k] = v
            elif defer and is_device_tensor(v) and len(self.waiting) < MAX_WAITING:
                out[k] = 0.0
                keys.append(k)
                tensors.append(v)
            else:
                f = self.coerce(v)
                if f is not REFUSED:
                    out[k] = f
        if keys:
            try:
                self.defer(tensors, self._filler(out, keys), owner=out)
            except Exception:  # e.g. a tensor of several elements
                log.debug("trainmon_client: device copy failed", exc_info=True)
                for k in keys:
                    del out[k]
                self._tally.count_refused(len(keys))
        return out

    def _filler(self, out: dict[str, Any], keys: list[str]) -> Callable[[list[float] | None], None]:
        def apply(values: list[float] | None) -> None:
            if values is None:
                for k in keys:
                    out.pop(k, None)
                self._tally.count_refused(len(keys))
                return
            out.update(dict(zip(keys, values)))  # noqa: B905 (Python 3.9: no strict=)

        return apply

    def defer(
        self,
        tensors: list[Any],
        apply: Callable[[list[float] | None], None],
        owner: dict[str, Any] | None = None,
        flatten: bool = False,
    ) -> None:
        """Start an asynchronous device-to-host copy; ``apply`` gets the values when it lands.

        ``owner``: the pending step's metrics dict the copy fills; the step (and every later
        one) is held back from encoding until then.
        """
        deferred = copy_async(tensors, apply, flatten=flatten)
        deferred.owner = owner
        self.waiting.append(deferred)
        if owner is not None:
            key = id(owner)
            self.owners[key] = self.owners.get(key, 0) + 1

    def resolve(self, block: bool) -> bool:
        """Apply the device copies that have landed, oldest first; True if one is not finite.

        Polls with ``cudaEventQuery`` and stops at the first copy still in flight, unless
        ``block`` (``finish()`` only), which waits for each. A failed copy drops its values
        and counts them as refused.
        """
        urgent = False
        waiting = self.waiting
        while waiting:
            deferred = waiting[0]
            values: list[float] | None
            try:
                if not deferred.ready():
                    if not block:
                        break
                    deferred.wait()
                values = deferred.values()
            except Exception:
                self._tally.count_internal_error()
                log.debug("trainmon_client: reading a device copy failed", exc_info=True)
                values = None
            waiting.popleft()
            owner = deferred.owner
            if owner is not None:
                key = id(owner)
                left = self.owners[key] - 1
                if left:
                    self.owners[key] = left
                else:
                    del self.owners[key]
            if values is not None and any(v - v != 0.0 for v in values):
                urgent = True
            deferred.apply(values)
        return urgent

    def coerce(self, v: Any) -> Any:
        """Convert a scalar that is not a float or int; count and return :data:`REFUSED` if bad."""
        if isinstance(v, (str, bytes)):
            self._tally.count_refused()
            return REFUSED
        try:
            # NumPy scalars, 0-d torch tensors, Decimal, Fraction, bool. A CUDA tensor is
            # copied here, which synchronises with the device (see docs/client.md).
            return float(v)
        except Exception:
            self._tally.count_refused()
            return REFUSED


# ----------------------------------------------------------------------------- torch probes

_ALLOCATOR_STATS = (
    ("mem_allocated", "allocated_bytes.all.current"),
    ("mem_reserved", "reserved_bytes.all.current"),
    ("mem_peak", "allocated_bytes.all.peak"),
    ("alloc_retries", "num_alloc_retries"),
    ("ooms", "num_ooms"),
)


def add_allocator_stats(metrics: dict[str, Any]) -> None:
    """Add ``torch.cuda.memory_stats()`` figures to one step's metrics (user values win).

    Host-side counters of the caching allocator: no device synchronisation. Nothing happens
    unless torch is imported and CUDA initialised.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        if not torch.cuda.is_initialized():
            return
        stats = torch.cuda.memory_stats()
    except Exception:
        return
    for key, stat in _ALLOCATOR_STATS:
        if key not in metrics and stat in stats:
            metrics[key] = stats[stat]


def torch_gpu_uuid(local_rank: int) -> str | None:
    """The current CUDA device's UUID, only if torch is already imported and CUDA initialised.

    Uses ``torch.cuda.get_device_properties(i).uuid``, which names the physical GPU whatever
    ``CUDA_VISIBLE_DEVICES`` does, formatted like NVML's ``nvmlDeviceGetUUID`` (``GPU-…``).
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    except Exception:
        return None
