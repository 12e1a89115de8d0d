"""GPU telemetry cost: NVML sampling per GPU, /metrics scrape time, exporter CPU and RSS.

    python benchmarks/gpu.py [--gpus 8 --seconds 30]

Runs the real nvidia-ml-py code against the fake ``libnvidia-ml.so.1`` of ``tests/fakes/libnvml``
(compiled here with gcc), or against the real driver with ``--real``. Three parts, each with a
baseline measured in the same run:

1. Sampling, per driver branch (a fake library shaped like R470, R535, R550 and R570, each in
   its own process): one :class:`GpuSampler` pass over every GPU, against the same NVML calls
   made straight through pynvml in a bare loop with the entry points that branch has (what
   the error policy, the version fallbacks and the snapshot cost on top). ``--real``
   measures the host's driver instead.
2. Scrape: ``generate_latest`` on an exporter with the GPUs and 8 or 64 ranks (one new step per
   rank between scrapes, so nothing is served from a cache), against the same exporter with
   the GPU collectors off.
3. A real exporter process sampling the GPUs at 1 Hz while 8 ranks log 10 steps/s and /metrics
   is scraped every 5 s: CPU share of one core and RSS, against the same with the GPU
   collectors off.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fakes.libnvml import BRANCH_SYMBOLS, CONFIG_ENV, build, h100, load, write_config  # noqa: E402
from trainmon_client import _protocol as P  # noqa: E402


def median_ms(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def bare_pass(pynvml, handles, old: bool) -> None:  # type: ignore[no-untyped-def]
    """The sampler's NVML calls, straight through pynvml: the floor of any sampler.

    ``old``: the driver lacks ``_v3`` processes and clock *event* reasons (R470), so the bare
    loop calls what it has, as the sampler does.
    """
    procs = (
        pynvml.nvmlDeviceGetComputeRunningProcesses_v2
        if old
        else pynvml.nvmlDeviceGetComputeRunningProcesses_v3
    )
    reasons = (
        pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        if old
        else pynvml.nvmlDeviceGetCurrentClocksEventReasons
    )
    for h in handles:
        pynvml.nvmlDeviceGetMemoryInfo(h)
        pynvml.nvmlDeviceGetUtilizationRates(h)
        pynvml.nvmlDeviceGetPowerUsage(h)
        pynvml.nvmlDeviceGetEnforcedPowerLimit(h)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
        pynvml.nvmlDeviceGetTemperature(h, 0)
        pynvml.nvmlDeviceGetClockInfo(h, 1)
        pynvml.nvmlDeviceGetClockInfo(h, 2)
        pynvml.nvmlDeviceGetFieldValues(h, [(82, 0), (197, 0), (198, 0), (138, 0), (139, 0)])
        reasons(h)
        for e in (0, 1):
            for c in (0, 1):
                pynvml.nvmlDeviceGetTotalEccErrors(h, e, c)
        pynvml.nvmlDeviceGetRemappedRows(h)
        procs(h)


def sampling(n_gpus: int, label: str) -> None:
    """Print one branch's sampler pass against the bare loop (this process's library)."""
    import pynvml

    from trainmon_exporter.nvml import PynvmlBackend
    from trainmon_exporter.sampler import GpuSampler

    s = GpuSampler(PynvmlBackend())
    assert s.open(), s.snapshot.error
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n_gpus)]
    old = not hasattr(pynvml.nvmlLib, "nvmlDeviceGetComputeRunningProcesses_v3")
    for _ in range(20):
        snap = s.sample_once()
        bare_pass(pynvml, handles, old)
    assert len(snap.gpus) == n_gpus and not snap.read_errors, snap
    ours = median_ms(s.sample_once, 300)
    bare = median_ms(lambda: bare_pass(pynvml, handles, old), 300)
    gpm = "GPM" if snap.gpus[0].readings.sm_active_ratio is not None else "no GPM"
    s.stop()
    print(
        f"   {label:<5} sampler {ours / n_gpus * 1e3:5.0f} µs per GPU ({gpm}, XID drain) | "
        f"bare pynvml {bare / n_gpus * 1e3:4.0f} µs per GPU | ratio {ours / bare:5.2f}"
    )


def sampling_per_branch(n_gpus: int) -> None:
    """Part 1 over every fake driver branch, one child process each."""
    import subprocess

    print(f"\n1. NVML sampling, {n_gpus} GPUs, median of 300 passes, per driver branch")
    root = Path(tempfile.mkdtemp(prefix="tm-fake-nvml-branches-"))
    cfg = root / "gpus.conf"
    write_config(cfg, [h100(i, procs=f"{1000 + i}:{2**30}") for i in range(n_gpus)])
    for branch in sorted(BRANCH_SYMBOLS):
        lib = build(root / str(branch), branch=branch)
        env = {**os.environ, "LD_LIBRARY_PATH": str(lib.parent), CONFIG_ENV: str(cfg)}
        cmd = [sys.executable, __file__, "--gpus", str(n_gpus), "--sampling-only", f"R{branch}"]
        subprocess.run(cmd, env=env, check=True)


def scrape(n_gpus: int, ranks: int, gpu_on: bool) -> tuple[float, int]:
    from prometheus_client.exposition import generate_latest

    from trainmon_exporter.app import build_exporter
    from trainmon_exporter.settings import CollectorToggles, Settings

    d = tempfile.mkdtemp(prefix="tm-bench-")
    settings = Settings(
        socket=Path(d) / "t.sock",
        collectors=CollectorToggles(gpu=gpu_on, rank_gpu=gpu_on),
    )
    ex = build_exporter(settings)
    if ex.gpus is not None:
        assert ex.gpus.open()
        ex.gpus.sample_once()
        ex.gpus.sample_once()
    now = time.time()
    states = []
    for r in range(ranks):
        st = ex.store.attach(
            {
                "run": "bench",
                "rank": r,
                "local_rank": r % 8,
                "world_size": ranks,
                "hostname": "node-1",
                "pid": 1000 + r,
                "client_version": "bench",
                "gpu_uuid": h100(r % n_gpus)["uuid"],
                "started_at": now - 400,
                "flops_per_token": 6 * 124e6,
                "dtype": "bf16",
            }
        )
        assert not isinstance(st, str)
        for i in range(300):
            st.observe_step(
                P.Step(
                    P.StepHeader(
                        i, i + 1, now - 300 + i, 0.1, 4096.0 * i, 8.0 * i, 1e-3 * i, 0, 0, 0
                    ),
                    (1, 2, 3),
                    (2.0 + 0.01 * (i % 7), 3e-4, 1.0 + 0.1 * (i % 3)),
                ),
                {},
                30.0,
            )
        states.append(st)
    step = [300]

    def one() -> bytes:
        i = step[0]
        step[0] += 1
        t = time.time()
        for st in states:  # a new step per rank: no cached fit is reused
            st.observe_step(
                P.Step(
                    P.StepHeader(i, i + 1, t, 0.1, 4096.0 * i, 8.0 * i, 1e-3 * i, 0, 0, 0),
                    (1, 2, 3),
                    (2.0, 3e-4, 1.0),
                ),
                {},
                30.0,
            )
        return generate_latest(ex.registry)

    body = one()
    ts = []
    for _ in range(40):
        t0 = time.perf_counter()
        one()
        ts.append(time.perf_counter() - t0)
    feed = median_ms(
        lambda: [
            st.observe_step(
                P.Step(P.StepHeader(1, 1, time.time(), 0.1, 1.0, 1.0, 0.0, 0, 0, 0), (1,), (2.0,)),
                {},
                30.0,
            )
            for st in states
        ],
        40,
    )
    if ex.gpus is not None:
        ex.gpus.stop()
    return statistics.median(ts) * 1e3 - feed, body.count(b"\n")


def process_cost(env: dict[str, str], gpu_on: bool, seconds: float) -> tuple[float, float]:
    from trainmon_client import init
    from trainmon_exporter.local import LocalExporter

    flags = ["--nvml-interval-seconds", "1"]
    if not gpu_on:
        flags += ["--no-collectors.gpu", "--no-collectors.rank-gpu"]
    os.environ.update(env)  # inherited by the exporter process
    with LocalExporter(*flags) as ex:
        import urllib.request

        assert ex.proc is not None
        pid = ex.proc.pid
        runs = [
            init(
                run="cost",
                rank=r,
                world_size=8,
                socket_path=ex.socket,
                num_params=124_000_000,
                gpu_uuid=str(h100(r)["uuid"]),
            )
            for r in range(8)
        ]
        time.sleep(2)
        t_start = time.time()
        cpu0 = cpu_seconds(pid)
        step, next_scrape = 0, t_start
        while time.time() - t_start < seconds:
            for r in runs:
                r.log(step, loss=2.0, lr=3e-4, grad_norm=1.0, tokens=4096)
            step += 1
            if time.time() >= next_scrape:
                urllib.request.urlopen(ex.url + "/metrics", timeout=5).read()
                next_scrape += 5
            time.sleep(0.1)
        cpu = (cpu_seconds(pid) - cpu0) / (time.time() - t_start)
        rss = rss_mib(pid)
        for r in runs:
            r.finish()
    return cpu, rss


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--real", action="store_true", help="use the host's real NVML")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="seconds: 2 GPUs, 1 s per part (figures not meaningful)",
    )
    ap.add_argument("--sampling-only", metavar="LABEL", help=argparse.SUPPRESS)  # child of part 1
    args = ap.parse_args()
    if args.smoke:
        args.gpus, args.seconds = 2, 1.0
    if args.sampling_only:
        sampling(args.gpus, args.sampling_only)
        return 0
    env: dict[str, str] = {}
    if args.real:
        print(f"\n1. NVML sampling, {args.gpus} GPUs, median of 300 passes, host driver")
        sampling(args.gpus, "host")
    else:
        sampling_per_branch(args.gpus)
        tmp = Path(tempfile.mkdtemp(prefix="tm-fake-nvml-"))
        lib = build(tmp)
        cfg = tmp / "gpus.conf"
        write_config(cfg, [h100(i, procs=f"{1000 + i}:{2**30}") for i in range(args.gpus)])
        os.environ[CONFIG_ENV] = str(cfg)
        load(lib)
        env = {"LD_LIBRARY_PATH": str(tmp), CONFIG_ENV: str(cfg)}
        print(f"fake libnvidia-ml.so.1 (R570) with {args.gpus} scripted H100s ({lib})")
    print(
        f"\n2. /metrics collection + formatting (generate_latest), {args.gpus} GPUs, median of 40"
    )
    scrape(args.gpus, 8, True)  # warm-up: imports, first-call caches
    for ranks in (8, 64):
        with_gpu, lines = scrape(args.gpus, ranks, True)
        without, lines0 = scrape(args.gpus, ranks, False)
        print(
            f"   {ranks:3d} ranks: {with_gpu:6.1f} ms ({lines} lines) vs {without:6.1f} ms without "
            f"GPU collectors ({lines0} lines): +{with_gpu - without:.1f} ms"
        )
    print(f"\n3. exporter process, 8 ranks at 10 steps/s, NVML at 1 Hz, {args.seconds:.0f} s")
    on = process_cost(env, True, args.seconds)
    off = process_cost(env, False, args.seconds)
    print(f"   GPU collectors on : {on[0] * 100:5.2f} % of one core, RSS {on[1]:5.1f} MiB")
    print(f"   GPU collectors off: {off[0] * 100:5.2f} % of one core, RSS {off[1]:5.1f} MiB")
    print(
        f"   GPU sampling adds : {(on[0] - off[0]) * 100:5.2f} % of one core, "
        f"{on[1] - off[1]:+.1f} MiB"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
