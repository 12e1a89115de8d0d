"""The asynchronous device-tensor path of log() and watch(), on the CPU.

There is no GPU here, so CPU tensors stand in for CUDA tensors: ``is_device_tensor`` is made to
say yes for tensors the test marks, and the CUDA event is replaced by one the test completes
by hand. Everything else is the real code path: the stack and the float64 conversion, the
copy into the host buffer, the queue of copies in flight, holding steps back until their
values land, the NaN that must still be sent at once, and finish() waiting for the last copy.
Reading a marked tensor on the host (``float()``, ``.item()``, ``.tolist()``, ``.cpu()``)
raises, as ``torch.cuda.set_sync_debug_mode("error")`` does on a GPU.
The same code runs on a real GPU in tests/gpu/test_cuda_sync.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

torch = pytest.importorskip("torch")

from trainmon_client import _device  # noqa: E402
from trainmon_client import _protocol as P  # noqa: E402
from trainmon_client._watch import Watcher  # noqa: E402

from ..helpers.client import (  # noqa: E402
    Listener,
    layer_records,
    make_run,
    steps_of,
    table,
    tiny,
    train_step,
)


class FakeEvent:
    """Stands in for ``torch.cuda.Event``: the test decides when the copy has landed."""

    made: ClassVar[list[FakeEvent]] = []

    def __init__(self) -> None:
        self.done = False
        self.recorded = False
        self.waited = False
        self.seen_done = False  # query() said the copy had landed: the client took it
        FakeEvent.made.append(self)

    def record(self) -> None:
        self.recorded = True

    def query(self) -> bool:
        self.seen_done |= self.done
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


class DeviceScalar(torch.Tensor):
    """A CPU tensor playing a CUDA one: reading it on the host is a synchronisation."""

    reads = 0

    def _sync(self, *_: Any) -> Any:
        DeviceScalar.reads += 1
        raise RuntimeError("host read of a device tensor (a synchronisation)")

    __float__ = __int__ = item = tolist = cpu = numpy = _sync  # type: ignore[assignment]


def on_device(t: Any) -> Any:
    """Mark ``t`` as living on the device."""
    return t.as_subclass(DeviceScalar)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[FakeEvent]]:
    FakeEvent.made = []
    DeviceScalar.reads = 0

    def is_device(v: Any) -> bool:
        return isinstance(v, DeviceScalar)

    def copy_async(tensors: Any, apply: Any, flatten: bool = False) -> Any:
        # The real copy_async on plain views of the marked tensors (torch ops on a subclass
        # would return the subclass, whose host reads raise).
        plain = [t.as_subclass(torch.Tensor) for t in tensors]
        return real_copy_async(plain, apply, flatten)

    def recorded_event(torch: Any, device: Any) -> FakeEvent:
        event = FakeEvent()
        event.record()
        return event

    real_copy_async = _device.copy_async
    monkeypatch.setattr(_device, "is_device_tensor", is_device)
    monkeypatch.setattr(_device, "copy_async", copy_async)
    monkeypatch.setattr(_device, "recorded_event", recorded_event)
    yield FakeEvent.made
    assert DeviceScalar.reads == 0, "a device tensor was read on the host"


def connected(listener: Listener, **kw: Any) -> Any:
    run = make_run(listener.path, **kw)
    run.log(0, loss=1.0)  # the first log() connects and sends at once
    listener.accept()
    listener.packets(0.05)
    return run


def values_of(step_record: Any) -> dict[int, float]:
    _, ids, values = step_record
    return dict(zip(ids, values, strict=True))


def test_device_values_are_never_read_in_log_and_arrive_in_order(
    fake_cuda: list[FakeEvent], listener: Listener
) -> None:
    run = connected(listener, flush_interval=0.0)
    loss = on_device(torch.tensor(2.5, dtype=torch.bfloat16))
    run.log(1, loss=loss, grad_norm=on_device(torch.tensor([0.75])), lr=1e-3)
    run.log(2, loss=on_device(torch.tensor(2.25)), lr=1e-3)
    assert len(fake_cuda) == 2 and all(e.recorded for e in fake_cuda)
    assert steps_of(listener.records(0.1)) == []  # held back: the copies have not landed
    fake_cuda[0].done = True
    run.log(3, loss=2.0, lr=1e-3)  # step 2 still waits, and holds step 3 behind it
    steps = steps_of(listener.records(0.2))
    assert [h.step for h, _, _ in steps] == [1]
    assert values_of(steps[0]) == {1: 2.5, 3: 0.75, 2: 1e-3}
    fake_cuda[1].done = True
    run.log(4, loss=1.75, lr=1e-3)
    steps = steps_of(listener.records(0.2))
    assert [h.step for h, _, _ in steps] == [2, 3, 4]
    assert values_of(steps[0])[1] == 2.25
    assert [h.steps_total for h, _, _ in steps] == [3, 4, 5]
    assert not any(e.waited for e in fake_cuda)  # nothing in log() waited for the device
    run.finish()


def test_the_value_is_the_one_at_the_log_call(
    fake_cuda: list[FakeEvent], listener: Listener
) -> None:
    run = connected(listener, flush_interval=0.0)
    acc = torch.tensor(1.0)
    run.log(1, loss=on_device(acc))
    acc += 5.0  # the loop keeps accumulating in place after log()
    fake_cuda[0].done = True
    run.log(2, loss=on_device(acc))
    fake_cuda[1].done = True
    run.finish()
    steps = steps_of(listener.records(0.2))
    assert [values_of(s)[1] for s in steps] == [1.0, 6.0]


def test_a_device_nan_is_sent_as_soon_as_it_lands(
    fake_cuda: list[FakeEvent], listener: Listener
) -> None:
    run = connected(listener, flush_interval=60.0)
    run.log(1, loss=on_device(torch.tensor(math.nan)))
    run.log(2, loss=1.0)
    assert steps_of(listener.records(0.1)) == []
    fake_cuda[0].done = True
    run.log(3, loss=1.0)  # the next call sees the NaN land and flushes at once
    steps = steps_of(listener.records(0.3))
    assert [h.step for h, _, _ in steps] == [1, 2, 3]
    assert math.isnan(values_of(steps[0])[1])
    run.finish()


def test_finish_waits_for_copies_in_flight(fake_cuda: list[FakeEvent], listener: Listener) -> None:
    run = connected(listener, flush_interval=0.0)
    for i in range(1, 4):
        run.log(i, loss=on_device(torch.tensor(float(i))))
    run.finish()
    assert all(e.waited for e in fake_cuda)
    recs = listener.records(0.2)
    assert [values_of(s)[1] for s in steps_of(recs)] == [1.0, 2.0, 3.0]
    assert recs[-1][0] == P.FINISH
    assert run.refused == 0 and run.internal_errors == 0


def test_bad_device_values_are_refused_and_counted(
    fake_cuda: list[FakeEvent], listener: Listener
) -> None:
    run = connected(listener, flush_interval=0.0)
    run.log(1, loss=on_device(torch.ones(3)), lr=0.1)  # not a scalar: refused, step kept
    run.log(2, loss=on_device(torch.tensor(1.0)))
    fake_cuda[-1].synchronize()
    run.finish()
    steps = steps_of(listener.records(0.2))
    assert [(h.step, values_of(s)) for s in steps for h in [s[0]]] == [
        (1, {2: 0.1}),
        (2, {1: 1.0}),
    ]
    assert run.refused == 1


def test_too_many_copies_in_flight_fall_back_to_a_read(
    fake_cuda: list[FakeEvent], listener: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_device, "MAX_WAITING", 2)
    run = connected(listener, flush_interval=0.0)
    run.log(1, loss=on_device(torch.tensor(1.0)))
    run.log(2, loss=on_device(torch.tensor(2.0)))
    run.log(3, loss=on_device(torch.tensor(3.0)))  # the third is read at once: counted read
    assert len(fake_cuda) == 2
    assert DeviceScalar.reads == 1
    DeviceScalar.reads = 0  # the one read expected; its failure is counted as refused
    assert run.refused == 1
    run.finish()


def test_watch_sends_its_table_without_reading_the_device(
    fake_cuda: list[FakeEvent], listener: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = tiny()
    run = connected(listener, flush_interval=0.0)
    watcher = run.watch(model, opt, every=1, quantiles_every=1, budget=1.0)
    assert isinstance(watcher, Watcher) and watcher.sink is run
    watcher.sink = DeviceTables(run)
    train_step(model, opt)
    run.log(1, loss=1.0)
    assert len(fake_cuda) == 1 and layer_records(listener) == []  # in flight
    fake_cuda[0].done = True
    run.log(2, loss=1.0)
    recs = layer_records(listener)
    assert len(recs) == 1
    row = table(recs[0])["2"]
    g = torch.cat([p.grad.reshape(-1) for p in model[2].parameters()])  # the layer's gradient
    qs = [row[P.QUANTILE_CODE0 + i] for i in range(len(P.LAYER_QUANTILES))]
    expected = torch.quantile(g.float(), torch.tensor(P.LAYER_QUANTILES))
    assert qs == pytest.approx(expected.tolist(), rel=1e-5, abs=1e-9)
    run.finish()


class DeviceTables:
    """The run as the watcher's sink (``LayerSink``), each table marked as on the device."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def send_layer_table(self, step: int, names: Any, codes: Any, tbl: Any, *rest: Any) -> None:
        self.run.send_layer_table(step, names, codes, on_device(tbl), *rest)

    def count_refused(self, n: int = 1) -> None:
        self.run.count_refused(n)

    def count_internal_error(self) -> None:
        self.run.count_internal_error()


def test_copy_async_on_the_cpu_converts_and_flattens() -> None:
    got: list[Any] = []
    d = _device.copy_async(
        [torch.tensor(1.5, dtype=torch.bfloat16), torch.tensor([7], dtype=torch.int64)],
        got.append,
    )
    assert d.host.dtype == torch.float64 and d.host.shape == (2,)
    d.wait()
    assert d.ready() and d.values() == [1.5, 7.0]
    d2 = _device.copy_async([torch.arange(6.0).reshape(2, 3)], got.append, flatten=True)
    d2.wait()
    assert d2.values() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert not _device.is_device_tensor(torch.tensor(1.0))
    assert not _device.is_device_tensor(1.0)


def test_copies_in_flight_stay_bounded(fake_cuda: list[FakeEvent], listener: Listener) -> None:
    # Not a timing assertion: the copies in flight stay bounded when the device keeps up,
    # because every log() applies the copies that have landed, flush or not.
    run = connected(listener, flush_interval=60.0)
    for i in range(1, 200):
        run.log(i, loss=on_device(torch.tensor(float(i))))
        fake_cuda[-1].done = True
    # Every copy but the newest was found landed (and so applied) before finish().
    assert all(e.seen_done for e in fake_cuda[:-1])
    t = time.perf_counter()
    run.finish()
    assert time.perf_counter() - t < 5
    assert len(steps_of(listener.records(0.3))) == 199
