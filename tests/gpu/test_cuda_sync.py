"""On a real CUDA GPU: log() and watch() given CUDA tensors never synchronise the caller.

``torch.cuda.set_sync_debug_mode("error")`` makes every synchronising CUDA call in PyTorch
raise (``.item()``, ``float()``, a copy to pageable host memory, ``torch.quantile``'s check,
``nonzero``...). The training loop below is itself sync-free, so any error comes from
trainmon. The values that arrive must be the ones the loop computed. Skipped without CUDA; run
on a machine with one (docs/gpu-validation.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from trainmon_client import _protocol as P  # noqa: E402

from ..conftest import short_tmpdir  # noqa: E402
from ..helpers.client import Listener, layer_records, make_run, steps_of, table  # noqa: E402


@pytest.fixture
def listener() -> Iterator[Listener]:
    lst = Listener(short_tmpdir() / "t.sock")
    yield lst
    lst.close()


# PyTorch warns that the sync debug mode is a prototype each time it is switched on.
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype:UserWarning")
def test_log_and_watch_with_cuda_tensors_never_synchronise(listener: Listener) -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)
    ).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    run = make_run(listener.path, flush_interval=0.0)
    run.log(0, loss=1.0)  # connect before the loop
    listener.accept()
    run.watch(model, opt, every=2, quantiles_every=2, activations=True, budget=1.0)
    x = torch.randn(512, 64, device=dev)
    y = torch.randn(512, 1, device=dev)
    losses: list[Any] = []
    norms: list[Any] = []
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")  # inside: a raise still resets the mode
        for step in range(1, 41):
            loss = (model(x) - y).pow(2).mean()
            opt.zero_grad(set_to_none=False)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            opt.step()
            run.log(step, loss=loss, grad_norm=grad_norm, lr=0.01, tokens=512)
            losses.append(loss.detach().clone())
            norms.append(grad_norm.detach().clone())
        run.log(41, loss=loss * math.nan)  # a NaN on the device
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert run.internal_errors == 0 and run.refused == 0
    run.finish()  # waits for the last copies (off the loop)
    recs = listener.records(0.5)
    steps = {h.step: dict(zip(ids, vals, strict=True)) for h, ids, vals in steps_of(recs)}
    assert sorted(steps) == list(range(0, 42))
    for step in range(1, 41):
        assert steps[step][P.STANDARD_FIELDS["loss"]] == pytest.approx(losses[step - 1].item())
        assert steps[step][P.STANDARD_FIELDS["grad_norm"]] == pytest.approx(
            norms[step - 1].item(), rel=1e-6
        )
    assert math.isnan(steps[41][P.STANDARD_FIELDS["loss"]])


def test_watch_table_from_the_gpu_matches_the_cpu_formulas(listener: Listener) -> None:
    dev = torch.device("cuda")
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 1)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = make_run(listener.path, flush_interval=0.0)
    run.watch(model, opt, every=1, quantiles_every=1, budget=1.0)
    loss = model(torch.randn(64, 32, device=dev)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model[0].parameters()]).float().cpu()
    opt.step()
    run.log(1, loss=loss)
    listener.accept()
    run.finish()
    row = table(layer_records(listener)[0])["0"]
    qs = [row[P.QUANTILE_CODE0 + i] for i in range(len(P.LAYER_QUANTILES))]
    expected = torch.quantile(grads, torch.tensor(P.LAYER_QUANTILES)).tolist()
    assert qs == pytest.approx(expected, rel=1e-5, abs=1e-9)
    assert row[P.LAYER_STATS["grad_norm"]] == pytest.approx(grads.norm().item(), rel=1e-5)
