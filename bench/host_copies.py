"""Host memory of the run summary's parameter digest: before (``jax.device_get`` per leaf) and now.

``python bench/host_copies.py [--layers 1] [--devices 8]``

Every ``Trainer.train()`` ends with ``params_sha256(state.params)`` in ``summary.json``.
It used to read each parameter with ``jax.device_get``, and JAX keeps that host copy
cached on the array while the array lives (``scaletrain/parallel/host.py``): on a GPU the
whole model stayed on the host after the run (4.9 GB for the 1B model, float32). On a
CPU the copy is cached only for an array sharded over several devices, so this builds
Llama-3.2-1B's shape (``--layers`` of it) sharded over ``--devices`` fake CPU devices
(fsdp) and measures, each way in its own process: resident memory before the digest,
after it (what stays), and the peak while it runs (VmHWM, reset before).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def device_get_digest(params: Any) -> str:
    """The digest as it was computed before: each whole leaf through ``jax.device_get``, then ``tobytes``."""
    import jax
    import numpy as np

    digest = hashlib.sha256()
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in sorted(flat, key=lambda kv: jax.tree_util.keystr(kv[0])):
        host = np.asarray(jax.device_get(leaf))
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(str(host.dtype).encode())
        digest.update(np.ascontiguousarray(host).tobytes())
    return digest.hexdigest()


def measure(way: str, layers: int, devices: int) -> dict[str, Any]:
    import jax
    from flax import nnx

    from common import host_memory_gb, reset_host_peak
    from gpu_cases import LLAMA_1B
    from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
    from scaletrain.training.state import params_sha256

    cfg = LlamaConfig(**dict(LLAMA_1B, num_hidden_layers=layers), sharding_axis_dims=(1, devices, 1, 1, 1))
    model, _ = create_sharded_model(LlamaForCausalLM, cfg, dtype="bfloat16", param_dtype="float32")
    params = jax.block_until_ready(nnx.to_pure_dict(nnx.state(model)))
    reset_host_peak()
    before, t0 = host_memory_gb("VmRSS"), time.perf_counter()
    digest = (device_get_digest if way == "device_get" else params_sha256)(params)
    seconds = time.perf_counter() - t0
    return {"way": way, "params_gb": round(sum(x.nbytes for x in jax.tree.leaves(params)) / 1e9, 2),
            "rss_before_gb": round(before, 2), "rss_after_gb": round(host_memory_gb("VmRSS"), 2),
            "peak_during_gb": round(host_memory_gb("VmHWM"), 2), "seconds": round(seconds, 2), "sha256": digest}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=1, help="decoder layers of the 1B shape (1: 0.32B parameters)")
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices the parameters are sharded over")
    p.add_argument("--out", default=None, help="result JSON (default bench/results/host-copies-<date>.json)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a way, measured in this (child) process
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(measure(a.one, a.layers, a.devices)))
        return []
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={a.devices}"}
    runs = []
    for way in ("device_get", "params_sha256"):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--layers", str(a.layers), "--devices",
                              str(a.devices), "--one", way], env=env, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        runs.append(r)
        print(f"{way:>13}: {r['params_gb']} GB of parameters; host RSS {r['rss_before_gb']} GB before, "
              f"{r['rss_after_gb']} GB after (+{r['rss_after_gb'] - r['rss_before_gb']:.2f}), peak "
              f"{r['peak_during_gb']} GB (+{r['peak_during_gb'] - r['rss_before_gb']:.2f}); {r['seconds']} s")
    print("same digest:", runs[0]["sha256"] == runs[1]["sha256"])
    from common import write_record

    write_record({"command": "python bench/host_copies.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  "layers": a.layers, "devices": a.devices, "runs": runs}, "host-copies", a.out)
    return runs


if __name__ == "__main__":
    main()
