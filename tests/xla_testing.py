"""XLA's cheapest CPU compile setting, for the whole suite: the pytest process (tests/conftest.py) and its children.

Why: the suite's programs are tiny, so its CPU goes to XLA's CPU compiler (LLVM), not to running them. LLVM's
cheapest setting compiles the same HLO ~30 % faster (measured: tests/test_lora_scan.py 42.5 -> 30.4 s of
CPU in one process). XLA's older loop emitters instead of its MLIR fusion emitters cut the CPU further: 11-44 %
per file (tests/test_scan_layers.py 57.5 -> 32.4 CPU-s, three conformance families 87.5 -> 56.6, measured one after
the other on 2026-11-28). It changes float rounding (fused multiply-adds), so a result compared bitwise with
another must come from a process with the same flags: a child inherits them with the test process's
environment or takes them from :func:`child_xla_flags`. Ray's workers do not: the launcher sets their
flags (XLA's default), so their numbers are compared with this process's only within a tolerance.
"""

from __future__ import annotations

CHEAP_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                 "--xla_cpu_use_fusion_emitters=false")


def child_xla_flags(devices: int) -> str:
    """``XLA_FLAGS`` for a child process with ``devices`` CPU devices, compiled at the cheap setting."""
    return f"--xla_force_host_platform_device_count={devices} {CHEAP_COMPILE}"
