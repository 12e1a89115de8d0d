"""A node over its sample budget stays up: a real Prometheus scrapes a real exporter with the
same ``sample_limit`` as the exporter's ``scrape_sample_limit``.

Four one-GPU runs each watch a 12-layer model (``Run.watch`` with activations and quantiles:
15 series a layer, on rank 0 of every run, the default ``layer_ranks``) on an exporter that
samples 4 GPUs of the compiled fake ``libnvidia-ml.so.1``. Their series together pass the
limit of 1,000 samples. Without the budget Prometheus would refuse every scrape (``up`` 0, the
node's series gone); with it the exporter leaves out per-layer series, counts them, and
Prometheus keeps every run's health series and every GPU's telemetry.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

import trainmon_client
from trainmon_exporter.state.admission import SERIES_PER_LAYER

from ..conftest import ExporterProcess, child_env, free_port, sample, short_tmpdir, wait_for
from ..fakes.libnvml import CONFIG_ENV, build, h100, write_config
from .stack import Processes, query, require_binaries

pytestmark = pytest.mark.slow

LIMIT = 1000
RUNS = 4
LAYERS = 12


def _model() -> tuple[object, object]:
    import torch

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(8, 8), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def _train(run: trainmon_client.Run, steps: int = 6) -> None:
    import torch

    model, opt = _model()
    run.watch(model, opt, every=1, quantiles_every=1, activations=True, budget=1.0)
    for i in range(steps):
        loss = model(torch.randn(4, 8)).pow(2).mean()  # type: ignore[operator]
        opt.zero_grad()  # type: ignore[attr-defined]
        loss.backward()
        opt.step()  # type: ignore[attr-defined]
        run.log(i, loss=loss.item(), tokens=512, grad_norm=0.5)
        run.eval(i, val_loss=1.0, val_accuracy=0.5)


def test_a_node_over_its_sample_limit_keeps_its_run_health_and_gpu_series(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torch", reason="Run.watch needs torch")
    require_binaries("prometheus", package="prometheus")
    lib = build(tmp_path / "nvml")
    cfg = tmp_path / "gpus.conf"
    gpus = [h100(i, procs=f"{os.getpid()}:{2**30}") for i in range(RUNS)]
    write_config(cfg, gpus)
    env = child_env(LD_LIBRARY_PATH=str(lib.parent), **{CONFIG_ENV: str(cfg)})
    sock_dir = short_tmpdir()
    ex = ExporterProcess(
        sock_dir / "t.sock",
        free_port(),
        "--nvml-interval-seconds",
        "0.2",
        "--scrape-sample-limit",
        str(LIMIT),
        env=env,
    ).start()
    procs = Processes(tmp_path)
    runs: list[trainmon_client.Run] = []
    try:
        wait_for(lambda: sample(ex.metrics(), "trainmon_gpu_devices") == RUNS, timeout=20)
        for r in range(RUNS):
            run = trainmon_client.init(
                run=f"job-{r}",
                rank=0,
                world_size=1,
                socket_path=ex.socket,
                gpu_uuid=str(gpus[r]["uuid"]),
                flush_interval=0.0,
            )
            runs.append(run)
            _train(run)

        def shed(m: dict[object, float], cls: str) -> float | None:
            return sample(m, "trainmon_exporter_series_shed", **{"class": cls})

        wait_for(lambda: (shed(ex.metrics(), "layer") or 0) > 0, timeout=20)
        m = ex.metrics()
        sent = sample(m, "trainmon_exporter_samples")
        layer_shed = shed(m, "layer")
        assert sent is not None and layer_shed is not None
        assert len(m) == sent <= LIMIT  # every sample line counted, none past the limit
        assert sent + layer_shed > LIMIT  # without shedding, Prometheus would refuse the scrape
        for cls in ("custom", "evaluation", "operation", "rank", "node"):
            assert shed(m, cls) == 0, cls

        target = f"127.0.0.1:{ex.port}"
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [
                {
                    "job_name": "trainmon",
                    "sample_limit": LIMIT,
                    "static_configs": [{"targets": [target]}],
                }
            ],
        }
        url = procs.prometheus(config, "prometheus")
        wait_for(lambda: query(url, "count_over_time(up[1m]) >= 5"), timeout=60, interval=0.5)
        for run in runs:  # keep the ranks connected while Prometheus scrapes
            run.log(100, loss=1.0, tokens=512)
        time.sleep(1.5)

        def values(expr: str) -> list[float]:
            return [float(r["value"][1]) for r in query(url, expr)]

        assert values("min_over_time(up[1m])") == [1.0]  # no scrape was refused
        assert max(values("max_over_time(scrape_samples_scraped[1m])")) <= LIMIT
        for name in (
            "trainmon_run_up",
            "trainmon_train_step",
            "trainmon_train_hung",
            "trainmon_run_crashes_total",
        ):
            got = {r["metric"]["run"] for r in query(url, name)}
            assert got == {f"job-{r}" for r in range(RUNS)}, name
        nonfinite = query(url, 'trainmon_train_nonfinite_values_total{field="loss"}')
        assert len(nonfinite) == RUNS
        for name in ("trainmon_gpu_utilization_ratio", "trainmon_gpu_power_usage_watts"):
            assert len(query(url, name)) == RUNS, name
        # Per-layer series are what went: fewer than every run's layers, and counted.
        layers = len(query(url, "{__name__=~'trainmon_layer_.+'}"))
        shed_now = values('trainmon_exporter_series_shed{class="layer"}')
        assert shed_now and shed_now[0] > 0
        assert layers > 0 and layers + shed_now[0] == RUNS * LAYERS * SERIES_PER_LAYER
        evaluated = {r["metric"]["run"] for r in query(url, "trainmon_eval_value")}
        assert evaluated == {f"job-{r}" for r in range(RUNS)}  # the next class, kept
    except BaseException:
        procs.dump()
        raise
    finally:
        procs.stop()
        for run in runs:
            run.finish()
        ex.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
