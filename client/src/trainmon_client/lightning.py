"""Lightning integration: ``lightning.Trainer(callbacks=[TrainmonCallback()])``.

Importing this module imports ``lightning``; ``import trainmon_client`` never does, so
Lightning stays an optional dependency.

What it sends, per optimizer step (``trainer.global_step`` after the step), from every rank:

- ``loss``: the sum of the micro-batches' ``training_step`` losses as ``on_train_batch_end``
  receives them. Lightning has already divided each by ``accumulate_grad_batches``, so the sum
  is the step's mean loss. It is the raw value: nothing filters a NaN.
- ``grad_norm``: the global L2 norm of the gradients in ``on_before_optimizer_step``, which
  Lightning calls after unscaling (AMP) and **before** gradient clipping:
  ``‖(‖g_1‖, …, ‖g_n‖)‖`` from ``torch._foreach_norm``, one batched pass over the gradients.
  Under FSDP or other sharding it is this rank's shard. ``grad_norm=False`` skips the pass.
- ``lr``: ``optimizer.param_groups[0]["lr"]`` at the same point (the rate this step uses).
- ``samples``: the first dimension of the batch's first tensor. ``tokens``: what
  ``count_tokens(batch)`` returns, when given (for MFU).

Every value stays on the device: the loss and the norm are CUDA tensors that the client
copies to the host asynchronously (:mod:`trainmon_client._device`). The callback adds no
synchronisation.

Validation, outside the sanity check, is timed as the operation ``validation``. At its end,
``trainer.callback_metrics`` whose names start with ``val`` are sent through
:meth:`Run.eval`: ``val_loss`` or ``val/loss`` as ``val_loss``, and the others without the
prefix. A checkpoint is timed around ``trainer.save_checkpoint`` (the callback wraps the
trainer's method: no hook runs after the file is written, and on ranks other than 0 the save
is the wait for rank 0's write) and reported as it returns, so the fetch of the next batch
is data loading, not the save; a save that bypasses the method is reported at the first hook
after ``on_save_checkpoint``, as before. Data loading: each
step carries as ``data_time`` the time from the previous hook (the start of training, the
end of this callback's previous ``on_train_batch_end``, a validation, a checkpoint) to each of
its micro-batches' start,
which is when Lightning fetches the batch. A fit resumed from a checkpoint (``ckpt_path``)
reports it at ``on_load_checkpoint`` as a restore (``Run.checkpoint(step, restore=True)``;
the load's duration is not seen by a callback, so the exporter counts it as start-up). Ranks
come from ``trainer.global_rank``, ``local_rank`` and ``world_size``. Rank 0's run id is
broadcast in ``setup``, so every rank agrees on it whatever the launcher. An exception in
``fit`` finishes the run as failed.

The callback uses the public :class:`~trainmon_client.Run` API only. A failure in its own hooks
is caught, so that the training step goes on, and counted with
:meth:`Run.count_internal_error` (:attr:`Run.internal_errors`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch import Callback

from trainmon_client._env import detect_run_id
from trainmon_client._operation import Operation
from trainmon_client._run import Run, init

__all__ = ["TrainmonCallback"]


class TrainmonCallback(Callback):  # type: ignore[misc]
    """Report a Lightning ``fit`` to the node's trainmon exporter.

    Example:
        >>> from trainmon_client.lightning import TrainmonCallback  # doctest: +SKIP
        >>> trainer = lightning.Trainer(callbacks=[TrainmonCallback(num_params=n)])

    Args:
        run: run id shared by every rank; default: rank 0's detected id, broadcast.
        count_tokens: ``batch -> tokens in it`` (e.g. ``lambda b: b[0].numel()``); without it
            no tokens are reported, and so no tokens/s or MFU.
        grad_norm: compute the global gradient norm before clipping (one pass over the
            gradients each optimizer step).
        **init_kwargs: passed to :func:`trainmon_client.init` (``num_params``,
            ``flops_per_token``, ``dtype``, ``socket_path``, ``cuda_memory``...).

    Attributes:
        run: the :class:`~trainmon_client.Run`, from ``setup("fit")`` on (None before).
    """

    def __init__(
        self,
        run: str | None = None,
        *,
        count_tokens: Callable[[Any], int] | None = None,
        grad_norm: bool = True,
        **init_kwargs: Any,
    ) -> None:
        self.run: Run | None = None
        self._run_id = run
        self._count_tokens = count_tokens
        self._grad_norm = grad_norm
        self._init_kwargs = init_kwargs
        self._loss: Any = None
        self._tokens = 0
        self._samples = 0
        self._norm: Any = None
        self._lr: Any = None
        self._global_step = 0
        self._validation: Operation | None = None
        self._checkpoint: tuple[int, float] | None = None
        self._params: list[Any] | None = None
        self._t_event: float | None = None  # the last hook that ended other work
        self._data_time = 0.0  # batch fetches of the step in progress

    # ----------------------------------------------------------------------------- lifecycle

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Start the run for ``fit`` on every rank, with rank 0's run id."""
        if stage != "fit" or (self.run is not None and not self.run.closed):
            return
        run_id = self._run_id
        if run_id is None:
            run_id = trainer.strategy.broadcast(detect_run_id(trainer.world_size), src=0)
        self.run = init(
            run_id,
            rank=trainer.global_rank,
            local_rank=trainer.local_rank,
            world_size=trainer.world_size,
            **self._init_kwargs,
        )
        self._global_step = trainer.global_step
        self._params = None
        save = trainer.save_checkpoint
        if getattr(save, "__trainmon__", None) is not self:
            trainer.save_checkpoint = self._timed_save(save)

    def _timed_save(self, save: Callable[..., Any]) -> Callable[..., Any]:
        """``trainer.save_checkpoint``, timed: the checkpoint is reported when it returns."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return save(*args, **kwargs)
            finally:
                if self._checkpoint is not None:  # on_save_checkpoint ran: a save of this fit
                    self._checkpoint = (self._checkpoint[0], t0)
                    self._checkpoint_written()

        timed.__trainmon__ = self  # type: ignore[attr-defined]
        return timed

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Give the trainer its own ``save_checkpoint`` back."""
        if getattr(trainer.__dict__.get("save_checkpoint"), "__trainmon__", None) is self:
            del trainer.save_checkpoint

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Send what is left and finish the run (reported as finished)."""
        self._checkpoint_written()
        if self.run is not None:
            self.run.finish()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Finish the run as failed (a KeyboardInterrupt counts as a normal stop)."""
        if self.run is not None:
            self.run.finish(failed=not isinstance(exception, KeyboardInterrupt))

    # ----------------------------------------------------------------------------- steps

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        """A checkpoint written since the last hook is reported now; the rest was the fetch."""
        self._checkpoint_written()
        if self._t_event is not None:
            self._data_time += time.perf_counter() - self._t_event
            self._t_event = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """The first batch is fetched from here (after a restore, mid-epoch too)."""
        self._t_event = time.perf_counter()

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """The epoch's first batch is fetched from here (a new data loader iterator)."""
        self._t_event = time.perf_counter()

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        """Report the checkpoint the fit resumes from as a restore."""
        step = checkpoint.get("global_step") if isinstance(checkpoint, Mapping) else None
        if self.run is not None and isinstance(step, int):
            self.run.checkpoint(step, restore=True)
            self._global_step = step

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """Read the learning rate, and the gradient norm before clipping (on the device)."""
        try:
            if optimizer.param_groups:
                self._lr = optimizer.param_groups[0].get("lr")
            if self._grad_norm:
                if self._params is None:  # walking the module tree costs ~60 us per step
                    self._params = [p for p in pl_module.parameters() if p.requires_grad]
                grads = [p.grad for p in self._params if p.grad is not None]
                if grads:
                    norms: list[Any] = list(torch._foreach_norm(grads))
                    device = norms[0].device
                    if any(n.device != device for n in norms):  # parameters on several devices
                        norms = [n.to(device) for n in norms]
                    self._norm = torch.linalg.vector_norm(torch.stack(norms).float())
        except Exception:  # never break the optimizer step
            if self.run is not None:
                self.run.count_internal_error()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Add the micro-batch; after an optimizer step, send the step.

        The next batch's fetch is timed from when this returns: this hook's own work is the
        step's, not data loading.
        """
        try:
            self._batch_end(trainer, outputs, batch)
        finally:
            self._t_event = time.perf_counter()

    def _batch_end(self, trainer: Any, outputs: Any, batch: Any) -> None:
        run = self.run
        if run is None:
            return
        try:
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                value = loss.detach().float().reshape(())
                self._loss = value if self._loss is None else self._loss + value
            first = _first_tensor(batch)
            if first is not None and first.dim() >= 1:
                self._samples += first.shape[0]
            if self._count_tokens is not None:
                self._tokens += int(self._count_tokens(batch))
        except Exception:
            run.count_internal_error()
        step = trainer.global_step
        if step == self._global_step:
            return  # accumulating: no optimizer step yet
        self._global_step = step
        metrics: dict[str, Any] = {}
        if self._loss is not None:
            metrics["loss"] = self._loss
        if self._norm is not None:
            metrics["grad_norm"] = self._norm
        if self._lr is not None:
            metrics["lr"] = self._lr
        if self._samples:
            metrics["samples"] = self._samples
        if self._tokens:
            metrics["tokens"] = self._tokens
        if self._data_time:
            metrics["data_time"] = self._data_time
            self._data_time = 0.0
        run.log(step, **metrics)
        self._loss = self._norm = None
        self._samples = self._tokens = 0

    # ----------------------------------------------------------------------------- validation

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        """Time the validation loop (not the sanity check)."""
        self._checkpoint_written()
        if self.run is not None and not trainer.sanity_checking:
            self._validation = self.run.track("validation")
            self._validation.start()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        """Stop the timing and send the ``val*`` callback metrics."""
        if self._t_event is not None:
            self._t_event = time.perf_counter()  # the next fetch is timed from here
        run = self.run
        if run is None or trainer.sanity_checking:
            return
        if self._validation is not None:
            self._validation.stop()
            self._validation = None
        values: dict[str, Any] = {}
        for key, value in trainer.callback_metrics.items():
            if not key.startswith("val"):
                continue
            name = key[4:] if key[3:4] in ("_", "/") else key
            values["val_loss" if name == "loss" else name.replace("/", "_")] = value
        if values:
            run.eval(trainer.global_step, **values)

    # ----------------------------------------------------------------------------- checkpoints

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        """Note the step; the file is written after this hook returns."""
        self._checkpoint = (trainer.global_step, time.perf_counter())

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """A checkpoint written since the last hook is reported now."""
        self._checkpoint_written()

    def _checkpoint_written(self) -> None:
        if self._checkpoint is not None and self.run is not None:
            step, t0 = self._checkpoint
            self._checkpoint = None
            now = time.perf_counter()
            self.run.checkpoint(step, seconds=now - t0)
            if self._t_event is not None:
                self._t_event = now  # a fetch waited for comes after the write


def _first_tensor(batch: Any) -> torch.Tensor | None:
    """The first tensor of a batch: the batch itself, or the first of a sequence or mapping."""
    for _ in range(4):
        if isinstance(batch, torch.Tensor):
            return batch
        if isinstance(batch, Mapping):
            batch = next(iter(batch.values()), None)
        elif isinstance(batch, (list, tuple)):
            batch = batch[0] if batch else None
        else:
            return None
    return None
