"""trainmon-run's hooks on PyTorch (``trainmon_client._autorun``), installed in this process.

Each test installs the hooks as ``trainmon-run``'s ``sitecustomize`` would, trains a tiny
model with plain PyTorch code on a real socket, and reads what the client sent. The fixture
puts every patched function back afterwards (``Instrumenter.uninstall``).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainmon_client import _autorun
from trainmon_client import _protocol as P
from trainmon_client._env import _process_start

from ..helpers.client import Listener, steps_of

torch = pytest.importorskip("torch")


@pytest.fixture
def hooks(listener: Listener, monkeypatch: pytest.MonkeyPatch) -> Iterator[_autorun.Instrumenter]:
    monkeypatch.setenv("TRAINMON_SOCKET", str(listener.path))
    monkeypatch.setenv("TRAINMON_RUN", "autorun")
    monkeypatch.setenv("TRAINMON_FLUSH_INTERVAL", "0")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    originals = (torch.save, torch.autograd.backward, torch.nn.utils.clip_grad_norm_)
    ins = _autorun.install({"TRAINMON_AUTORUN": "1"})
    assert ins is not None and _autorun.current() is ins
    yield ins
    if ins.run is not None:
        ins.run.finish()
    ins.uninstall()
    assert (torch.save, torch.autograd.backward, torch.nn.utils.clip_grad_norm_) == originals
    assert _autorun.current() is None


def sent(listener: Listener) -> list[tuple[int, Any]]:
    listener.accept()
    return listener.records()


def fields(step: P.Step) -> dict[int, float]:
    return dict(zip(step.ids, step.values, strict=True))


def model_and_data(seed: int = 0) -> tuple[Any, Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    x = torch.randn(64, 4)
    y = x.sum(1, keepdim=True)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    return model, loader, torch.nn.functional.mse_loss


def test_each_step_carries_the_summed_micro_batch_losses_lr_and_clipped_norm(
    hooks: _autorun.Instrumenter, listener: Listener
) -> None:
    model, loader, mse = model_and_data()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mine = []
    batches = iter(loader)
    for _ in range(3):
        total = torch.zeros(())
        for _ in range(2):  # gradient accumulation: two backward() per step
            x, y = next(batches)
            loss = mse(model(x), y) / 2
            loss.backward()
            total += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        mine.append((total.item(), norm.item()))
    hooks.run.finish()
    steps = steps_of(sent(listener))
    assert [s.header.step for s in steps] == [1, 2, 3]
    for step, (loss, norm) in zip(steps, mine, strict=True):
        f = fields(step)
        assert f[P.FIELD_LOSS] == pytest.approx(loss, rel=1e-6)
        assert f[P.FIELD_GRAD_NORM] == pytest.approx(norm, rel=1e-6)
        assert f[P.FIELD_LR] == 0.01
        assert f[P.FIELD_DATA_TIME] > 0
    assert steps[-1].header.samples_total == 3 * 2 * 8
    assert hooks.steps == 3 and hooks.backwards == 6 and hooks.seconds > 0


def test_a_second_optimizer_neither_counts_steps_nor_adds_its_loss(
    hooks: _autorun.Instrumenter, listener: Listener
) -> None:
    """A GAN: the discriminator steps first, so it is the primary; the generator's is not."""
    torch.manual_seed(0)
    gen, disc = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.05)
    d_losses = []
    for _ in range(4):
        z = torch.randn(16, 2)
        d_loss = disc(gen(z).detach()).mean() - disc(torch.randn(16, 2)).mean()
        d_loss.backward()
        opt_d.step()
        opt_d.zero_grad()
        g_loss = -disc(gen(z)).mean()
        g_loss.backward()
        opt_g.step()
        opt_g.zero_grad()
        d_losses.append(d_loss.item())
    hooks.run.finish()
    steps = steps_of(sent(listener))
    assert [s.header.step for s in steps] == [1, 2, 3, 4]
    assert [fields(s)[P.FIELD_LOSS] for s in steps] == pytest.approx(d_losses, rel=1e-6)
    assert [fields(s)[P.FIELD_LR] for s in steps] == [0.1] * 4


def test_a_grad_scaler_loss_is_reported_unscaled(
    hooks: _autorun.Instrumenter, listener: Listener
) -> None:
    model, loader, mse = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = next(iter(loader))
    loss = mse(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    hooks.run.finish()
    (step,) = steps_of(sent(listener))
    assert fields(step)[P.FIELD_LOSS] == pytest.approx(loss.item(), rel=1e-6)


def test_saves_with_no_training_between_are_one_checkpoint_and_a_load_is_a_restore(
    hooks: _autorun.Instrumenter, listener: Listener, tmp_path: Path
) -> None:
    model, loader, mse = model_and_data()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def train(n: int) -> None:
        for x, y in list(loader)[:n]:
            mse(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    train(3)
    torch.save(model.state_dict(), tmp_path / "model.pt")  # three files, one checkpoint
    torch.save(opt.state_dict(), tmp_path / "optim.pt")
    torch.save({"step": 3}, tmp_path / "meta.pt")
    torch.save(torch.ones(3), tmp_path / "not-a-checkpoint.pt")  # a tensor: no state dict
    train(2)
    opt.load_state_dict(torch.load(tmp_path / "optim.pt"))  # back to step 3
    model.load_state_dict(torch.load(tmp_path / "model.pt"))
    train(1)
    hooks.run.finish()
    records = sent(listener)
    checkpoints = [(r.step, r.restore) for t, r in records if t == P.CHECKPOINT]
    assert checkpoints == [(3, False), (3, True)]
    assert all(r.seconds > 0 for t, r in records if t == P.CHECKPOINT)
    assert [s.header.step for s in steps_of(records)] == [1, 2, 3, 4, 5, 4]


def test_the_run_starts_at_the_first_step_with_the_process_start(
    hooks: _autorun.Instrumenter, listener: Listener
) -> None:
    model, loader, mse = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in loader:  # batches and backward() alone start nothing
        mse(model(x), y).backward()
    assert hooks.run is None
    opt.step()
    assert hooks.run is not None
    hooks.run.finish()
    hello = next(r for t, r in sent(listener) if t == P.HELLO)
    assert hello["started_at"] == _process_start(os.getpid())
    assert hello["started_at"] < time.time() - 0.5  # long before the step: start-up counts


def test_an_evaluation_pass_is_timed_and_its_batches_are_not_data_time(
    hooks: _autorun.Instrumenter, listener: Listener
) -> None:
    model, loader, mse = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with torch.no_grad():  # an evaluation before training starts the run
        for x, _ in loader:
            model(x)
    for x, y in itertools.islice(loader, 2):
        mse(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        for x, _ in loader:
            model(x)
    hooks.run.finish()
    records = sent(listener)
    tracks = [r for t, r in records if t == P.TRACK]
    assert [r.active for r in tracks] == [True, False, True, False]
    assert tracks[-1].runs_total == 2
    steps = steps_of(records)
    assert [s.header.samples_total for s in steps] == [8, 16]  # the training batches only


def test_a_failing_hook_never_reaches_the_program(
    hooks: _autorun.Instrumenter, listener: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, loader, mse = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = next(iter(loader))
    mse(model(x), y).backward()
    opt.step()  # the run starts

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("trainmon bug")

    monkeypatch.setattr(hooks.run, "log", broken)
    monkeypatch.setattr(hooks, "_close_span", broken)
    expected = torch.nn.utils.clip_grad_norm_.__wrapped__(model.parameters(), 1e9)
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9) == expected
    torch.save({"w": torch.ones(1)}, os.devnull)  # closed (and failing) at the backward()
    mse(model(x), y).backward()
    opt.step()
    assert hooks.run.internal_errors == 3  # the save closed at backward() and step(), the log


def test_after_a_framework_takes_over_the_hooks_do_nothing(
    hooks: _autorun.Instrumenter, listener: Listener
) -> None:
    model, loader, mse = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = next(iter(loader))
    mse(model(x), y).backward()
    opt.step()
    run = hooks.take_over("some-framework")
    assert run is not None and hooks.run is None and not hooks.active
    mse(model(x), y).backward()
    opt.step()
    run.finish()
    assert [s.header.step for s in steps_of(sent(listener))] == [1]
    assert hooks.steps == 1


def test_a_compiled_model_is_reported_and_computes_the_same(
    hooks: _autorun.Instrumenter, listener: Listener
) -> None:
    model, loader, mse = model_and_data()
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for x, y in list(loader)[:3]:
        loss = mse(compiled(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    hooks.run.finish()
    steps = steps_of(sent(listener))
    assert [fields(s)[P.FIELD_LOSS] for s in steps] == pytest.approx(losses, rel=1e-6)


def test_backward_without_an_optimizer_step_is_said_at_exit(
    hooks: _autorun.Instrumenter, caplog: pytest.LogCaptureFixture
) -> None:
    model, loader, mse = model_and_data()
    x, y = next(iter(loader))
    mse(model(x), y).backward()
    with caplog.at_level(logging.WARNING, logger="trainmon_client"):
        hooks._at_exit()
    assert "1 backward() calls and no optimizer step" in caplog.text
    assert hooks.run is None


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, set(_autorun.METRICS)),
        ("", set(_autorun.METRICS)),
        ("loss,lr", {"loss", "lr"}),
        ("-samples", set(_autorun.METRICS) - {"samples"}),
        ("all,-loss,-lr", set(_autorun.METRICS) - {"loss", "lr"}),
        ("loss,nonsense", {"loss"}),
    ],
)
def test_metric_and_hook_lists(raw: str | None, expected: set[str]) -> None:
    assert _autorun.parse_names(raw, _autorun.METRICS, "TRAINMON_METRICS") == expected


def test_nothing_is_installed_outside_trainmon_run() -> None:
    assert _autorun.install({}) is None
    assert _autorun.install({"TRAINMON_AUTORUN": "0"}) is None


def test_trainmon_runs_variables_are_not_taken_for_misspellings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: ``TRAINMON_AUTORUN`` drew "did you mean TRAINMON_RUN?" in every process."""
    from trainmon_client._env import misspelt_variables

    env = {"TRAINMON_AUTORUN": "1", "TRAINMON_AUTORUN_PID": "7", "TRAINMON_HOOKS": "all"}
    assert misspelt_variables({**env, "TRAINMON_METRICS": "loss"}) == []
    assert misspelt_variables({"TRAINMON_AUTORUNN": "1"}) == [
        ("TRAINMON_AUTORUNN", "TRAINMON_AUTORUN")
    ]


def test_started_at_is_checked() -> None:
    import trainmon_client

    with pytest.raises(ValueError, match="started_at"):
        trainmon_client.init(
            run="x", socket_path="/nonexistent/t.sock", started_at=time.time() + 60
        )
    run = trainmon_client.init(run="x", socket_path="/nonexistent/t.sock", started_at=1.0e9)
    run.finish()
