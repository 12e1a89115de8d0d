"""torchtitan's metrics processor with the trainmon logger, built and fed by torchtitan's code.

A whole torchtitan run cannot run here. torchtitan 0.3.0 takes the accelerator as its device
(``torch._utils._get_available_device_type() or "cuda"``): on a machine without one its
trainer, its memory monitor and the model's placement use CUDA, which the CPU build of torch
lacks; and its wheel has no tokenizer or data set (the debug config reads ``tests/assets`` of
torchtitan's repository). So the job's ``Trainer.Config`` comes from a config function through
torchtitan's ``ConfigManager`` (its command line, with an override of the processor's
``log_freq``); the processor from ``config.metrics.build(...)`` with the trainer's arguments;
and a real torch loop on real bytes feeds it as the trainer does: batches through
``Trainer.batch_generator`` (which counts the tokens and times the fetches), torchtitan's
optimizer and lr scheduler containers, its ``clip_grad_norm_``, and ``log`` on
``should_log`` steps with the lr metrics read before the step. The CUDA memory statistics come
from a fake at torchtitan's device-module boundary. Against a real exporter. Needs
``requirements-frameworks.txt``; skips without torchtitan.
"""

from __future__ import annotations

import inspect
import json
import time
import warnings
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from trainmon_client._autorun import Instrumenter

from ..conftest import InProcessExporter, sample, wait_for

torch = pytest.importorskip("torch")
with warnings.catch_warnings():  # torch.utils.mkldnn's, imported by torchtitan's modules
    warnings.simplefilter("ignore", DeprecationWarning)
    metrics = pytest.importorskip("torchtitan.components.metrics")
    pytest.importorskip(
        "triton", reason="torchtitan's trainer imports it (CUDA builds of torch bring it)"
    )
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.trainer import Trainer
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

GIB = 1024**3
STATS = {
    "active_bytes.all.peak": 3 * GIB,
    "reserved_bytes.all.peak": 5 * GIB,
    "num_alloc_retries": 2,
    "num_ooms": 0,
}


class FakeCudaMemory:
    """The ``torch.cuda`` functions torchtitan's ``DeviceMemoryMonitor`` calls."""

    def get_device_name(self, device: Any = None) -> str:
        return "NVIDIA H100 80GB HBM3"

    def current_device(self) -> int:
        return 0

    def get_device_properties(self, device: Any = None) -> Any:
        return SimpleNamespace(total_memory=80 * GIB)

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return dict(STATS)


def trainmon_debugmodel() -> Any:
    """A config function as a job writes one: torchtitan's debug model, trainmon's processor."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from trainmon_client.torchtitan import TrainmonMetricsProcessor

    config = llama3_debugmodel()
    config.metrics = TrainmonMetricsProcessor.Config(log_freq=10, run="titan")
    return config


def build(monkeypatch: pytest.MonkeyPatch, *args: str, pp: int = 1) -> tuple[Any, Any]:
    """The job's config through torchtitan's command line; the processor as the trainer does."""
    monkeypatch.setattr(metrics, "device_module", FakeCudaMemory())
    argv = ["--module", __name__, "--config", "trainmon_debugmodel", *args]
    config = ConfigManager().parse_args(argv)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=pp, ep=1, world_size=pp)
    processor = config.metrics.build(
        parallel_dims=dims,
        dump_folder=config.dump_folder,
        pp_schedule=config.parallelism.pipeline_parallel_schedule,
        config_dict=config.to_dict(),
        has_quantization=False,
    )
    return config, processor


def batches(batch: int = 4, seq: int = 32) -> Iterator[tuple[dict[str, Any], Any]]:
    data = torch.frombuffer(bytearray(inspect.getsource(json).encode()), dtype=torch.uint8)
    tokens = data.long()
    for i in range(0, len(tokens) - batch * seq - 1, batch * seq):
        x = tokens[i : i + batch * seq + 1]
        yield {"input": x[:-1].view(batch, seq)}, x[1:].view(batch, seq)


def train(config: Any, processor: Any) -> list[tuple[int, dict[str, float]]]:
    """``Trainer.train``/``train_step`` of one rank, without parallelism; what was logged."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(256, 32), torch.nn.Linear(32, 256))
    optimizers = config.optimizer.build(model_parts=[model])
    schedulers = config.lr_scheduler.build(
        optimizers=optimizers, training_steps=config.training.steps
    )
    processor.num_flops_per_token = 6 * sum(p.numel() for p in model.parameters())
    processor.optimizers, processor.model_parts = optimizers, [model]
    data = Trainer.batch_generator(SimpleNamespace(metrics_processor=processor), batches())
    logged = []
    seen = 0
    for step in range(1, config.training.steps + 1):
        optimizers.zero_grad()
        lr_metrics = schedulers.get_metrics()
        should_log = processor.should_log(step)
        inputs, labels = next(data)
        seen += labels.numel()
        logits = model(inputs["input"])
        loss_sum = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), reduction="sum"
        )
        loss = loss_sum / labels.numel()  # local sum / global valid tokens, one rank
        loss.backward()
        grad_norm = dist_utils.clip_grad_norm_(
            list(model.parameters()), config.training.max_norm, foreach=True
        )
        optimizers.step()
        schedulers.step()
        time.sleep(0.01)
        if should_log:
            values = {"loss": loss.item(), "grad_norm": grad_norm.item(), **lr_metrics}
            processor.log(
                step,
                values["loss"],
                values["loss"],
                values["grad_norm"],
                extra_metrics={"n_tokens_seen": seen, **lr_metrics},
            )
            logged.append((step, values))
    return logged


def finished(exporter: InProcessExporter, run: str, status: str = "finished") -> None:
    wait_for(lambda: (r := exporter.rank(run, 0)) is not None and r["status"] == status)


def test_every_logged_step_with_torchtitans_values(
    exporter: InProcessExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, processor = build(monkeypatch, "--metrics.log_freq", "2", "--training.steps", "6")
    assert type(processor).__name__ == "TrainmonMetricsProcessor"  # the CLI kept its config
    assert processor.config.log_freq == 2 and processor.config.run == "titan"
    logged = train(config, processor)
    assert [step for step, _ in logged] == [1, 2, 4, 6]  # torchtitan's should_log
    processor.log_validation(loss=2.5, step=6)  # as torchtitan's Validator.validate ends
    run = processor.trainmon.run
    processor.close()
    finished(exporter, "titan")
    assert run.dropped == dict.fromkeys(run.dropped, 0)
    assert (run.refused, run.internal_errors) == (0, 0)
    assert run.flops_per_token == processor.num_flops_per_token
    m = exporter.metrics()
    lbl = {"run": "titan", "rank": "0"}
    last = logged[-1][1]
    assert sample(m, "trainmon_train_steps_total", **lbl) == 4
    assert sample(m, "trainmon_train_step", **lbl) == 6
    assert sample(m, "trainmon_train_loss", **lbl) == pytest.approx(last["loss"])
    assert sample(m, "trainmon_train_grad_norm", **lbl) == pytest.approx(last["grad_norm"])
    assert sample(m, "trainmon_train_learning_rate", **lbl) == pytest.approx(last["lr/AdamW"])
    assert sample(m, "trainmon_train_tokens_total", **lbl) == 6 * 4 * 32  # every step's
    assert sample(m, "trainmon_train_allocator_retries_total", **lbl) == 2
    custom = {
        name: sample(m, "trainmon_train_custom_value", name=name, **lbl)
        for name in ("n_tokens_seen", "memory_max_reserved_GiB", "throughput_tps", "mfu_pct")
    }
    assert custom["n_tokens_seen"] == 6 * 4 * 32
    assert custom["memory_max_reserved_GiB"] == 5.0
    assert custom["throughput_tps"] and custom["throughput_tps"] > 0
    assert custom["mfu_pct"] and custom["mfu_pct"] > 0
    assert sample(m, "trainmon_eval_loss", **lbl) == 2.5
    assert sample(m, "trainmon_eval_value", name="memory_max_reserved_GiB", **lbl) == 5.0
    dropped = [v for (name, _), v in m.items() if name == "trainmon_ingest_values_dropped_total"]
    assert sum(dropped) == 0


def test_under_trainmon_run_the_processor_takes_over_from_the_hooks(
    exporter: InProcessExporter, monkeypatch: pytest.MonkeyPatch, hooks: Instrumenter
) -> None:
    """The hooks would count every optimizer step, with each rank's share of the loss."""
    config, processor = build(monkeypatch, "--metrics.log_freq", "3", "--training.steps", "6")
    assert not hooks.active and hooks.framework == "torchtitan"
    logged = train(config, processor)
    processor.close()
    finished(exporter, "titan")
    m = exporter.metrics()
    lbl = {"run": "titan", "rank": "0"}
    assert [step for step, _ in logged] == [1, 3, 6]
    assert sample(m, "trainmon_train_steps_total", **lbl) == 3  # not the 6 optimizer steps
    assert sample(m, "trainmon_train_loss", **lbl) == pytest.approx(logged[-1][1]["loss"])
    assert len(exporter.runs()["runs"]) == 1


def test_a_pipeline_stage_without_the_loss_sends_none_and_an_exception_fails_the_run(
    exporter: InProcessExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 of two pipeline stages (1F1B): torchtitan's loss there is a placeholder."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    _, processor = build(monkeypatch, "--parallelism.pipeline_parallel_schedule", "1F1B", pp=2)
    processor.num_flops_per_token = 1000
    processor.ntokens_since_last_log = 64
    processor.data_loading_times.append(0.01)
    processor.log(1, -1.0, -1.0, 0.75, extra_metrics={"lr/AdamW": 1e-3})
    try:
        raise RuntimeError("Loss is not finite")
    except RuntimeError:
        processor.close()  # as torchtitan's train.py closes the trainer before re-raising
    finished(exporter, "titan", "failed")
    m = exporter.metrics()
    lbl = {"run": "titan", "rank": "0"}
    assert sample(m, "trainmon_train_loss", **lbl) is None
    assert sample(m, "trainmon_train_grad_norm", **lbl) == 0.75
    assert sample(m, "trainmon_train_steps_total", **lbl) == 1
