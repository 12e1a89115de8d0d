"""Frameworks ``trainmon-run`` finds in a process: their adapter reports instead of the hooks.

:mod:`trainmon_client._autorun` hooks PyTorch itself; a framework that runs the training loop
knows more (its step, its own loss, evaluation, its checkpoints), so where one is used its
adapter is added the way the framework documents, and the PyTorch hooks stop in that process
(:meth:`~trainmon_client._autorun.Instrumenter.take_over`): never both, so no step is counted
twice. Each function here runs when its framework is first imported, or when the framework
calls it; none imports a framework the program did not.

- Hugging Face ``transformers.Trainer``: its ``__init__`` is wrapped to ``add_callback`` the
  :mod:`trainmon_client.hf` callback (the Trainer has no plug-in registry);
- Lightning: the ``lightning.pytorch.callbacks_factory`` entry point (Lightning's documented
  way to add callbacks from a package) returns the :mod:`trainmon_client.lightning` callback;
- DeepSpeed (no plug-in API): the hooks see its engine's inner ``torch.optim`` step and its
  ``torch.save`` calls; :func:`hook_deepspeed` adds what only the engine knows (the loss
  before its scaling, its gradient norm, ``save_checkpoint``/``load_checkpoint`` as one
  checkpoint each);
- Keras 3: ``keras.Model.fit`` is wrapped to pass the :mod:`trainmon_client.keras` callback in
  ``callbacks=`` (Keras has no plug-in registry; its optimizers are not ``torch.optim``, so the
  hooks alone would count no step).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from trainmon_client._autorun import log

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType
    from typing import Any

    from trainmon_client._autorun import Instrumenter


def watched(ins: Instrumenter) -> dict[str, Callable[[ModuleType], None]]:
    """The modules whose import adds an adapter, and what to do then."""
    return {
        "transformers.trainer": functools.partial(hook_transformers, ins),
        "keras": functools.partial(hook_keras, ins),
        "deepspeed.runtime.engine": functools.partial(hook_deepspeed, ins),
    }


def _wrap_init(cls: type, after: Callable[[Any], None]) -> None:
    init = cls.__init__  # type: ignore[misc]
    if getattr(init, "__trainmon__", False):
        return

    @functools.wraps(init)
    def __init__(obj: Any, *args: Any, **kwargs: Any) -> None:
        init(obj, *args, **kwargs)
        after(obj)

    __init__.__trainmon__ = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[misc]


def hook_transformers(ins: Instrumenter, module: ModuleType) -> None:
    """Every ``transformers.Trainer`` built from now on gets the trainmon callback."""
    cls = getattr(module, "Trainer", None)
    if cls is not None:
        _wrap_init(cls, functools.partial(adopt_hf_trainer, ins))


def adopt_hf_trainer(ins: Instrumenter, trainer: Any) -> None:
    """Add the HF callback to ``trainer`` unless it has one; the hooks stop."""
    try:
        from trainmon_client.hf import TrainmonCallback

        if any(isinstance(c, TrainmonCallback) for c in trainer.callback_handler.callbacks):
            ins.take_over("transformers", keep_run=False)
            return
        callback = TrainmonCallback()
        callback.run = ins.take_over("transformers")
        trainer.add_callback(callback)
    except Exception:
        log.warning("trainmon-run: could not add the callback to a Trainer", exc_info=True)


def hook_deepspeed(ins: Instrumenter, module: ModuleType) -> None:
    """The DeepSpeed engine's loss, gradient norm and checkpoints, added to the hooks' steps.

    - ``DeepSpeedEngine.backward(loss)``: the loss as the program passed it, divided by the
      gradient accumulation steps (as the engine divides it), summed over the micro-batches:
      the step's mean loss, before any fp16 loss scale; the ``backward()`` inside is not
      read again;
    - ``DeepSpeedEngine.step()``: the step the inner optimizer took inside it is sent when it
      returns, with ``get_global_grad_norm()`` (ZeRO and mixed precision), or the norm the
      engine's own ``clip_grad_norm_`` returned (``gradient_clipping`` in fp32), and the
      engine's ``get_lr()``; a step skipped for an fp16 overflow is no step;
    - ``save_checkpoint`` and ``load_checkpoint``: one checkpoint each, all their files.
    """
    engine = getattr(module, "DeepSpeedEngine", None)
    if engine is None:
        return
    if hasattr(module, "clip_grad_norm_"):
        ins.wrap(module, "clip_grad_norm_", ins._clip_wrapper)
    ins.wrap(engine, "save_checkpoint", functools.partial(ins._io_wrapper, kind="save", dcp=True))
    ins.wrap(engine, "load_checkpoint", functools.partial(ins._io_wrapper, kind="load", dcp=True))

    def backward(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(eng: Any, loss: Any, *args: Any, **kwargs: Any) -> Any:
            ins.inside_engine += 1
            try:
                out = original(eng, loss, *args, **kwargs)
            finally:
                ins.inside_engine -= 1
            try:
                if ins.active and hasattr(loss, "detach") and kwargs.get("scale_wrt_gas", True):
                    ins.add_loss(loss / eng.gradient_accumulation_steps())
            except Exception:
                ins.count_error()
            return out

        return wrapper

    def step(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(eng: Any, *args: Any, **kwargs: Any) -> Any:
            ins.holding += 1
            try:
                return original(eng, *args, **kwargs)
            finally:
                ins.holding -= 1
                held, ins.held = ins.held, None
                if held is not None and ins.run is not None:
                    try:
                        number, metrics = held
                        norm = eng.get_global_grad_norm()
                        if norm is not None and "grad_norm" in ins.metrics:
                            metrics["grad_norm"] = norm
                        lrs = eng.get_lr()
                        if lrs and "lr" in ins.metrics:
                            metrics["lr"] = lrs[0]
                        ins.run.log(number, **metrics)
                    except Exception:
                        ins.count_error()

        return wrapper

    ins.wrap(engine, "backward", backward)
    ins.wrap(engine, "step", step)


def hook_keras(ins: Instrumenter, module: ModuleType) -> None:
    """Every ``keras.Model.fit`` from now on gets the trainmon callback."""
    cls = getattr(module, "Model", None)
    fit = getattr(cls, "fit", None)
    if cls is None or fit is None or getattr(fit, "__trainmon__", False):
        return

    @functools.wraps(fit)
    def wrapper(model: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) <= 5:  # callbacks= is fit's 6th parameter
            try:
                kwargs["callbacks"] = adopt_keras(ins, kwargs.get("callbacks"))
            except Exception:
                log.warning("trainmon-run: could not add the Keras callback", exc_info=True)
        return fit(model, *args, **kwargs)

    wrapper.__trainmon__ = True  # type: ignore[attr-defined]
    cls.fit = wrapper


def adopt_keras(ins: Instrumenter, callbacks: Any) -> Any:
    """``callbacks`` with the Keras callback added, unless it holds one; the hooks stop."""
    from trainmon_client.keras import TrainmonCallback

    given = list(callbacks or [])
    if any(isinstance(c, TrainmonCallback) for c in given):
        ins.take_over("keras", keep_run=False)
        return callbacks
    callback = TrainmonCallback()
    callback.run = ins.take_over("keras")
    return [*given, callback]


def lightning_callbacks(ins: Instrumenter) -> list[Any]:
    """The callback Lightning's entry point adds to a ``Trainer`` under ``trainmon-run``.

    It takes the run the hooks started, if any. It steps aside (no run, no gradient norm) when
    the program also gave the Trainer a ``TrainmonCallback`` of its own.
    """
    from trainmon_client.lightning import TrainmonCallback

    class AddedByTrainmonRun(TrainmonCallback):  # type: ignore[misc]
        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if any(isinstance(c, TrainmonCallback) and c is not self for c in trainer.callbacks):
                if self.run is not None:
                    self.run.finish()
                self.run = None
                self._grad_norm = False
                return
            super().setup(trainer, pl_module, stage)

    callback = AddedByTrainmonRun()
    callback.run = ins.take_over("lightning")
    return [callback]
