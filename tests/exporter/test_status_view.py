"""The ``trainmon status`` live view at ordinary terminal widths: numbers are never cut."""

from __future__ import annotations

import re
from typing import Any

import pytest
from rich.console import Console

from trainmon_exporter import status

# A number as the view prints it: 1499, 3/8, 0.2345, 41.7%, 1.2e+05.
NUMBER = re.compile(r"\d+(?:[./]\d+)*(?:e[-+]\d+)?%?")


def api_bodies() -> tuple[dict[str, Any], dict[str, Any]]:
    """``/api/v1/runs`` and ``/api/v1/gpus`` bodies shaped as the exporter serves them."""
    ranks = []
    for rank in range(3):
        ranks.append(
            {
                "rank": rank,
                "world_size": 8,
                "hostname": f"gpu-node-{rank + 7}.cluster.example.org",
                "status": ["running", "crashed", "finished"][rank],
                "step": 1499 + 1000 * rank,
                "values": {"loss": None if rank == 1 else 2.3456 + rank},
                "loss_ema": 2.5678,
                "tokens_per_second": 123456.0 + rank,
                "mfu_ratio": 0.417,
                "gpu": rank,
                "health": ["nonfinite_loss"] if rank == 1 else [],
                "events": [{"kind": "loss_spike", "step": 1377}] if rank == 1 else [],
            }
        )
    runs = {"runs": [{"run": "gpt2-medium-finetune", "ranks": ranks}]}
    gpus = {
        "ok": True,
        "driver_version": "550.54.15",
        "lost_total": 0,
        "gpus": [
            {
                "index": i,
                "name": "NVIDIA H100 80GB HBM3",
                "utilization_ratio": 0.93,
                "tensor_active_ratio": 0.61,
                "memory_used_bytes": 71 * 2**30,
                "memory_size_bytes": 80 * 2**30,
                "power_usage_watts": 612.0,
                "temperature_celsius": 67.0,
                "slowdown_reasons": ["hw_thermal_slowdown"] if i == 1 else [],
                "xid_errors": 79 if i == 1 else 0,
            }
            for i in range(3)
        ],
    }
    return runs, gpus


def render(width: int) -> str:
    runs, gpus = api_bodies()
    console = Console(record=True, width=width, color_system=None)
    console.print(status.rich_view(runs, gpus, "http://127.0.0.1:9478"))
    return console.export_text()


def source_numbers() -> set[str]:
    """Every number in every formatted value, header and title the view may show."""
    runs, gpus = api_bodies()
    texts = [*status.rank_rows(runs, gpus), *status.gpu_rows(gpus)]
    found = {n for row in texts for v in row.values() for n in NUMBER.findall(v)}
    headers = [h for _, h, _, _ in (*status._RANK_VIEW, *status._GPU_VIEW)]
    found |= {n for h in [*headers, "http://127.0.0.1:9478"] for n in NUMBER.findall(h)}
    return found


@pytest.mark.parametrize("width", [80, 100, 120, 200])
def test_every_number_on_screen_is_whole(width: int) -> None:
    screen = render(width)
    assert max(len(line) for line in screen.splitlines()) <= width
    cut = [n for n in NUMBER.findall(screen) if n not in source_numbers()]
    assert not cut, f"numbers cut at {width} columns: {cut}\n{screen}"
    # The columns that identify a rank and its progress survive even at 80 columns.
    for value in ("1/8", "1499", "2499", "3499", "crashed", "NaN/Inf", "gpt2-medium-finetune"):
        assert re.search(rf"(?<![\w./]){re.escape(value)}(?![\w./])", screen), (value, screen)
    assert "79" in NUMBER.findall(screen)  # the GPU with XIDs keeps its count


@pytest.mark.parametrize("width", [80, 100])
def test_narrow_terminal_names_hidden_columns(width: int) -> None:
    screen = " ".join(render(width).split())
    assert "hidden for width:" in screen
    # A hidden column's header is gone along with its values, never shown half.
    shown, dropped = status.fit_columns(status._RANK_VIEW, status.rank_rows(*api_bodies()), width)
    assert dropped and all(h in screen for h in dropped)
    assert {k for k, _, _, _ in shown} >= {"run", "rank", "status", "step", "loss"}


def test_wide_terminal_shows_every_column() -> None:
    screen = render(200)
    assert "hidden for width" not in screen
    for _, header, _, _ in status._RANK_VIEW:
        assert header in screen, header
    assert "gpu-node-7.cluster.example.org" in screen and "123456" in screen


def test_every_width_from_40_to_200_keeps_numbers_whole() -> None:
    known = source_numbers()
    for width in range(40, 201, 7):
        screen = render(width)
        cut = [n for n in NUMBER.findall(screen) if n not in known]
        assert not cut, (width, cut)
