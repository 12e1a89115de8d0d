"""torchtitan integration: its metrics processor, with a trainmon logger beside TensorBoard/W&B.

In the job's config function (a ``config_registry`` function returning a ``Trainer.Config``)::

    from trainmon_client.torchtitan import TrainmonMetricsProcessor

    config.metrics = TrainmonMetricsProcessor.Config(log_freq=10)  # and the other fields

torchtitan (0.3.0) has no registry of metric loggers: the trainer builds its
``MetricsProcessor`` from ``Trainer.Config.metrics`` with ``config.metrics.build(parallel_dims=,
dump_folder=, pp_schedule=, config_dict=, has_quantization=)``, and the processor's
``_build_metric_logger`` builds the loggers (TensorBoard, W&B) its ``log`` calls with
``log(metrics, step)`` every ``log_freq`` steps, and ``close()`` at the end. The processor
here is torchtitan's own with a :class:`TrainmonLogger` added, on **every** rank (torchtitan's
other loggers stay on the rank it logs from). Importing this module imports nothing of
torchtitan; the processor class is made at its first use.

What each logged step sends (:meth:`Run.log`; the step is torchtitan's): ``loss`` (the global
per-token average, ``loss_metrics/global_avg_loss``), ``grad_norm`` (before clipping), ``lr``
(the first optimizer's, ``lr/<Optimizer>``), ``tokens`` (this device's since the previous log,
as torchtitan counts them for its tokens per second), ``data_time`` (every batch fetch since
the previous log, summed), ``alloc_retries`` and ``ooms``, and every other key under its name
with ``/`` and brackets as ``_`` (``mfu(%)`` is ``mfu_pct``, ``memory/max_reserved(GiB)`` is
``memory_max_reserved_GiB``). The FLOPs per token torchtitan computes for its MFU go to the
exporter for its own. Validation (``validation_metrics/...``) goes to :meth:`Run.eval`
(``loss`` as ``val_loss``). Under pipeline parallelism only the rank torchtitan logs the loss
from sends ``loss``: the other stages log a placeholder. Checkpoints and validation time are not
given to a metrics processor: not reported.

Under ``trainmon-run`` the logger takes over from the PyTorch hooks in its process: the loss a
torchtitan rank calls ``backward()`` on is its share of the global sum (its tokens' loss
divided by the global token count), and its gradient norm is not ``clip_grad_norm_``'s.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping
from typing import Any

from trainmon_client import _autorun
from trainmon_client._env import _process_start
from trainmon_client._run import Run, init

__all__ = ["TrainmonLogger", "TrainmonMetricsProcessor"]  # noqa: F822 (made by __getattr__)

_FIELDS = {
    "loss_metrics/global_avg_loss": "loss",
    "grad_norm": "grad_norm",
    "memory/num_alloc_retries": "alloc_retries",
    "memory/num_ooms": "ooms",
}
_COUNTS = ("memory/num_alloc_retries", "memory/num_ooms")
_LOSSES = ("loss_metrics/global_avg_loss", "loss_metrics/global_max_loss")
_VALIDATION = "validation_metrics/"


def _name(key: str) -> str:
    """``memory/max_reserved(GiB)`` -> ``memory_max_reserved_GiB``; ``mfu(%)`` -> ``mfu_pct``."""
    key = key.replace("(%)", "_pct").replace("(", "_").replace(")", "")
    return "".join(c if c.isascii() and (c.isalnum() or c in "_.:-") else "_" for c in key)


class TrainmonLogger:
    """A torchtitan metric logger (``log(metrics, step)``, ``close()``) reporting to trainmon.

    Args:
        run: run id; default as :func:`trainmon_client.init` detects it (``TRAINMON_RUN``,
            torchrun's run id, the Slurm job).
        **init_kwargs: passed to :func:`trainmon_client.init` (``dtype``...); rank, local
            rank and world size come from the launcher's environment.

    Attributes:
        run: the :class:`~trainmon_client.Run` (started at construction, with the process's
            start time; under ``trainmon-run``, the hooks' run if they had started one).
        loss: False where torchtitan's loss is a placeholder (pipeline stages without it).
        window: what the processor adds to the next step (``tokens``, ``data_time``).
        flops_per_token: torchtitan's, for the exporter's MFU (set before the first step).
    """

    def __init__(self, run: str | None = None, **init_kwargs: Any) -> None:
        ins = _autorun.current()
        handed = ins.take_over("torchtitan") if ins is not None and ins.active else None
        if handed is None:
            init_kwargs.setdefault("started_at", _process_start(os.getpid()))
        self.run: Run = handed if handed is not None else init(run, **init_kwargs)
        self.loss = True
        self.window: dict[str, float] = {}
        self.flops_per_token: float | None = None
        self._names: dict[str, str] = {}
        self._logged = False

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """One logged step (or validation) of torchtitan's ``MetricsProcessor``; never raises."""
        try:
            self._log(metrics, step)
        except Exception:
            self.run.count_internal_error()

    def _log(self, metrics: Mapping[str, Any], step: int) -> None:
        values: dict[str, Any] = {}
        evaluation: dict[str, Any] = {}
        for key, value in metrics.items():
            if isinstance(value, (str, bytes, bool)) or value is None:
                continue
            if key.startswith(_VALIDATION):
                name = key[len(_VALIDATION) :]
                evaluation["val_loss" if name == "loss" else self._custom(name)] = value
            elif key in _LOSSES and not self.loss:
                continue
            elif key in _FIELDS:
                if key in _COUNTS and value < 0:  # torchtitan's -1: no allocator statistics
                    continue
                values[_FIELDS[key]] = value
            elif key.startswith("lr/") and "lr" not in values:
                values["lr"] = value
            else:
                values[self._custom(key)] = value
        if evaluation:
            self.run.eval(step, **evaluation)
        if not values:
            return
        if not self._logged:  # nothing is sent before the first step: the HELLO carries it
            self._logged = True
            flops = self.flops_per_token
            if self.run.flops_per_token is None and flops and math.isfinite(flops) and flops > 0:
                self.run.flops_per_token = float(flops)
        window, self.window = self.window, {}
        self.run.log(step, **window, **values)

    def _custom(self, key: str) -> str:
        name = self._names.get(key)
        if name is None:
            name = self._names[key] = _name(key)
        return name

    def close(self) -> None:
        """Finish the run: failed when torchtitan closes while an exception is handled."""
        self.run.finish(failed=sys.exc_info()[0] is not None)


def _processor_class() -> type:
    from dataclasses import dataclass

    from torchtitan.components.metrics import (
        LoggerContainer,
        MetricsProcessor,
        _get_metrics_rank,
    )

    class TrainmonMetricsProcessor(MetricsProcessor):  # type: ignore[misc]
        """torchtitan's ``MetricsProcessor``, its loggers and a :class:`TrainmonLogger`."""

        @dataclass(kw_only=True, slots=True)
        class Config(MetricsProcessor.Config):  # type: ignore[misc]
            run: str | None = None
            """trainmon run id (default: ``TRAINMON_RUN``, torchrun's run id, the Slurm job)"""

            dtype: str = "bf16"
            """dtype trainmon judges MFU against (torchtitan's own MFU uses the bf16 peak)"""

        def _build_metric_logger(self, *, config: Any, **kwargs: Any) -> Any:
            loggers = LoggerContainer()
            loggers.add_logger(super()._build_metric_logger(config=config, **kwargs))
            self.trainmon = TrainmonLogger(config.run, dtype=config.dtype)
            try:
                dims = kwargs["parallel_dims"]
                if dims.pp_enabled:
                    self.trainmon.loss = self.trainmon.run.rank == _get_metrics_rank(
                        parallel_dims=dims, pp_schedule=kwargs["pp_schedule"]
                    )
            except Exception:
                self.trainmon.run.count_internal_error()
            loggers.add_logger(self.trainmon)
            return loggers

        def log(self, step: int, *args: Any, **kwargs: Any) -> None:
            tm = self.trainmon
            try:  # read before torchtitan's log() resets them
                tokens = self.ntokens_since_last_log / self.parallel_dims.non_data_parallel_size
                tm.window = {"tokens": tokens, "data_time": sum(self.data_loading_times)}
                tm.flops_per_token = self.num_flops_per_token
            except Exception:
                tm.run.count_internal_error()
            super().log(step, *args, **kwargs)

    TrainmonMetricsProcessor.__module__ = __name__
    TrainmonMetricsProcessor.__qualname__ = "TrainmonMetricsProcessor"
    TrainmonMetricsProcessor.Config.__module__ = __name__
    TrainmonMetricsProcessor.Config.__qualname__ = "TrainmonMetricsProcessor.Config"
    return TrainmonMetricsProcessor


def __getattr__(name: str) -> Any:
    """``TrainmonMetricsProcessor``, made (importing torchtitan) at its first use."""
    if name == "TrainmonMetricsProcessor":
        cls = globals()[name] = _processor_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
