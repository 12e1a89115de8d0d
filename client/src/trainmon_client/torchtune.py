"""torchtune integration: a metric logger named in the recipe's config.

    metric_logger:
      _component_: trainmon_client.torchtune.TrainmonLogger
      run: my-finetune          # optional; default as trainmon_client.init() detects it

torchtune's extension point for metric backends is the ``metric_logger`` component: any class
with the methods of ``torchtune.training.metric_logging.MetricLoggerInterface`` (``log``,
``log_dict``, ``log_config``, ``close``), which the recipe builds with
``config.instantiate(cfg.metric_logger)`` and calls every ``log_every_n_steps`` steps with
``log_dict(payload, step=global_step)``. This module imports nothing of torchtune.

What it sends, at each ``log_dict``: ``loss`` (the recipe's per-token loss), ``lr``,
``grad_norm`` (a tensor, copied without a synchronisation), and every other number under its
own name (``tokens_per_second_per_gpu``, the memory statistics). The recipes log from rank 0
only, so only rank 0 is reported; data loading and checkpoints are not given to a logger.

Under ``trainmon-run`` the logger takes over from the PyTorch hooks in its process: a
torchtune recipe calls ``backward()`` on the loss *summed* over the step's tokens and scales the
gradients afterwards, so the loss the hooks would read is the recipe's times the number of
tokens; the logger's is the recipe's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainmon_client import _autorun
from trainmon_client._run import Run, init

__all__ = ["TrainmonLogger"]


class TrainmonLogger:
    """torchtune's ``MetricLoggerInterface``, reporting to the node's trainmon exporter.

    Args:
        run: run id; default as :func:`trainmon_client.init` detects it.
        **init_kwargs: passed to :func:`trainmon_client.init` (``num_params``, ``dtype``...).

    Attributes:
        run: the :class:`~trainmon_client.Run`.
    """

    def __init__(self, run: str | None = None, **init_kwargs: Any) -> None:
        ins = _autorun.current()
        handed = ins.take_over("torchtune") if ins is not None and ins.active else None
        self.run: Run = handed if handed is not None else init(run, **init_kwargs)
        # (the hooks' run, if they had started one, keeps its id; else the logger's own)

    def log(self, name: str, data: Any, step: int) -> None:
        """One value at ``step``."""
        self.log_dict({name: data}, step)

    def log_config(self, config: Any) -> None:
        """The recipe's configuration is not a metric: nothing is sent."""

    def log_dict(self, payload: Mapping[str, Any], step: int) -> None:
        """The recipe's values at ``step``, as one step (:meth:`Run.log`)."""
        values = {
            k.replace("/", "_"): v
            for k, v in payload.items()
            if not isinstance(v, (str, bytes, bool)) and v is not None
        }
        if values:
            self.run.log(step, **values)

    def close(self) -> None:
        """Finish the run (the recipe's cleanup)."""
        self.run.finish()
