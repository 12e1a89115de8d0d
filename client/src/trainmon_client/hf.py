"""Hugging Face ``transformers.Trainer`` integration: ``callbacks=[TrainmonCallback()]``.

Importing this module imports transformers; ``import trainmon_client`` never does, so
transformers stays an optional dependency.

What it sends, per optimizer step (``state.global_step``), from every rank:

- ``loss``: the step's training loss **as the model returned it**, read by a forward hook on
  the model before the Trainer's ``logging_nan_inf_filter`` (on by default) replaces a NaN or
  infinite loss with the running average. A diverged step is therefore seen here even
  though the Trainer's own logs stay finite. The hook keeps the loss on the device and
  sums micro-batches there, so it adds no synchronisation: the client copies it to the host
  asynchronously (see :mod:`trainmon_client._device`). The scaling follows
  ``Trainer.training_step``: micro-batch losses are averaged, or summed when the Trainer passed
  ``num_items_in_batch`` to the model (then times the world size when
  ``average_tokens_across_devices``), so the value equals the Trainer's logged loss with
  ``logging_steps=1``.
- ``lr``: ``optimizer.param_groups[0]["lr"]`` at ``on_optimizer_step``, before the scheduler
  steps: the rate this step used, as the Trainer logs it.
- ``grad_norm``: the Trainer's pre-clipping gradient norm. The Trainer hands it only to
  ``on_log``, so it is sent on logging steps (every ``logging_steps``).
- ``tokens`` and ``samples``: ``input_ids.numel()`` and ``input_ids.shape[0]`` of each
  micro-batch, counted on the host from shapes (padding included: it costs FLOPs too).

Evaluation: ``on_evaluate`` sends ``eval_loss`` as ``val_loss`` and the other ``eval_*``
metrics under their names without the prefix, through :meth:`Run.eval`. The evaluation is
timed as the operation ``evaluation`` (first ``on_prediction_step`` to ``on_evaluate``), so
the exporter does not call the rank hung meanwhile. Checkpoints: ``on_save`` sends
:meth:`Run.checkpoint` with the seconds since the previous Trainer event, which is the save
itself. Data loading: each step carries as ``data_time`` the time from the Trainer's last
event (the previous step's end, a log, an evaluation or a save) to the start of the step,
which is when the Trainer fetches its batches. A resumed run (``resume_from_checkpoint``)
reports the checkpoint it resumed from at ``on_train_begin`` as a restore
(``Run.checkpoint(step, restore=True)``; its duration is unknown to a callback, so the
exporter counts the load as start-up). Ranks, local ranks and the world size come from
``TrainingArguments``
(``process_index``, ``local_process_index``, ``world_size``). ``flops_per_token`` defaults to
``6 * model.num_parameters(exclude_embeddings=True)`` (Kaplan et al. 2020, §2.1) and the dtype
to ``bf16``, ``fp16``, ``tf32`` or ``fp32`` from the arguments, so the exporter can compute MFU.

The callback uses the public :class:`~trainmon_client.Run` API only. A failure in its own hooks
is caught, so that the training step goes on, and counted with
:meth:`Run.count_internal_error` (:attr:`Run.internal_errors`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import torch
from transformers import TrainerCallback

from trainmon_client._operation import Operation
from trainmon_client._run import Run, init

__all__ = ["TrainmonCallback"]

_EVAL_BOOKKEEPING = frozenset({"epoch", "runtime", "samples_per_second", "steps_per_second"})


class TrainmonCallback(TrainerCallback):  # type: ignore[misc]
    """Report a ``transformers.Trainer`` run to the node's trainmon exporter.

    Example:
        >>> from trainmon_client.hf import TrainmonCallback  # doctest: +SKIP
        >>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[TrainmonCallback()])

    Args:
        run: run id shared by every rank; default as :func:`trainmon_client.init` detects it
            (``TRAINMON_RUN``, torchrun's run id, the Slurm job).
        flops_per_token: training FLOPs per token for MFU; default ``6 * N`` with ``N`` the
            model's non-embedding parameters.
        **init_kwargs: passed to :func:`trainmon_client.init` (``socket_path``,
            ``cuda_memory``, ``flush_interval``...).

    Attributes:
        run: the :class:`~trainmon_client.Run`, from ``on_train_begin`` on (None before).
    """

    def __init__(
        self, run: str | None = None, *, flops_per_token: float | None = None, **init_kwargs: Any
    ) -> None:
        self.run: Run | None = None
        self._run_id = run
        self._flops_per_token = flops_per_token
        self._init_kwargs = init_kwargs
        self._hook: Any = None
        self._reset_step()
        self._pending: tuple[int, dict[str, Any]] | None = None
        self._lr: Any = None
        self._evaluation: Operation | None = None  # running while an evaluation runs
        self._world = 1
        self._t_event = time.perf_counter()
        self._data_time: float | None = None  # the wait before the step that runs now

    # ----------------------------------------------------------------------------- setup

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Start the run (all ranks) and hook the model's forward."""
        model = kwargs.get("model")
        if self.run is None or self.run.closed:
            fpt = self._flops_per_token
            if fpt is None and model is not None:
                fpt = 6.0 * _non_embedding_params(model) or None
            self.run = init(
                self._run_id,
                rank=args.process_index,
                local_rank=max(args.local_process_index, 0),
                world_size=args.world_size,
                flops_per_token=fpt,
                dtype=_dtype(args),
                **self._init_kwargs,
            )
        self._world = args.world_size if getattr(args, "average_tokens_across_devices", 0) else 1
        if model is not None and self._hook is None:
            self._hook = model.register_forward_hook(self._forward, with_kwargs=True)
        if state.global_step > 0 and self.run is not None:  # resumed from a checkpoint
            self.run.checkpoint(state.global_step, restore=True)
        self._event()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Send the last step and finish the run (the exporter reports the rank finished)."""
        self._emit()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.run is not None:
            self.run.finish()

    # ----------------------------------------------------------------------------- steps

    def _reset_step(self) -> None:
        self._loss: Any = None
        self._micro = 0
        self._summed = False
        self._tokens = 0
        self._samples = 0

    def _forward(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        """Forward hook: accumulate the raw training loss on the device, count tokens."""
        if not module.training or not torch.is_grad_enabled():
            return
        try:
            loss = output.get("loss") if isinstance(output, Mapping) else None
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                value = loss.detach().float().reshape(())
                self._loss = value if self._loss is None else self._loss + value
                self._micro += 1
                self._summed = kwargs.get("num_items_in_batch") is not None
            ids = kwargs.get("input_ids")
            if ids is None and args:
                ids = args[0]
            if isinstance(ids, torch.Tensor) and ids.dim() >= 1:
                self._tokens += ids.numel()
                self._samples += ids.shape[0]
        except Exception:  # never break the training step
            if self.run is not None:
                self.run.count_internal_error()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Read the learning rate this step used (before the scheduler steps)."""
        optimizer = kwargs.get("optimizer")
        if optimizer is not None and optimizer.param_groups:
            self._lr = optimizer.param_groups[0].get("lr")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Close the step; it is sent at the next event, with ``grad_norm`` if it is logged."""
        self._emit()
        metrics: dict[str, Any] = {}
        if self._loss is not None:
            if self._summed:
                metrics["loss"] = self._loss * self._world if self._world > 1 else self._loss
            else:
                metrics["loss"] = self._loss / self._micro if self._micro > 1 else self._loss
        if self._lr is not None:
            metrics["lr"] = self._lr
        if self._tokens:
            metrics["tokens"] = self._tokens
            metrics["samples"] = self._samples
        if self._data_time is not None:
            metrics["data_time"] = self._data_time
            self._data_time = None
        self._pending = (state.global_step, metrics)
        self._reset_step()
        self._event()

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any
    ) -> None:
        """Add the Trainer's gradient norm to the step it belongs to, and send the step."""
        pending = self._pending
        if pending is not None and logs and pending[0] == state.global_step:
            grad_norm = logs.get("grad_norm")
            if isinstance(grad_norm, (int, float)):
                pending[1]["grad_norm"] = grad_norm
        self._emit()
        self._event()

    def _emit(self) -> None:
        if self._pending is not None and self.run is not None:
            step, metrics = self._pending
            self._pending = None
            self.run.log(step, **metrics)

    def _event(self) -> None:
        self._t_event = time.perf_counter()

    # ----------------------------------------------------------------------------- evaluation

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Send a step still held; the time since the last event was the batch's loading."""
        self._data_time = time.perf_counter() - self._t_event
        self._emit()
        self._event()

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Start timing the evaluation at its first batch."""
        evaluation = self._evaluation
        if (evaluation is None or not evaluation.running) and self.run is not None:
            self._emit()
            self._evaluation = self.run.track("evaluation")
            self._evaluation.start()

    def _end_evaluation(self) -> None:
        if self._evaluation is not None:
            self._evaluation.stop()
        self._evaluation = None

    def on_evaluate(
        self,
        args: Any,
        state: Any,
        control: Any,
        metrics: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Send ``eval_loss`` as ``val_loss`` and the other ``eval_*`` metrics."""
        self._emit()
        self._end_evaluation()
        if self.run is not None and metrics:
            values: dict[str, float] = {}
            for key, value in metrics.items():
                name = key[5:] if key.startswith("eval_") else key
                if name in _EVAL_BOOKKEEPING or not isinstance(value, (int, float)):
                    continue
                values["val_loss" if name == "loss" else name] = value
            if values:
                self.run.eval(state.global_step, **values)
        self._event()

    def on_predict(
        self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any
    ) -> None:
        """End the timing of a ``Trainer.predict`` pass."""
        self._end_evaluation()
        self._event()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Record the checkpoint of this step, timed from the previous Trainer event."""
        self._emit()
        if self.run is not None:
            self.run.checkpoint(state.global_step, seconds=time.perf_counter() - self._t_event)
        self._event()


def _dtype(args: Any) -> str:
    """The dtype MFU is judged against, from ``TrainingArguments``."""
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    return "tf32" if getattr(args, "tf32", None) else "fp32"


def _non_embedding_params(model: Any) -> int:
    """``model.num_parameters(exclude_embeddings=True)``, else every parameter's count."""
    try:
        n = int(model.num_parameters(exclude_embeddings=True))
    except Exception:
        n = sum(p.numel() for p in model.parameters())
    return n if n > 0 and math.isfinite(n) else 0
