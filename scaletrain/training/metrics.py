"""Throughput, TFLOP/s and MFU.

MFU = achieved model FLOP/s / (peak FLOP/s per device x devices). Model FLOPs per
token come from the config (:meth:`LlamaConfig.flops_per_token`). The peak comes
from a table of accelerators (dense bf16), can be overridden with
``peak_flops_per_device``, and on a CPU is measured once with a float32 matmul:
its FLOPs per CPU-second of this process times the machine's physical cores
(:func:`cpu_peak_flops`). A wall-clock rate alone was wrong twice over: XLA runs one
device's 1024² matmul on one or two threads, depending on how busy the other cores
are at that moment, while a training step on several (fake) devices uses them all;
and a machine busy during the measurement gave a low "peak", so MFU above 100 %
was logged once the load went away.
"""

from __future__ import annotations

import functools
import math
import os
import time

import jax
import jax.numpy as jnp

# dense bf16 peak FLOP/s per device, by substrings of ``device.device_kind``
PEAK_FLOPS: dict[str, float] = {
    "h200": 989e12,
    "h100": 989e12,
    "gh200": 989e12,
    "a100": 312e12,
    "l40s": 362e12,
    "a10g": 125e12,
    "l4": 121e12,
    "v100": 125e12,
    "tpu v6": 918e12,
    "tpu v5p": 459e12,
    "tpu v5 lite": 197e12,
    "tpu v5e": 197e12,
    "tpu v5": 459e12,
    "tpu v4": 275e12,
    "tpu v3": 123e12,
}


def physical_cores(cpus: set[int] | None = None, sys_cpu: str = "/sys/devices/system/cpu") -> int:
    """Physical cores among the CPUs this process may run on (``sched_getaffinity``).

    Hyperthreads of one core share its FMA units, so they add no peak; where the
    topology files are missing each logical CPU counts as a core.
    """
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topo = os.path.join(sys_cpu, f"cpu{cpu}", "topology")
        try:
            with open(os.path.join(topo, "physical_package_id")) as f, open(os.path.join(topo, "core_id")) as g:
                cores.add((f.read().strip(), g.read().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def cpu_peak_flops(flops: float, wall_s: float, cpu_s: float, cores: int) -> float:
    """The machine's peak from one timed matmul of ``flops``: per-core rate x ``cores``.

    ``cpu_s`` (CPU time of this process) does not grow when other processes take
    the cores, nor with how many threads XLA chose, so FLOPs per CPU-second is
    the rate of one busy core; the wall-clock rate is a floor for when CPU time
    is inflated (threads spinning while they wait).
    """
    per_core = flops / cpu_s * cores if cpu_s > 0 else 0.0
    return max(flops / wall_s if wall_s > 0 else 0.0, per_core)


@functools.lru_cache(maxsize=None)
def measured_cpu_peak_flops(n: int = 1024, repeats: int = 5) -> float:
    """Peak float32 FLOP/s of this machine's CPUs, from the best of ``repeats`` matmuls."""
    device = jax.local_devices(backend="cpu")[0]
    a = jax.device_put(jnp.ones((n, n), jnp.float32), device)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    wall = cpu = math.inf
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        f(a).block_until_ready()
        wall, cpu = min(wall, time.perf_counter() - t), min(cpu, time.process_time() - c)
    return cpu_peak_flops(2.0 * n**3, wall, cpu, physical_cores())


def peak_flops_per_device(override: float | None = None) -> float:
    """Peak FLOP/s of one device: the override, the table, or a CPU measurement."""
    if override:
        return float(override)
    device = jax.devices()[0]
    kind = device.device_kind.lower()
    for key, value in PEAK_FLOPS.items():
        if key in kind:
            return value
    if device.platform == "cpu":
        # fake CPU devices share the same cores: the peak of the machine is split
        return measured_cpu_peak_flops() / max(1, jax.local_device_count())
    return float("nan")


def throughput(tokens: float, seconds: float, flops_per_token: float, peak_per_device: float,
               num_devices: int) -> dict[str, float]:
    """tokens/s, model TFLOP/s and MFU for ``tokens`` processed in ``seconds``."""
    if seconds <= 0:
        return {"tokens_per_s": float("nan"), "tflops": float("nan"), "mfu": float("nan")}
    tps = tokens / seconds
    flops = tps * flops_per_token
    return {"tokens_per_s": tps, "tflops": flops / 1e12, "mfu": flops / (peak_per_device * num_devices)}
