"""Settings: environment, flags, validation."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from trainmon_exporter.cli import load_settings


def test_defaults() -> None:
    s = load_settings([])
    assert (s.host, s.port) == ("127.0.0.1", 9478)
    assert s.socket == Path("/run/trainmon/trainmon.sock")
    assert s.collectors.training and s.collectors.exporter


def test_environment_then_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINMON_LISTEN", "0.0.0.0:9999")
    monkeypatch.setenv("TRAINMON_SERIES_TTL_SECONDS", "30")
    monkeypatch.setenv("TRAINMON_COLLECTORS__PROCESS", "false")
    s = load_settings(["--listen", "127.0.0.1:1234", "--socket", "/tmp/x.sock"])
    assert s.listen == "127.0.0.1:1234" and s.series_ttl_seconds == 30
    assert s.socket == Path("/tmp/x.sock") and s.collectors.process is False
    assert load_settings(["--no-collectors.training"]).collectors.training is False


@pytest.mark.parametrize(
    "argv",
    [
        ["--listen", "9478"],
        ["--listen", "host:99999"],
        ["--series-ttl-seconds", "0"],
        ["--socket-mode", "999"],
        ["--log-level", "loud"],
        ["--step-duration-buckets", "[1, 0.5]"],
        ["--max-ranks", "0"],
    ],
)
def test_invalid_values_are_rejected(argv: list[str]) -> None:
    with pytest.raises(ValidationError):
        load_settings(argv)
