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
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Deferred", "copy_async", "is_device_tensor"]


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


def _recorded_event(torch: Any, device: Any) -> Any:
    """An event recorded on ``device``'s current stream after the work queued so far.

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
    return Deferred(host, _recorded_event(torch, flat.device), apply)
