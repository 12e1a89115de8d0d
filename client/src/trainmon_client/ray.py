"""Ray Train integration: ``RunConfig(callbacks=[TrainmonCallback()])``.

Importing this module imports ``ray``; ``import trainmon_client`` never does. Written against
Ray Train's ``ray.train.UserCallback`` (Ray Train V2, the default since Ray 2.51): Ray calls
its ``after_report`` on the controller process with the metrics **every** worker passed to
``ray.train.report``, ``metrics[i]`` being worker ``i``'s. The callback keeps one
:class:`~trainmon_client.Run` per worker, each with that worker's world rank, so every rank is
its own series:

- ``step``: the worker's ``step``, ``global_step``, ``iteration`` or ``training_iteration``
  value, else its reports counted from 1;
- ``loss`` (also ``train_loss``), ``lr`` (also ``learning_rate``), ``grad_norm``,
  ``data_time``, ``tokens``, ``samples`` and any other number under its own name, as
  :meth:`Run.log`; names starting with ``val_`` or ``eval_`` as :meth:`Run.eval`;
- a checkpoint reported with the metrics: :meth:`Run.checkpoint` of every rank at its step
  (its duration is the workers', unknown to the controller).

A worker's exception finishes that rank's run as failed (``after_exception``). Ray gives a
``UserCallback`` no end of training: the runs finish when the controller's process exits.

Under ``trainmon-run`` the Ray workers inherit its environment and report themselves through
its hooks, with more than a report carries (data time, checkpoints' durations); this callback
then sends nothing, so that no step is counted twice.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ray.train import UserCallback

from trainmon_client._env import detect_run_id
from trainmon_client._run import Run, init

__all__ = ["TrainmonCallback"]

_STEP = ("step", "global_step", "iteration", "training_iteration")
_RENAMED = {"train_loss": "loss", "learning_rate": "lr"}


class TrainmonCallback(UserCallback):  # type: ignore[misc]
    """Report every Ray Train worker's ``ray.train.report`` metrics, each under its rank.

    Example:
        >>> from trainmon_client.ray import TrainmonCallback  # doctest: +SKIP
        >>> trainer = TorchTrainer(loop, run_config=RunConfig(callbacks=[TrainmonCallback()]))

    Args:
        run: run id of every rank; default ``TRAINMON_RUN``, else the Ray run's name, else
            generated as :func:`trainmon_client.init` does.
        **init_kwargs: passed to :func:`trainmon_client.init` (``num_params``, ``dtype``...).

    Attributes:
        runs: one :class:`~trainmon_client.Run` per worker rank, from its first report.
    """

    def __init__(self, run: str | None = None, **init_kwargs: Any) -> None:
        self.runs: dict[int, Run] = {}
        self._run_id = run
        self._init_kwargs = init_kwargs
        self._counts: dict[int, int] = {}
        self._off = os.environ.get("TRAINMON_AUTORUN") == "1"  # trainmon-run's hooks report

    def _run(self, run_context: Any, rank: int, world: int) -> Run:
        run = self.runs.get(rank)
        if run is None or run.closed:
            run_id = self._run_id or os.environ.get("TRAINMON_RUN")
            if not run_id:
                try:
                    run_id = str(run_context.get_run_config().name or "") or None
                except Exception:
                    run_id = None
            run = init(
                run_id or detect_run_id(world),
                rank=rank,
                local_rank=rank,
                world_size=world,
                **self._init_kwargs,
            )
            self.runs[rank] = run
        return run

    def after_report(
        self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any = None
    ) -> None:
        """Send each worker's report as its rank's step (and the checkpoint, if any)."""
        if self._off:
            return
        world = len(metrics)
        for rank, reported in enumerate(metrics):
            run = self._run(run_context, rank, world)
            try:
                self._send(run, rank, reported, checkpoint is not None)
            except Exception:
                run.count_internal_error()

    def _send(self, run: Run, rank: int, reported: Mapping[str, Any], checkpoint: bool) -> None:
        step = next(
            (v for k in _STEP if isinstance(v := reported.get(k), int) and not isinstance(v, bool)),
            None,
        )
        if step is None:
            step = self._counts.get(rank, 0) + 1
        self._counts[rank] = step
        values: dict[str, Any] = {}
        evaluation: dict[str, Any] = {}
        for key, value in reported.items():
            if key in _STEP or isinstance(value, (bool, str, bytes)) or value is None:
                continue
            if not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
                continue
            if key.startswith(("val_", "eval_")):
                name = key.split("_", 1)[1]
                evaluation["val_loss" if name == "loss" else name] = value
            else:
                values[_RENAMED.get(key, key)] = value
        if values:
            run.log(step, **values)
        if evaluation:
            run.eval(step, **evaluation)
        if checkpoint:
            run.checkpoint(step)

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        """Finish the failed workers' runs as failed."""
        for rank in worker_exceptions:
            run = self.runs.get(rank)
            if run is not None:
                run.finish(failed=True)
