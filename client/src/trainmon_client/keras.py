"""Keras 3 integration: ``model.fit(..., callbacks=[TrainmonCallback()])``.

Importing this module imports ``keras``; ``import trainmon_client`` never does. Written against
Keras 3's documented ``keras.callbacks.Callback``; tested with the torch backend.

What it sends, per optimizer step (each ``on_train_batch_end``), as :meth:`Run.log`:

- ``loss``: the batch's own loss. Keras's logs carry the epoch's running mean; the batch's
  value is the change of the model's loss tracker (the ``Mean`` metric named ``loss`` in
  ``model.metrics``: its ``total`` and ``count``, each weighted by the batch's samples) over
  the batch. Both sums are float32, so late in a long epoch the value carries their rounding
  (about ``ulp(total) / batch size``). Without the tracker: the logged running mean.
- ``lr``: ``model.optimizer.learning_rate`` (a schedule's value at the step);
- ``samples``: the change of the tracker's ``count`` (samples in the batch);
- ``data_time``: seconds from the previous batch's end (or the epoch's start) to this batch's
  start, when Keras fetches the batch.

The step number is ``model.optimizer.iterations`` at the start of ``fit`` plus the batches
since, so a model restored with its optimizer goes on from its count. Evaluation inside
``fit`` (``validation_data``) is timed as the operation ``evaluation`` and its ``val_*``
results sent with :meth:`Run.eval` at the epoch's end. Checkpoints are written by other
callbacks (``ModelCheckpoint``) that a callback does not see: they are not reported.
Ranks come from the launcher's environment as with :func:`trainmon_client.init`.

The callback uses the public :class:`~trainmon_client.Run` API only; a failure in its hooks is
caught and counted (:meth:`Run.count_internal_error`).
"""

from __future__ import annotations

import time
from typing import Any

import keras

from trainmon_client._operation import Operation
from trainmon_client._run import Run, init

__all__ = ["TrainmonCallback"]


class TrainmonCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """Report a Keras ``fit`` to the node's trainmon exporter.

    Args:
        run: run id shared by every rank; default as :func:`trainmon_client.init` detects it.
        **init_kwargs: passed to :func:`trainmon_client.init` (``num_params``, ``dtype``...).

    Attributes:
        run: the :class:`~trainmon_client.Run` from ``on_train_begin`` on (None before).
    """

    def __init__(self, run: str | None = None, **init_kwargs: Any) -> None:
        super().__init__()
        self.run: Run | None = None
        self._run_id = run
        self._init_kwargs = init_kwargs
        self._step = 0
        self._tracker: Any = None
        self._total = self._count = 0.0
        self._t_event: float | None = None
        self._data_time: float | None = None
        self._evaluation: Operation | None = None

    def on_train_begin(self, logs: Any = None) -> None:
        """Start the run; the step count goes on from the optimizer's."""
        if self.run is None or self.run.closed:
            self.run = init(self._run_id, **self._init_kwargs)
        try:
            self._step = int(self.model.optimizer.iterations)
            self._tracker = next((m for m in self.model.metrics if m.name == "loss"), None)
        except Exception:
            self.run.count_internal_error()

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        """The epoch's first batch is fetched from here."""
        self._t_event = time.perf_counter()

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        """The time since the previous batch's end was its fetch."""
        if self._t_event is not None:
            self._data_time = time.perf_counter() - self._t_event

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        """Send the step: the batch's loss, lr, samples and data time."""
        self._t_event = time.perf_counter()
        run = self.run
        if run is None:
            return
        self._step += 1
        metrics: dict[str, Any] = {}
        try:
            tracker = self._tracker
            if tracker is not None:
                total, count = float(tracker.total), float(tracker.count)
                if count < self._count:  # the metrics were reset: a new epoch
                    self._total = self._count = 0.0
                if count > self._count:
                    metrics["loss"] = (total - self._total) / (count - self._count)
                    metrics["samples"] = round(count - self._count)
                self._total, self._count = total, count
            elif logs and "loss" in logs:
                metrics["loss"] = logs["loss"]
            metrics["lr"] = float(self.model.optimizer.learning_rate)
        except Exception:
            run.count_internal_error()
        if self._data_time is not None:
            metrics["data_time"] = self._data_time
            self._data_time = None
        run.log(self._step, **metrics)

    def on_test_begin(self, logs: Any = None) -> None:
        """Time an evaluation inside ``fit`` (validation)."""
        if self.run is not None and self._evaluation is None:
            self._evaluation = self.run.track("evaluation")
            self._evaluation.start()

    def on_test_end(self, logs: Any = None) -> None:
        """Stop timing the evaluation."""
        if self._evaluation is not None:
            self._evaluation.stop()
            self._evaluation = None
        if self._t_event is not None:
            self._t_event = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        """Send the epoch's ``val_*`` results as an evaluation."""
        if self.run is None or not logs:
            return
        values = {k: v for k, v in logs.items() if k.startswith("val_")}
        values = {("val_loss" if k == "val_loss" else k[4:]): v for k, v in values.items()}
        if values:
            self.run.eval(self._step, **values)

    def on_train_end(self, logs: Any = None) -> None:
        """Finish the run."""
        if self.run is not None:
            self.run.finish()
