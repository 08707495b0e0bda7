"""glibc's huge-page tunable: set for CLI runs and CPU Ray workers, and it cuts page faults."""

import json
import os
import subprocess
import sys

import pytest

from scaletrain import host_memory
from scaletrain.launch.ray.cluster import make_worker_env

needs_hugepages = pytest.mark.skipif(not host_memory.hugepages_supported(),
                                     reason="needs Linux, glibc >= 2.35 and transparent huge pages (madvise)")

# malloc, touch and free a 256 MB buffer repeatedly, as XLA does with a step's scratch buffer
# (libc directly: numpy already madvises its own large arrays), counting minor page faults
# over the repeats after the first
PROBE = """
import ctypes, json, resource
from scaletrain.host_memory import hugepages_enabled
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def once():
    p = libc.malloc(256 * 2**20)
    ctypes.memset(p, 1, 256 * 2**20)
    libc.free(p)
once()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    once()
print(json.dumps({"enabled": hugepages_enabled(), "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 3}))
"""


def test_env_appends_to_existing_tunables_once():
    env = host_memory.hugepage_env({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0", "X": "1"})
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.tcache_count=0:{host_memory.TUNABLE}" and env["X"] == "1"
    assert host_memory.hugepage_env(env)["GLIBC_TUNABLES"] == env["GLIBC_TUNABLES"]


def test_switch_off(monkeypatch):
    monkeypatch.setenv("SCALETRAIN_HUGEPAGES", "0")
    assert not host_memory.hugepages_supported()
    assert "GLIBC_TUNABLES" not in make_worker_env(use_gpu=False, use_tpu=False)


@needs_hugepages
def test_cpu_ray_workers_start_with_the_tunable():
    assert make_worker_env(use_gpu=False, use_tpu=False)["GLIBC_TUNABLES"] == host_memory.TUNABLE
    assert "GLIBC_TUNABLES" not in make_worker_env(use_gpu=True, use_tpu=False)


@needs_hugepages
def test_reexec_restarts_a_script_with_the_tunable(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import sys\nfrom scaletrain.host_memory import reexec_with_hugepages, hugepages_enabled\n"
                      "reexec_with_hugepages()\nprint(hugepages_enabled(), sys.argv[1:])\n")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, str(script), "a", "b"], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "True ['a', 'b']"


@needs_hugepages
def test_hugepages_cut_page_faults_of_a_reallocated_buffer():
    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}

    def probe(env):
        out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    off, on = probe(plain), probe(host_memory.hugepage_env(plain))
    assert off["enabled"] is False and on["enabled"] is True
    pages = 256 * 2**20 // 4096
    assert off["faults"] > 0.9 * pages  # mmapped afresh each time: every 4 KiB page faults again
    assert on["faults"] < 0.05 * pages  # 2 MiB pages: 512x fewer faults
