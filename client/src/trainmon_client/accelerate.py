"""Hugging Face Accelerate integration: ``Accelerator(log_with=TrainmonTracker())``.

Importing this module imports ``accelerate``; ``import trainmon_client`` never does.

Accelerate's extension point for metric backends is the ``GeneralTracker``: every
``accelerator.log(values, step=...)`` reaches the tracker's ``log``. This one reports from
every process (``main_process_only = False``), each with its rank from Accelerate's
``PartialState`` (``process_index``, ``local_process_index``, ``num_processes``):

- ``loss`` (also ``train_loss``, ``train/loss``), ``lr`` (also ``learning_rate``),
  ``grad_norm``, and any other numeric value under its own name, as one step
  (:meth:`Run.log`) at ``step`` (or counting from 0 when the loop gives none);
- names starting with ``eval_``, ``val_``, ``eval/`` or ``val/`` as an evaluation
  (:meth:`Run.eval`; ``eval_loss`` and ``val_loss`` as ``val_loss``).

What a tracker is not given, it cannot report: data-loading time and checkpoints. Run the
script under ``trainmon-run`` for those: the hooks then report the steps (with data time and
``save_state``/``load_state`` checkpoints), and this tracker, finding them, sends only the
evaluation values, through the hooks' run, so that no step is counted twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from accelerate.state import PartialState
from accelerate.tracking import GeneralTracker

from trainmon_client import _autorun
from trainmon_client._run import Run, init

__all__ = ["TrainmonTracker"]

_LOSS = ("loss", "train_loss", "train/loss")
_LR = ("lr", "learning_rate", "train/lr", "train/learning_rate")
_EVAL = ("eval_", "val_", "eval/", "val/")


class TrainmonTracker(GeneralTracker):  # type: ignore[misc]
    """Report ``accelerator.log()`` to the node's trainmon exporter, from every process.

    Example:
        >>> from trainmon_client.accelerate import TrainmonTracker  # doctest: +SKIP
        >>> accelerator = Accelerator(log_with=TrainmonTracker())
        >>> accelerator.init_trackers("my-project")

    Args:
        run: run id shared by every rank; default as :func:`trainmon_client.init` detects it.
        **init_kwargs: passed to :func:`trainmon_client.init` (``num_params``, ``dtype``...).

    Attributes:
        run: the :class:`~trainmon_client.Run` from ``init_trackers`` on (None before, and
            under ``trainmon-run``, where the hooks' run is used).
    """

    name = "trainmon"
    requires_logging_directory = False
    main_process_only = False

    def __init__(self, run: str | None = None, **init_kwargs: Any) -> None:
        super().__init__()
        self.run: Run | None = None
        self._run_id = run
        self._init_kwargs = init_kwargs
        self._hooks: Any = None
        self._step = 0

    @property
    def tracker(self) -> Run | None:
        """The run (Accelerate's name for a backend's own object)."""
        return self.run

    def start(self) -> None:
        """Start the run (``init_trackers``) unless trainmon-run's hooks report the steps."""
        ins = _autorun.current()
        if ins is not None and ins.active:
            self._hooks = ins
            return
        if self.run is None or self.run.closed:
            state = PartialState()
            self.run = init(
                self._run_id,
                rank=state.process_index,
                local_rank=state.local_process_index,
                world_size=state.num_processes,
                **self._init_kwargs,
            )

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Hyperparameters are not metrics: nothing is sent."""

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """One step's values, or an evaluation's (names with an ``eval``/``val`` prefix)."""
        if step is None:
            step = self._step
        self._step = step + 1
        metrics: dict[str, Any] = {}
        evaluation: dict[str, Any] = {}
        for key, value in values.items():
            if isinstance(value, (str, bytes, bool)) or value is None:
                continue
            prefix = next((p for p in _EVAL if key.startswith(p)), None)
            if prefix is not None:
                name = key[len(prefix) :].replace("/", "_")
                evaluation["val_loss" if name == "loss" else name] = value
            elif key in _LOSS:
                metrics["loss"] = value
            elif key in _LR:
                metrics["lr"] = value
            else:
                metrics[key] = value
        hooks = self._hooks
        if hooks is not None:  # trainmon-run's hooks send the steps
            if evaluation and hooks.run is not None:
                hooks.run.eval(step, **evaluation)
            return
        if self.run is None:
            return
        if metrics:
            self.run.log(step, **metrics)
        if evaluation:
            self.run.eval(step, **evaluation)

    def finish(self) -> None:
        """End the run (``accelerator.end_training()``)."""
        if self.run is not None:
            self.run.finish()
