"""What the client reads from the environment: bad values never make ``init()`` raise (they are
sanitised, warned about once and counted); misspelt ``TRAINMON_*`` names get a suggestion."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import trainmon_client
from trainmon_client import _env
from trainmon_client import _names as N

from ..conftest import InProcessExporter, child_env, wait_for

TRAINER = textwrap.dedent(
    """
    import json, sys
    import trainmon_client
    run = trainmon_client.init(socket_path=sys.argv[1])
    again = trainmon_client.init(socket_path=sys.argv[1], enabled=False)
    run.log(1, loss=2.0)
    run.finish()
    print(json.dumps({"run": run.run_id, "rank": run.rank, "world_size": run.world_size,
                      "interval": run.flush_interval, "refused": run.refused,
                      "sanitised": run.sanitised_env, "sent": run.sent}))
    """
)


def test_a_job_name_with_quotes_spaces_and_a_newline_starts_and_is_counted(
    exporter: InProcessExporter,
) -> None:
    env = child_env(
        TRAINMON_RUN="  my job 'v2'\nretry \"b\"  ",
        RANK="first",
        WORLD_SIZE="2",
        TRAINMON_FLUSH_INTERVAL="fast",
    )
    proc = subprocess.run(
        [sys.executable, "-c", TRAINER, exporter.socket],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["run"] == "my_job__v2__retry__b_" and N.valid_run_id(out["run"])
    assert (out["rank"], out["world_size"], out["interval"]) == (0, 1, 0.5)
    assert out["sanitised"] == ["RANK", "TRAINMON_RUN", "TRAINMON_FLUSH_INTERVAL"]
    assert out["refused"] == 3 and out["sent"] == 1
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("trainmon: ")]
    # One line each, though init() ran twice.
    assert warnings == [
        "trainmon: RANK='first' is not an integer >= 0; ignored",
        "trainmon: TRAINMON_RUN='my job \\'v2\\'\\nretry \"b\"' is not a valid run id; using "
        "'my_job__v2__retry__b_'",
        "trainmon: TRAINMON_FLUSH_INTERVAL='fast' is not a number of seconds within [0, 60]; "
        "using 0.5",
    ], proc.stderr
    k = wait_for(lambda: exporter.rank("my_job__v2__retry__b_", 0))
    assert k["values"]["loss"] == 2.0
    assert k["refused_values"] == 3  # the count travels with each step


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"TRAINMON_RUN": "-.-"}, None),  # nothing valid left: the next source
        ({"TRAINMON_RUN": "x" * 200}, "x" * 128),
        ({"SLURM_JOB_ID": "12 3"}, "slurm-12_3"),
        ({"TORCHELASTIC_RUN_ID": "rdzv:ok"}, "rdzv:ok"),
        ({"TORCHELASTIC_RUN_ID": "a/b"}, "a_b"),
    ],
)
def test_run_ids_from_the_environment_are_sanitised(
    env: dict[str, str], expected: str | None
) -> None:
    issues: list[str] = []
    run_id = _env.detect_run_id(1, env, issues)
    assert N.valid_run_id(run_id)
    if expected is None:
        assert run_id == _env.detect_run_id(1, {}) and issues == ["TRAINMON_RUN"]
    else:
        assert run_id == expected
        assert issues == ([] if expected == next(iter(env.values())) else [next(iter(env))])


def test_only_an_explicit_argument_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINMON_RUN", "bad run")
    monkeypatch.setenv("TRAINMON_EXPORTER_UID", "root")
    run = trainmon_client.init(socket_path="/nonexistent/t.sock")
    assert run.run_id == "bad_run"
    assert set(run.sanitised_env) == {"TRAINMON_RUN", "TRAINMON_EXPORTER_UID"}
    assert run._sender.transport.exporter_uid == -1  # fails closed: no listener has uid -1
    run.finish()
    with pytest.raises(ValueError, match="run id"):
        trainmon_client.init(run="bad run", socket_path="/nonexistent/t.sock")
    with pytest.raises(ValueError, match="flush_interval"):
        trainmon_client.init(run="ok", flush_interval=99.0, socket_path="/nonexistent/t.sock")


def test_a_misspelt_variable_gets_one_suggestion(exporter: InProcessExporter) -> None:
    env = child_env(
        TRAINMON_RUNN="my-run",  # the misspelling that gave a generated run id
        trainmon_socket=exporter.socket,  # the right name in the wrong case
        TRAINMON_SOCKET_MODE="0660",  # the exporter's own: no warning on a trainer
        TRAINMON_ANALYTICS__HANG_FACTOR="5",
        TRAINMON_MY_SCRIPT_FLAG="1",  # close to nothing the client reads
    )
    code = (
        "import trainmon_client as t\n"
        "a = t.init(socket_path='/nonexistent/t.sock'); b = t.init(socket_path='/n/t.sock')\n"
        "print(a.run_id)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "did you mean" in line]
    assert lines == [
        "trainmon: TRAINMON_RUNN is not a variable trainmon reads; did you mean TRAINMON_RUN?",
        "trainmon: trainmon_socket is not a variable trainmon reads; did you mean TRAINMON_SOCKET?",
    ], proc.stderr


def test_the_exporters_variables_close_to_the_clients_are_known_to_it() -> None:
    """The client's copy of the exporter's near names matches the exporter's settings."""
    import difflib

    from trainmon_exporter.settings import CLIENT_VARIABLES, environment_names

    assert set(CLIENT_VARIABLES) == set(_env.CLIENT_VARIABLES)
    client = {k.removeprefix("TRAINMON_") for k in _env.CLIENT_VARIABLES}
    near = {
        name
        for name in environment_names() - CLIENT_VARIABLES
        if "__" not in name
        and difflib.get_close_matches(name.removeprefix("TRAINMON_"), client, 1, 0.6)
    }
    assert near == _env.EXPORTER_NEAR_CLIENT
    assert _env.misspelt_variables({k: "1" for k in environment_names()}) == []


def test_torchruns_made_up_rendezvous_id_becomes_the_script_and_its_digits() -> None:
    """``torchrun --standalone`` sets a new UUID as ``TORCHELASTIC_RUN_ID`` for every launch:
    the run id names the script instead, with the UUID's first 8 hex digits (the same on
    every rank); a rendezvous id a user chose stays as it is."""
    made_up = {"TORCHELASTIC_RUN_ID": "8B2C1F3E-5d6a-4c1b-9e2f-0123456789ab"}
    run_id = _env.detect_run_id(2, made_up)
    assert run_id == f"{_env.detect_run_id(1, {}).split('-')[0]}-8b2c1f3e"
    assert N.valid_run_id(run_id)
    assert _env.detect_run_id(2, {"TORCHELASTIC_RUN_ID": "pretrain-7b"}) == "pretrain-7b"
    assert _env.detect_run_id(2, made_up | {"TRAINMON_RUN": "mine"}) == "mine"
