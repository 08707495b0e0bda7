"""Throughput, TFLOP/s and MFU.

MFU = achieved model FLOP/s / (peak FLOP/s per device x devices). Model FLOPs per
token come from the config (:meth:`LlamaConfig.flops_per_token`). The peak comes
from a table of accelerators (dense bf16), can be overridden with
``peak_flops_per_device``, and on a CPU is measured once with a float32 matmul.
"""

from __future__ import annotations

import functools
import math
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


@functools.lru_cache(maxsize=None)
def measured_cpu_peak_flops(n: int = 1024, repeats: int = 5) -> float:
    """Best-of-``repeats`` float32 matmul FLOP/s of one CPU device (all its cores)."""
    device = jax.local_devices(backend="cpu")[0]
    a = jax.device_put(jnp.ones((n, n), jnp.float32), device)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best


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
