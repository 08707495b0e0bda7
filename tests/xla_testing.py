"""XLA flags for the suite's child processes that compile the same tiny programs on both sides of a comparison.

Why: such a child spends most of its CPU in XLA's CPU compiler (LLVM), not in running the programs. LLVM's
cheapest setting compiles the same HLO ~30 % faster (measured: tests/test_lora_scan.py 42.5 -> 30.4 s of
CPU in one process). It changes float rounding (fused multiply-adds), so it is only for children compared
with other children that run with the same flags, never with this process (which compiles at XLA's
default) or with Ray's workers (the launcher sets their flags).
"""

from __future__ import annotations

CHEAP_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def child_xla_flags(devices: int) -> str:
    """``XLA_FLAGS`` for a child process with ``devices`` CPU devices, compiled at the cheap setting."""
    return f"--xla_force_host_platform_device_count={devices} {CHEAP_COMPILE}"
