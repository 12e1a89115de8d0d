"""torchtune's ``metric_logger`` component, built by torchtune's own ``config.instantiate``.

A recipe needs model weights and a tokenizer from a hub, which these machines cannot fetch, so
the logger is built from a recipe-style config by torchtune itself and called as
``full_finetune_single_device`` calls it (``log_config``, ``log_dict`` every step with
``loss``, ``lr``, ``tokens_per_second_per_gpu`` and the clipped norm as a tensor, ``close``),
against a real exporter. Needs ``requirements-frameworks.txt``; skips without torchtune.
"""

from __future__ import annotations

import pytest

from trainmon_client._autorun import Instrumenter

from ..conftest import InProcessExporter, sample, wait_for

config = pytest.importorskip("torchtune.config")
omegaconf = pytest.importorskip("omegaconf")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_the_recipes_log_dict_becomes_steps(exporter: InProcessExporter) -> None:
    cfg = omegaconf.OmegaConf.create(
        {"metric_logger": {"_component_": "trainmon_client.torchtune.TrainmonLogger", "run": "tt"}}
    )
    logger = config.instantiate(cfg.metric_logger)
    logger.log_config(cfg)
    for step in range(1, 6):
        payload = {
            "loss": 2.0 / step,
            "lr": 1e-4,
            "tokens_per_second_per_gpu": 1000.0 + step,
            "grad_norm": torch.tensor(0.5 * step),
        }
        logger.log_dict(payload, step=step)
    logger.close()
    wait_for(lambda: (r := exporter.rank("tt", 0)) is not None and r["status"] == "finished")
    m = exporter.metrics()
    lbl = {"run": "tt", "rank": "0"}
    assert sample(m, "trainmon_train_steps_total", **lbl) == 5
    assert sample(m, "trainmon_train_loss", **lbl) == pytest.approx(0.4)
    assert sample(m, "trainmon_train_grad_norm", **lbl) == pytest.approx(2.5)
    assert sample(m, "trainmon_train_learning_rate", **lbl) == pytest.approx(1e-4)
    custom = sample(m, "trainmon_train_custom_value", name="tokens_per_second_per_gpu", **lbl)
    assert custom == pytest.approx(1005.0)


def test_under_trainmon_run_the_logger_takes_over_from_the_hooks(
    exporter: InProcessExporter, hooks: Instrumenter
) -> None:
    """A recipe backpropagates the token-summed loss: the hooks' loss would be the wrong one."""
    cfg = omegaconf.OmegaConf.create(
        {"_component_": "trainmon_client.torchtune.TrainmonLogger", "run": "tt2"}
    )
    logger = config.instantiate(cfg)
    assert not hooks.active and hooks.framework == "torchtune"
    logger.log_dict({"loss": 1.5}, step=1)
    logger.close()
    wait_for(lambda: (r := exporter.rank("tt2", 0)) is not None and r["status"] == "finished")
