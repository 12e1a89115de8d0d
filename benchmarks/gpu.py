"""GPU telemetry cost: NVML sampling per GPU, /metrics scrape time, exporter CPU and RSS.

    python benchmarks/gpu.py [--gpus 8 --seconds 30]

Runs the real nvidia-ml-py code against the fake ``libnvidia-ml.so.1`` of ``tests/fakes/libnvml``
(compiled here with gcc), or against the real driver with ``--real``. Four parts, each with a
baseline measured in the same run:

0. The sampling schedule with a driver's call costs: what each NVML call the sampler makes
   costs (median of 60 calls on GPU 0), then a :class:`GpuSampler` pass over every GPU with
   every reading every pass (the schedule before the slow readings had their own cadence)
   against the default schedule (energy and PCIe counters every
   ``nvml_slow_interval_seconds`` at a 1 s pass), interleaved a cycle at a time: mean cost
   per GPU per pass, and the medians of the passes without and with the slow readings. On
   the fake library the slow calls are given the H200's measured costs
   (``tests.fakes.libnvml.H200_COSTS_US``); ``--real`` measures the host's driver.
1. Sampling, per driver branch (a fake library shaped like R470, R535, R550 and R570, each in
   its own process): one :class:`GpuSampler` pass over every GPU, every reading every pass,
   against the same NVML calls made straight through pynvml in a bare loop with the entry
   points that branch has (what the error policy, the version fallbacks and the snapshot cost
   on top). ``--real`` measures the host's driver instead.
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
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fakes.libnvml import (  # noqa: E402
    BRANCH_SYMBOLS,
    CONFIG_ENV,
    H200_COSTS_US,
    build,
    h100,
    load,
    write_config,
)
from trainmon_client import _protocol as P  # noqa: E402


def median_ms(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def timed(fn) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(wall, CPU time of this thread) of one call of ``fn``, in seconds."""
    w0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - w0, time.thread_time() - c0


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


def call_costs() -> None:
    """Print the median cost of each NVML call a sampling pass makes, on GPU 0."""
    from trainmon_exporter import nvml
    from trainmon_exporter.nvml import NvmlError, PynvmlBackend

    b = PynvmlBackend()
    b.init()
    h = b.handle(0)
    events = b.xid_events([h])
    gpm: list[object] = []

    def gpm_sample() -> None:
        gpm.append(b.gpm_sample(h))
        while len(gpm) > 2:
            b.gpm_free(gpm.pop(0))

    def gpm_metrics() -> None:
        b.gpm_metrics(gpm[-2], gpm[-1], (2, 3, 5, 10))

    fast_fields = (nvml.FIELD_MEMORY_TEMP, nvml.FIELD_NVLINK_TX_KIB, nvml.FIELD_NVLINK_RX_KIB)
    calls = [
        ("nvmlDeviceGetTotalEnergyConsumption (slow)", lambda: b.energy(h)),
        (
            "nvmlDeviceGetFieldValues, PCIe TX + RX (slow)",
            lambda: b.field_values(h, (nvml.FIELD_PCIE_TX_BYTES, nvml.FIELD_PCIE_RX_BYTES)),
        ),
        ("nvmlDeviceGetFieldValues, memory temp + NVLink", lambda: b.field_values(h, fast_fields)),
        ("nvmlDeviceGetPowerUsage", lambda: b.power_usage(h)),
        ("nvmlDeviceGetUtilizationRates", lambda: b.utilization(h)),
        ("nvmlDeviceGetMemoryInfo", lambda: b.memory(h)),
        ("nvmlDeviceGetTemperature", lambda: b.temperature(h)),
        ("nvmlDeviceGetClockInfo (SM)", lambda: b.clock(h, nvml.CLOCK_SM)),
        ("clock-event reasons", lambda: b.clock_event_reasons(h)),
        ("nvmlDeviceGetTotalEccErrors (one of 4)", lambda: b.ecc_errors(h, False, False)),
        ("nvmlDeviceGetRemappedRows", lambda: b.remapped_rows(h)),
        ("compute processes", lambda: b.processes(h)),
        ("nvmlGpmSampleAlloc + nvmlGpmSampleGet", gpm_sample),
        ("nvmlGpmMetricsGet (4 metrics)", gpm_metrics),
        ("nvmlEventSetWait(0 ms), once a pass for all GPUs", lambda: b.poll_xid(events)),
    ]
    print("   NVML call on GPU 0, median of 60 (through PynvmlBackend), wall and CPU time:")
    for name, fn in calls:
        try:
            fn()
            wall, cpu = zip(*(timed(fn) for _ in range(60)), strict=True)
            cost = (
                f"{statistics.median(wall) * 1e6:7,.0f} µs "
                f"({statistics.median(cpu) * 1e6:,.0f} µs CPU)"
            )
        except (NvmlError, IndexError) as exc:  # IndexError: GPM without two samples
            cost = f"not available ({type(exc).__name__})"
        print(f"     {name:<48} {cost}")
    for sample in gpm:
        b.gpm_free(sample)
    b.shutdown()


def schedule(n_gpus: int, cycles: int) -> None:
    """Print a pass with every reading every pass against the default two-cadence schedule."""
    from trainmon_exporter.nvml import PynvmlBackend
    from trainmon_exporter.sampler import SLOW_INTERVAL_SECONDS, GpuSampler

    call_costs()
    before = GpuSampler(PynvmlBackend(), interval=1.0, slow_interval=1.0)
    now = GpuSampler(PynvmlBackend(), interval=1.0, slow_interval=SLOW_INTERVAL_SECONDS)
    every = now.slow_every
    for s in (before, now):
        assert s.open(), s.snapshot.error
        for _ in range(every):  # warm-up: one whole cycle
            s.sample_once()
    times: dict[int, list[tuple[float, float, bool]]] = {id(before): [], id(now): []}
    for _ in range(cycles):  # interleaved a cycle at a time, so load drifts hit both alike
        for s in (before, now):
            for _ in range(every):
                read_at = s.snapshot.gpus[0].readings.slow_sampled_at
                wall, cpu = timed(s.sample_once)
                slow = s.snapshot.gpus[0].readings.slow_sampled_at != read_at  # read this pass
                times[id(s)].append((wall, cpu, slow))
    for s in (before, now):
        snap = s.snapshot
        assert len(snap.gpus) == n_gpus and not snap.read_errors, snap
        assert all(g.readings.energy_joules is not None for g in snap.gpus), snap
        s.stop()
    print(
        f"   {n_gpus} GPUs, {cycles * every} passes of each schedule, interleaved {every} "
        "passes at a time; per GPU per pass, wall time (CPU time of the sampling thread):"
    )

    def per_gpu(ts: list[float], how: Callable[[list[float]], float]) -> str:
        return f"{how(ts) / n_gpus * 1e6:6,.0f} µs" if ts else "     – µs"

    mean: dict[int, tuple[float, float]] = {}
    for s, label in (
        (before, "every reading every pass (before)"),
        (now, f"energy + PCIe every {every} passes (now)"),
    ):
        ts = times[id(s)]
        walls, cpus = [w for w, _, _ in ts], [c for _, c, _ in ts]
        mean[id(s)] = (statistics.mean(walls), statistics.mean(cpus))
        fast = [w for w, _, slow in ts if not slow]
        slow = [w for w, _, slow in ts if slow]
        print(
            f"     {label:<40} mean {per_gpu(walls, statistics.mean)} "
            f"({per_gpu(cpus, statistics.mean).strip()} CPU) | median wall without the slow "
            f"readings {per_gpu(fast, statistics.median)}, with them "
            f"{per_gpu(slow, statistics.median)}"
        )
    (w0, c0), (w1, c1) = mean[id(before)], mean[id(now)]
    print(f"     now / before: {w1 / w0:.3f} wall, {c1 / c0:.3f} CPU")


def schedule_fake(n_gpus: int, cycles: int) -> None:
    """Part 0 on the fake R570 library with the H200's costs, in a child process."""
    import subprocess

    costs = ", ".join(f"{k} {v:,} µs" for k, v in H200_COSTS_US.items())
    print(f"\n0. The sampling schedule with an H200's call costs (fake R570: {costs})")
    root = Path(tempfile.mkdtemp(prefix="tm-fake-nvml-costs-"))
    cfg = root / "gpus.conf"
    write_config(cfg, [h100(i, procs=f"{1000 + i}:{2**30}") for i in range(n_gpus)], H200_COSTS_US)
    lib = build(root)
    env = {**os.environ, "LD_LIBRARY_PATH": str(lib.parent), CONFIG_ENV: str(cfg)}
    cmd = [sys.executable, __file__, "--gpus", str(n_gpus), "--schedule-only", str(cycles)]
    subprocess.run(cmd, env=env, check=True)


def sampling(n_gpus: int, label: str) -> None:
    """Print one branch's sampler pass against the bare loop (this process's library)."""
    import pynvml

    from trainmon_exporter.nvml import PynvmlBackend
    from trainmon_exporter.sampler import GpuSampler

    s = GpuSampler(PynvmlBackend(), slow_interval=1.0)  # every reading, as the bare loop
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
    ap.add_argument(
        "--cycles", type=int, default=30, help="part 0: slow-reading cycles of each schedule"
    )
    ap.add_argument("--sampling-only", metavar="LABEL", help=argparse.SUPPRESS)  # child of part 1
    ap.add_argument("--schedule-only", type=int, metavar="CYCLES", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        args.gpus, args.seconds, args.cycles = 2, 1.0, 3
    if args.sampling_only:
        sampling(args.gpus, args.sampling_only)
        return 0
    if args.schedule_only:
        schedule(args.gpus, args.schedule_only)
        return 0
    env: dict[str, str] = {}
    if args.real:
        print("\n0. The sampling schedule on the host driver")
        schedule(args.gpus, args.cycles)
        print(f"\n1. NVML sampling, {args.gpus} GPUs, median of 300 passes, host driver")
        sampling(args.gpus, "host")
    else:
        schedule_fake(args.gpus, args.cycles)
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
