"""MFU's CPU peak: measured per CPU-second and scaled to the machine's physical cores.

The old peak was a wall-clock matmul rate: measured while other processes held the
cores (or while XLA ran that one device's matmul on a single thread) it came out
several times too low, and MFU above 100 % was logged. Only the formulas are tested
here; timings themselves never are.
"""

from __future__ import annotations

import pytest

from scaletrain.training.metrics import (
    cpu_peak_flops,
    measured_cpu_peak_flops,
    peak_flops_per_device,
    physical_cores,
    throughput,
)

FLOPS = 2.0 * 1024**3


def test_a_busy_machine_does_not_lower_the_peak():
    # idle: one matmul took 20 ms on one thread of a 2-core machine (20 ms of CPU time)
    idle = cpu_peak_flops(FLOPS, wall_s=0.020, cpu_s=0.020, cores=2)
    # loaded: another process held the cores, so the same work took 10x the wall time
    busy = cpu_peak_flops(FLOPS, wall_s=0.200, cpu_s=0.020, cores=2)
    assert idle == busy == pytest.approx(2 * FLOPS / 0.020, rel=1e-12)  # float rounding only
    # the old wall-clock peak was 10x lower, so the same training measured 10x the MFU
    assert FLOPS / 0.200 == pytest.approx(busy / 20)


def test_the_peak_counts_every_core_whatever_threads_xla_used():
    one_thread = cpu_peak_flops(FLOPS, wall_s=0.020, cpu_s=0.020, cores=4)
    four_threads = cpu_peak_flops(FLOPS, wall_s=0.005, cpu_s=0.020, cores=4)
    assert one_thread == four_threads
    # CPU time inflated by spinning threads: the wall-clock rate is the floor
    assert cpu_peak_flops(FLOPS, wall_s=0.005, cpu_s=0.100, cores=2) == FLOPS / 0.005


def _topology(root, cpu, package, core):
    topo = root / f"cpu{cpu}" / "topology"
    topo.mkdir(parents=True)
    (topo / "physical_package_id").write_text(f"{package}\n")
    (topo / "core_id").write_text(f"{core}\n")


def test_hyperthreads_are_not_extra_cores(tmp_path):
    for cpu, (package, core) in enumerate([(0, 0), (0, 1), (0, 0), (0, 1), (1, 0), (1, 0)]):
        _topology(tmp_path, cpu, package, core)
    assert physical_cores({0, 1, 2, 3, 4, 5}, str(tmp_path)) == 3
    assert physical_cores({0, 2}, str(tmp_path)) == 1  # two siblings of one core
    assert physical_cores({7, 8}, str(tmp_path)) == 2  # no topology: each CPU counts


def test_mfu_formula_and_the_cpu_peak_split_over_fake_devices():
    import jax

    # 8 fake CPU devices share the machine: per device 1/8 of it, so MFU counts it once
    assert peak_flops_per_device() * jax.local_device_count() == pytest.approx(measured_cpu_peak_flops())
    perf = throughput(tokens=1000, seconds=2.0, flops_per_token=6e6, peak_per_device=1e9, num_devices=4)
    assert perf == pytest.approx({"tokens_per_s": 500.0, "tflops": 3e-3, "mfu": 0.75}, rel=1e-12)  # rounding only
    assert peak_flops_per_device(123.0) == 123.0
