"""The client against a real SOCK_SEQPACKET listener: what it sends, and that it never hurts
the training loop (no exporter, full buffers, restarts, bad values, forks)."""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import trainmon_client
from trainmon_client import _names as N
from trainmon_client import _protocol as P
from trainmon_client._encoder import MAX_CUSTOM_NAMES
from trainmon_client._env import detect_ranks, detect_run_id
from trainmon_client._transport import SendResult, Transport

from ..conftest import wait_for
from ..helpers.client import Listener, make_run, steps_of

# ----------------------------------------------------------------------------- what it sends


def test_hello_then_batched_steps_with_cumulative_totals(listener: Listener) -> None:
    run = make_run(listener.path, flush_interval=0.05, num_params=1000)
    run.log(0, loss=3.0, lr=1e-3, tokens=100, samples=2)  # the first log() sends at once
    wait_for(lambda: run.connected, timeout=5)
    for i in range(1, 5):
        run.log(i, loss=3.0 - i * 0.1, lr=1e-3, tokens=100, samples=2, grad_norm=0.5)
    listener.accept()
    recs: list[tuple[int, Any]] = []
    reader = threading.Thread(target=lambda: recs.extend(listener.records(2.0)))
    reader.start()  # reads while finish() waits for its records to be read
    run.finish()
    reader.join()
    assert recs[0][0] == P.HELLO
    hello = recs[0][1]
    # Off Kubernetes the HELLO is what exporters before namespace and pod know.
    assert set(hello) == set(P.HELLO_FIELDS) - {"namespace", "pod"}
    assert (hello["run"], hello["rank"], hello["world_size"]) == ("test-run", 0, 1)
    assert hello["flops_per_token"] == 6000.0 and hello["pid"] == os.getpid()
    steps = steps_of(recs)
    assert [h.step for h, _, _ in steps] == [0, 1, 2, 3, 4]
    assert [h.steps_total for h, _, _ in steps] == [1, 2, 3, 4, 5]
    assert [h.tokens_total for h, _, _ in steps] == [
        100.0,
        200.0,
        300.0,
        400.0,
        500.0,
    ]  # tokens_total
    assert [h.samples_total for h, _, _ in steps] == [2.0, 4.0, 6.0, 8.0, 10.0]  # samples_total
    assert math.isnan(steps[0][0].step_time) and all(
        h.step_time > 0 for h, _, _ in steps[1:]
    )  # step_time
    _, ids, values = steps[-1]
    assert dict(zip(ids, values, strict=True)) == {1: pytest.approx(2.6), 2: 1e-3, 3: 0.5}
    assert recs[-1] == (P.FINISH, (P.FINISH_OK, pytest.approx(time.time(), abs=5)))
    assert run.dropped == dict.fromkeys(
        ("disconnected", "backpressure", "encode_error", "in_flight", "reentrant"), 0
    )
    assert run.sent == 5


def test_steps_are_batched_into_few_packets(listener: Listener) -> None:
    run = make_run(listener.path, flush_interval=10.0)
    run.log(0, loss=1.0)  # the first step is sent at once: it connects
    wait_for(lambda: run.connected)
    listener.accept()
    listener.packets(0.05)
    for i in range(1, 201):
        run.log(i, loss=1.0, lr=0.1)
    assert listener.packets(0.05) == []  # still buffered: no syscall per step
    run.finish()
    pkts = listener.packets()
    assert len(pkts) == 1
    assert (
        len(steps_of([(t, P.decode_step(p)) for t, p in P.iter_records(pkts[0]) if t == P.STEP]))
        == 200
    )


def test_log_never_sends_in_the_training_thread(
    listener: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every send but finish()'s happens in the flusher thread: log() makes no syscall, so the
    calls that used to flush cost what the others cost."""
    senders: list[str] = []
    send = Transport.send

    def spy(self: Transport, *args: Any, **kw: Any) -> SendResult:
        senders.append(threading.current_thread().name)
        return send(self, *args, **kw)

    monkeypatch.setattr(Transport, "send", spy)
    run = make_run(listener.path, flush_interval=0.02)
    for i in range(30):
        run.log(i, loss=1.0, lr=0.1)
        time.sleep(0.005)
    run.log(30, loss=float("nan"))  # sent at once, still not by the caller
    wait_for(lambda: len(senders) >= 3, timeout=5)
    assert threading.current_thread().name not in senders
    assert set(senders) == {"trainmon-flush-0"}
    run.finish()
    listener.accept()
    assert [h.step for h, _, _ in steps_of(listener.records())] == list(range(31))


def test_a_nan_is_sent_at_once(listener: Listener) -> None:
    run = make_run(listener.path, flush_interval=60.0)
    run.log(0, loss=1.0)  # the first step is sent at once: it connects
    wait_for(lambda: run.connected)
    listener.accept()
    listener.packets(0.05)
    run.log(1, loss=1.0)
    run.log(2, loss=float("nan"), grad_norm=1.0)
    recs = listener.records(0.5)
    steps = steps_of(recs)
    assert [h.step for h, _, _ in steps] == [1, 2]
    assert math.isnan(dict(zip(steps[1][1], steps[1][2], strict=True))[1])
    run.log(3, grad_norm=float("inf"))
    assert steps_of(listener.records(0.5))[0][0].step == 3
    run.finish()


def test_custom_names_are_interned_and_resent_after_reconnect(listener: Listener) -> None:
    run = make_run(listener.path, flush_interval=0.0)
    run.log(0, loss=1.0, my_metric=5.0, **{"opt/eps": 1e-8})
    listener.accept()
    recs = listener.records()
    names = [r[1] for r in recs if r[0] == P.NAME]
    assert names == [(64, "my_metric"), (65, "opt/eps")]
    step = steps_of(recs)[0]
    assert dict(zip(step[1], step[2], strict=True)) == {1: 1.0, 64: 5.0, 65: 1e-8}
    # The exporter goes away and comes back: names arrive again right after the new HELLO.
    listener.conn.close()  # type: ignore[union-attr]
    run.log(1, loss=1.0, my_metric=6.0)  # send fails: dropped and counted
    time.sleep(0.25)  # past the reconnect backoff
    run.log(2, loss=1.0, my_metric=7.0)
    listener.accept()
    recs = listener.records()
    assert recs[0][0] == P.HELLO
    assert [r[1] for r in recs if r[0] == P.NAME] == [(64, "my_metric"), (65, "opt/eps")]
    assert steps_of(recs)[-1][0].step == 2
    assert run.dropped["disconnected"] >= 1
    # The cumulative drop count travels with the next step.
    assert steps_of(recs)[-1][0].dropped_disconnected_total == run.dropped["disconnected"]
    run.finish()


def test_tokens_and_samples_default_from_batch_size_and_seq_len(listener: Listener) -> None:
    run = make_run(listener.path, flush_interval=0.0)
    run.log(0, loss=1.0, batch_size=8, seq_len=512)
    run.log(1, loss=1.0, batch_size=8, seq_len=512)
    listener.accept()
    run.finish()
    head = steps_of(listener.records())[-1][0]
    assert (head.tokens_total, head.samples_total) == (8192.0, 16.0)


def test_numpy_and_tensor_values_are_accepted(listener: Listener) -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    run = make_run(listener.path, flush_interval=0.0)
    run.log(
        np.int64(7),
        loss=np.float32(1.5),
        lr=torch.tensor(0.25),
        grad_norm=True,
        extra=np.float64(2),
    )
    listener.accept()
    run.finish()
    head, ids, values = steps_of(listener.records())[0]
    assert head.step == 7
    assert dict(zip(ids, values, strict=True)) == {1: 1.5, 2: 0.25, 3: 1.0, 64: 2.0}
    assert run.refused == 0


# ----------------------------------------------------------------------------- never hurts


def test_no_exporter_never_raises_and_counts_drops(sockdir: Path) -> None:
    run = make_run(sockdir / "nobody.sock", flush_interval=0.0)
    for i in range(100):
        run.log(i, loss=1.0, tokens=10)
    run.finish()
    assert run.dropped["disconnected"] == 100  # steps; the FINISH record is not a step
    assert run.internal_errors == 0


def test_socket_directory_that_does_not_exist(tmp_path: Path) -> None:
    run = make_run(tmp_path / "no" / "such" / "dir" / "t.sock", flush_interval=0.0)
    run.log(0, loss=1.0)
    run.finish()
    assert run.dropped["disconnected"] == 1


def test_bad_values_and_names_are_refused_not_raised(listener: Listener) -> None:
    run = make_run(listener.path, flush_interval=0.0)
    run.log(0, loss="high", lr=[1, 2], grad_norm=None, ok=1.0)
    run.log(1, **{'bad"name': 1.0, "new\nline": 2.0, "x" * 10_000: 3.0})
    run.log(-5, loss=1.0)
    run.log("step", loss=1.0)
    run.log(2.0, loss=1.0)  # an integral float step is fine
    listener.accept()
    run.finish()
    assert run.refused == 3 + 3 + 2
    steps = steps_of(listener.records())
    assert [h.step for h, _, _ in steps] == [0, 1, 2]
    assert dict(zip(steps[0][1], steps[0][2], strict=True)) == {64: 1.0}
    assert steps[-1][0].refused_values_total == 8  # refused_values_total on the wire
    assert run.internal_errors == 0


def test_custom_name_cap(listener: Listener) -> None:
    run = make_run(listener.path, flush_interval=60.0)  # a few large packets
    run.log(0, m0=1.0)
    listener.accept()
    recs: list[tuple[int, Any]] = []
    reader = threading.Thread(target=lambda: recs.extend(listener.records(2.0)))
    reader.start()
    over = 20
    for i in range(1, MAX_CUSTOM_NAMES + over):
        run.log(i, **{f"m{i}": 1.0})
    run.finish()  # names are interned (or refused) when the flusher encodes the steps
    reader.join()
    assert run.refused == over
    names = {r[1] for r in recs if r[0] == P.NAME}
    assert {name for _, name in names} == {f"m{i}" for i in range(MAX_CUSTOM_NAMES)}
    assert len(steps_of(recs)) == MAX_CUSTOM_NAMES + over  # the steps go, without the value


def test_full_socket_buffer_drops_instead_of_blocking(listener: Listener) -> None:
    """The exporter stops reading: log() stays fast and counts backpressure drops."""
    run = make_run(listener.path, flush_interval=0.0)
    run.log(0, loss=1.0)
    conn = listener.accept()  # accepted, never read
    payload = {f"m{i}": float(i) for i in range(200)}
    worst = 0.0
    for i in range(1, 3000):
        t0 = time.perf_counter()
        run.log(i, loss=1.0, **payload)
        worst = max(worst, time.perf_counter() - t0)
    assert run.dropped["backpressure"] > 0
    assert worst < 0.5  # never blocked on the socket (a blocking send would hang forever)
    conn.close()
    run.finish()


def test_exporter_restart_is_picked_up(sockdir: Path) -> None:
    path = sockdir / "t.sock"
    first = Listener(path)
    run = make_run(path, flush_interval=0.0)
    run.log(0, loss=1.0)
    first.accept()
    assert steps_of(first.records())[0][0].step == 0
    first.close()  # the exporter dies
    for i in range(1, 20):
        run.log(i, loss=1.0)
        time.sleep(0.01)
    second = Listener(path)  # a new exporter on the same path
    try:

        def delivered() -> bool:
            run.log(99, loss=1.0)
            return True

        deadline = time.monotonic() + 5
        got: list[Any] = []
        second.sock.settimeout(0.05)
        while time.monotonic() < deadline and not got:
            delivered()
            try:
                second.accept(timeout=0.05)
                got = steps_of(second.records())
            except TimeoutError:
                pass
        assert got and got[-1][0].step == 99
        assert run.dropped["disconnected"] >= 19
    finally:
        run.finish()
        second.close()


def test_context_manager_marks_failure(listener: Listener) -> None:
    with pytest.raises(RuntimeError), make_run(listener.path, flush_interval=0.0) as run:
        run.log(0, loss=1.0)
        listener.accept()
        raise RuntimeError("boom")
    assert listener.records()[-1][1][0] == P.FINISH_FAILED


def test_finish_is_idempotent_and_log_after_finish_is_a_no_op(listener: Listener) -> None:
    run = make_run(listener.path, flush_interval=0.0)
    run.log(0, loss=1.0)
    listener.accept()
    run.finish()
    run.finish()
    run.log(1, loss=1.0)
    recs = listener.records()
    assert [t for t, _ in recs].count(P.FINISH) == 1
    assert [h.step for h, _, _ in steps_of(recs)] == [0]


def test_forked_child_never_writes_to_the_parent_socket(listener: Listener) -> None:
    run = make_run(listener.path, flush_interval=0.0)
    run.log(0, loss=1.0)
    listener.accept()
    listener.records()
    pid = os.fork()
    if pid == 0:  # child: e.g. a DataLoader worker
        try:
            run.log(1, loss=1.0)
            run.finish()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert listener.records(0.2) == []  # the child sent nothing, not even FINISH
    run.log(2, loss=1.0)
    run.finish()
    assert [h.step for h, _, _ in steps_of(listener.records())] == [2]


def test_disabled_run_does_nothing(listener: Listener) -> None:
    run = make_run(listener.path, enabled=False)
    run.log(0, loss=1.0)
    run.finish()
    listener.sock.settimeout(0.2)
    with pytest.raises(TimeoutError):
        listener.sock.accept()


# ----------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    "kwargs",
    [
        {"run": 'bad"run'},
        {"run": "x" * 129},
        {"run": "ok", "rank": 2, "world_size": 2},
        {"run": "ok", "rank": -1},
        {"run": "ok", "flush_interval": -1.0},
        {"run": "ok", "flops_per_token": float("nan")},
        {"run": "ok", "num_params": 0},
    ],
)
def test_programmer_errors_raise_at_init(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        trainmon_client.init(socket_path="/nonexistent/t.sock", **kwargs)


def test_detect_ranks_from_launchers() -> None:
    assert detect_ranks({}) == (0, 0, 1)
    assert detect_ranks({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}) == (3, 1, 8)
    slurm_task = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "16"}
    assert detect_ranks({**slurm_task, "SLURM_STEP_ID": "0"}) == (5, 1, 16)
    assert detect_ranks({**slurm_task, "SLURM_STEPID": "3"}) == (5, 1, 16)
    # The batch script of `sbatch -n4` sees SLURM_PROCID=0 and SLURM_NTASKS=4 but no step:
    # it is one process, not rank 0 of 4.
    assert detect_ranks({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "9"}) == (
        0,
        0,
        1,
    )
    assert detect_ranks({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"}) == (2, 2, 4)
    # A bad value from the environment is ignored (as if unset), noted and warned about.
    issues: list[str] = []
    assert detect_ranks({"RANK": "zero", "SLURM_PROCID": "x"}, issues) == (0, 0, 1)
    assert detect_ranks({"RANK": "2", "LOCAL_RANK": "-1", "WORLD_SIZE": "0"}, issues) == (2, 2, 3)
    assert issues == ["RANK", "LOCAL_RANK", "WORLD_SIZE"]


def test_detect_run_id_order() -> None:
    assert detect_run_id(1, {"TRAINMON_RUN": "mine", "TORCHELASTIC_RUN_ID": "x"}) == "mine"
    assert detect_run_id(2, {"TORCHELASTIC_RUN_ID": "abc"}) == "abc"
    assert detect_run_id(2, {"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "77"}) == "slurm-77"
    # In a Slurm job the job id wins over a rendezvous id (`--rdzv-id=$RANDOM` changes when
    # the job is requeued; the job id does not).
    assert detect_run_id(2, {"TORCHELASTIC_RUN_ID": "8123", "SLURM_JOB_ID": "77"}) == "slurm-77"
    assert detect_run_id(2, {"TRAINMON_RUN": "mine", "SLURM_JOB_ID": "77"}) == "mine"
    generated = detect_run_id(1, {})
    assert generated == detect_run_id(1, {})  # stable within a process
    assert N.valid_run_id(generated)


def test_generated_run_id_is_shared_by_sibling_ranks() -> None:
    """Ranks started by one launcher (same parent) agree on the generated id."""
    import subprocess
    import sys

    code = "from trainmon_client._env import detect_run_id; print(detect_run_id(2, {}))"
    ids = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    assert len(ids) == 1 and N.valid_run_id(ids.pop())


def test_repr_and_properties() -> None:
    run = trainmon_client.init(run="r", socket_path="/nonexistent/t.sock", enabled=False)
    assert "r" in repr(run) and run.connected is False and run.overhead_seconds == 0.0
    wait_for(lambda: True)


# ------------------------------------------------------------------ eval, track, checkpoint


def test_eval_track_and_checkpoint_are_sent_at_once_in_order(listener: Listener) -> None:
    run = make_run(listener.path, flush_interval=60.0)
    run.log(0, loss=2.0)
    with run.track("validation"):
        run.eval(0, val_loss=2.5, accuracy=0.25)
    run.checkpoint(0, seconds=1.5)
    listener.accept()
    recs = listener.records()
    kinds = [t for t, _ in recs if t != P.NAME]
    assert kinds == [P.HELLO, P.STEP, P.TRACK, P.EVAL, P.TRACK, P.CHECKPOINT]
    names = dict(r[1] for r in recs if r[0] == P.NAME)
    tracks = [r[1] for r in recs if r[0] == P.TRACK]
    assert names[tracks[0][0]] == "validation"
    assert tracks[0][1:] == (True, 0.0, 0)  # running, nothing finished yet
    assert tracks[1][1] is False and tracks[1][2] > 0 and tracks[1][3] == 1
    step, _when, ids, values = next(r[1] for r in recs if r[0] == P.EVAL)
    assert step == 0
    by_name = {names.get(i, P.STANDARD_NAMES.get(i)): v for i, v in zip(ids, values, strict=True)}
    assert by_name == {
        "val_loss": 2.5,
        "accuracy": 0.25,
    }
    ck = next(r[1] for r in recs if r[0] == P.CHECKPOINT)
    assert ck[0] == 0 and ck[2] == 1.5
    run.finish()


def test_track_propagates_the_users_exception_and_still_records(listener: Listener) -> None:
    run = make_run(listener.path, flush_interval=0.0)
    with pytest.raises(KeyError), run.track("sampling"):
        raise KeyError("user bug")
    listener.accept()
    run.finish()
    tracks = [r[1] for r in listener.records() if r[0] == P.TRACK]
    assert tracks[-1][1:3] == (False, pytest.approx(tracks[-1][2])) and tracks[-1][3] == 1


def test_bad_eval_track_checkpoint_input_is_refused_not_raised(listener: Listener) -> None:
    run = make_run(listener.path, flush_interval=0.0)
    run.eval(-1, val_loss=1.0)
    run.eval(1, val_loss="low")
    with run.track('bad "name"'):
        pass
    run.checkpoint("x")
    run.checkpoint(1, seconds=-3)
    assert run.refused == 5 and run.internal_errors == 0
    run.finish()


def test_track_returns_an_operation_to_start_and_stop(listener: Listener) -> None:
    """Callbacks start an operation in one hook and stop it in another."""
    run = make_run(listener.path, flush_interval=0.0)
    op = run.track("generation")
    assert not op.running  # nothing is sent until it starts
    op.start()
    op.start()  # already running: nothing more
    assert op.running
    op.stop()
    op.stop()  # already stopped: nothing more
    with run.track("generation") as again:
        assert again.running
    assert not again.running
    listener.accept()
    run.finish()
    assert run.closed
    op.start()  # on a finished run: nothing, no exception
    assert not op.running
    tracks = [r[1] for r in listener.records() if r[0] == P.TRACK]
    assert [(t.active, t.runs_total) for t in tracks] == [
        (True, 0),
        (False, 1),
        (True, 1),
        (False, 2),
    ]
    assert run.refused == 0 and run.internal_errors == 0


def test_closed() -> None:
    run = trainmon_client.init(run="r", socket_path="/nonexistent/t.sock", enabled=False)
    assert run.closed
    run = trainmon_client.init(run="r", socket_path="/nonexistent/t.sock")
    assert not run.closed
    run.finish()
    assert run.closed
