"""Settings: environment, flags, validation."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import SettingsError

import trainmon_client._env as client_env
from trainmon_client._env import default_socket
from trainmon_exporter import analytics, settings
from trainmon_exporter.cli import describe_error, describe_settings_error, load_settings
from trainmon_exporter.settings import Settings, environment_names, unknown_environment

from ..conftest import ROOT, ExporterProcess
from ..helpers.checkout import tracked


@pytest.mark.uid
def test_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TRAINMON_SOCKET", raising=False)
    # /run/trainmon stood in for (not there): the host's own is not the test's business.
    system = tmp_path / "run" / "trainmon.sock"
    monkeypatch.setattr(client_env, "DEFAULT_SOCKET", str(system))
    s = load_settings([])
    assert (s.host, s.port) == ("127.0.0.1", 9478)
    # The socket follows the rule the client shares (tests/exporter/test_default_socket.py),
    # which depends on who runs it: root always gets the node-wide path.
    assert s.socket == Path(default_socket())
    if os.geteuid() == 0:
        assert s.socket == system
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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--step-duration-buckets", "[0.1, NaN]"], "finite"),
        (["--step-duration-buckets", "[0.1, Infinity]"], "finite"),
        (["--socket-mode", "0"], "read or write"),
        (["--socket-mode", "0066"], "read or write"),
        (["--socket-mode", "0460"], "read or write"),
        (["--socket-group", "no-such-group-here"], "unknown group"),
        (["--allowed-uids", "no-such-user-here"], "unknown user"),
        (["--allowed-gids", "[1, 2"], "JSON list"),
        (["--log-max-repeats", "0"], "greater than or equal to 1"),
        (["--layer-ranks", "0,x"], "ranks like 0,8-15"),
        (["--layer-ranks", "8-4"], "A <= B"),
        (["--layer-ranks", "0-8:0"], "S >= 1"),
        (["--layer-ranks", ",".join(["1"] * 257)], "at most 256"),
    ],
)
def test_unsafe_or_meaningless_values_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        load_settings(argv)


@pytest.mark.parametrize(
    ("spec", "inside", "outside"),
    [
        ("0", [0], [1, 8]),
        ("all", [0, 7, 1 << 20], []),
        ("none", [], [0, 1]),
        ("0,8-9", [0, 8, 9], [1, 7, 10]),
        ("0-1023:8", [0, 8, 1016], [1, 7, 1023, 1024]),
        (" 3 , 5-5 ", [3, 5], [4, 6]),
    ],
)
def test_layer_ranks_select_ranks(spec: str, inside: list[int], outside: list[int]) -> None:
    ranks = load_settings(["--layer-ranks", spec]).layer_rank_set
    assert all(r in ranks for r in inside), ranks
    assert not any(r in ranks for r in outside), ranks


def test_the_socket_is_not_world_writable_by_default() -> None:
    s = load_settings([])
    assert s.socket_permissions == 0o660 and s.socket_gid is None
    assert (s.allowed_uids, s.allowed_gids) == ((), ())


def test_ids_and_groups_by_name_or_number(monkeypatch: pytest.MonkeyPatch) -> None:
    s = load_settings(["--allowed-uids", "root,7", "--allowed-gids", '["root", 9]'])
    assert (s.allowed_uids, s.allowed_gids) == ((0, 7), (0, 9))
    monkeypatch.setenv("TRAINMON_ALLOWED_UIDS", "1000,1001")  # plain, not JSON, in env too
    monkeypatch.setenv("TRAINMON_SOCKET_GROUP", "root")
    s = load_settings([])
    assert s.allowed_uids == (1000, 1001) and s.socket_gid == 0
    assert load_settings(["--socket-group", "4321"]).socket_gid == 4321  # no name needed


def test_misspelt_environment_variables_name_the_closest_setting() -> None:
    lines = unknown_environment(
        {
            "TRAINMON_SERIES_TTL": "30",
            "TRAINMON_COLLECTORS__TRAINNG": "false",
            "TRAINMON_ANALYTICS__SPIKE_ZZ": "3",
            "trainmon_socket_grup": "x",
            "TRAINMON_QWERTY": "1",
            "TRAINMON_RUN": "r",  # the client's
            "TRAINMON_FLUSH_INTERVAL": "1",  # the client's
            "TRAINMON_LISTEN": "127.0.0.1:1",
            "TRAINMON_COLLECTORS__GPU": "false",
            "PATH": "/bin",
        }
    )
    assert lines == [
        "unknown environment variable TRAINMON_ANALYTICS__SPIKE_ZZ is ignored; did you mean "
        "TRAINMON_ANALYTICS__SPIKE_Z?",
        "unknown environment variable TRAINMON_COLLECTORS__TRAINNG is ignored; did you mean "
        "TRAINMON_COLLECTORS__TRAINING?",
        "unknown environment variable TRAINMON_QWERTY is ignored; see trainmon-exporter --help",
        "unknown environment variable TRAINMON_SERIES_TTL is ignored; did you mean "
        "TRAINMON_SERIES_TTL_SECONDS?",
        "unknown environment variable trainmon_socket_grup is ignored; did you mean "
        "TRAINMON_SOCKET_GROUP?",
    ]


def test_every_variable_the_client_reads_is_known() -> None:
    """A variable the client reads must never be reported as a misspelt setting."""
    src = "\n".join(p.read_text() for p in tracked("**/*.py", under=ROOT / "client" / "src"))
    used = set(re.findall(r"\bTRAINMON_[A-Z_]*[A-Z]\b", src))
    assert used and used <= environment_names()


def test_a_misspelt_variable_warns_once_as_the_exporter_starts(
    exporter_process: Callable[..., ExporterProcess],
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TRAINMON_")}
    env |= {"TRAINMON_SERIES_TTL": "30", "TRAINMON_MAX_RANK": "4"}
    ex = exporter_process(env=env).start()
    out = ex.stop()
    warnings = [line for line in out.splitlines() if "warning: unknown environment" in line]
    assert len(warnings) == 2, out
    assert "did you mean TRAINMON_MAX_RANKS?" in warnings[0]
    assert "did you mean TRAINMON_SERIES_TTL_SECONDS?" in warnings[1]


def test_a_list_variable_that_is_not_json_is_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TRAINMON_")}
    env["TRAINMON_STEP_DURATION_BUCKETS"] = "0.1 0.2"
    out = subprocess.run(
        [sys.executable, "-m", "trainmon_exporter"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        check=False,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(
        "trainmon-exporter: error: TRAINMON_STEP_DURATION_BUCKETS (environment): not valid JSON"
    )


def test_analytics_settings_live_in_settings_and_analytics_re_exports_them() -> None:
    assert analytics.AnalyticsSettings is settings.AnalyticsSettings
    assert analytics.SEVERITIES is settings.SEVERITIES
    assert settings.Settings.model_fields["analytics"].annotation is settings.AnalyticsSettings


def numeric_settings() -> list[tuple[str, FieldInfo]]:
    """Every numeric setting (numbers, optional numbers, lists and maps of numbers) as its
    flag and field, nested groups included."""
    out = []
    for name, field in Settings.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            for sub, subfield in kind.model_fields.items():
                out.append((f"--{name}.{sub.replace('_', '-')}", subfield))
        else:
            out.append(("--" + name.replace("_", "-"), field))
    return [(flag, f) for flag, f in out if re.search(r"\b(int|float)\b", str(f.annotation))]


def as_cli(field: FieldInfo, number: str) -> str:
    """``number`` written as a value of ``field`` (inside a list or map where it takes one)."""
    kind = str(field.annotation)
    if kind.startswith("tuple"):
        return f"[{number}]"
    if kind.startswith("dict"):  # the spike_z map: the number as its first severity
        return '{"minor": ' + number + ', "major": 6, "severe": 10}'
    return number


def bound(field: FieldInfo, *names: str) -> float | None:
    return next(
        (getattr(m, n) for m in field.metadata for n in names if getattr(m, n, None) is not None),
        None,
    )


def refusal(argv: list[str]) -> str:
    """What ``trainmon-exporter ARGV`` prints before exiting 2 ("" if the settings are valid),
    without starting an exporter."""
    try:
        load_settings(argv)
    except ValidationError as exc:
        return "".join(
            f"trainmon-exporter: error: {describe_error(e, argv, {})}\n" for e in exc.errors()
        )
    except SettingsError as exc:
        return f"trainmon-exporter: error: {describe_settings_error(exc, argv, {})}\n"
    return ""


FLOATS = [(flag, f) for flag, f in numeric_settings() if "float" in str(f.annotation)]
INTS = [(flag, f) for flag, f in numeric_settings() if "float" not in str(f.annotation)]


def test_the_numeric_settings_are_found() -> None:
    flags = [flag for flag, _ in numeric_settings()]
    for flag in (
        "--series-ttl-seconds",
        "--max-custom-metrics",
        "--analytics.hang-factor",
        "--step-duration-buckets",
        "--analytics.spike-z",
        "--peak-flops",
    ):
        assert flag in flags
    assert len(FLOATS) > 20 and len(INTS) > 20


@pytest.mark.parametrize(("flag", "field"), FLOATS, ids=[f for f, _ in FLOATS])
@pytest.mark.parametrize("number", ["inf", "-inf", "nan", "Infinity", "-Infinity", "NaN"])
def test_every_float_setting_refuses_inf_and_nan(flag: str, field: FieldInfo, number: str) -> None:
    err = refusal([f"{flag}={as_cli(field, number)}"])
    assert err.count("\n") == 1 and err.startswith(f"trainmon-exporter: error: {flag}"), err
    json_valued = str(field.annotation).startswith(("tuple", "dict"))
    if not json_valued or number in ("Infinity", "-Infinity", "NaN"):  # JSON's spelling
        assert "finite" in err, err
    else:
        assert "JSON" in err, err


@pytest.mark.parametrize(("flag", "field"), INTS + FLOATS, ids=[f for f, _ in INTS + FLOATS])
def test_every_numeric_setting_has_finite_bounds(flag: str, field: FieldInfo) -> None:
    """Both bounds are declared, and a huge value (a memory bomb for a window or a limit) is
    refused as one line; for a list or map the bound is on its items or in its validator."""
    if not str(field.annotation).startswith(("tuple", "dict")):
        low, high = bound(field, "ge", "gt"), bound(field, "le", "lt")
        assert low is not None and high is not None, f"{flag} needs both bounds"
        assert high < 1e19
    err = refusal([f"{flag}={as_cli(field, '1000000000000000000000')}"])
    assert err.count("\n") == 1 and err.startswith(f"trainmon-exporter: error: {flag}"), err


@pytest.mark.parametrize(("flag", "field"), INTS, ids=[f for f, _ in INTS])
def test_every_whole_number_setting_refuses_a_fraction_and_a_negative(
    flag: str, field: FieldInfo
) -> None:
    for value in ("2.5", "-1"):
        err = refusal([f"{flag}={as_cli(field, value)}"])
        assert err.count("\n") == 1 and err.startswith(f"trainmon-exporter: error: {flag}"), err
        assert value in err, err


def test_the_step_buckets_are_bounded_in_number() -> None:
    buckets = json.dumps([0.001 * (i + 1) for i in range(65)])
    with pytest.raises(ValidationError, match="at most 64 items"):
        load_settings(["--step-duration-buckets", buckets])
    assert (
        len(
            load_settings(
                ["--step-duration-buckets", buckets[:-1].rsplit(",", 1)[0] + "]"]
            ).step_duration_buckets
        )
        == 64
    )
