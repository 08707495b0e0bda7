"""Compile time of a model's initialiser: one whole-model program against one program per layer shape.

``python bench/init_compile.py [--target h100 | cpu] [--layers 1,4,16] [--model 1b]``

Before the first step a GPU run compiles the parameter initialiser. As one program
(``jit`` of the whole constructor, what ``create_sharded_model`` did before) its compile
time grows with depth, faster than linearly on an H100 (1 layer 2.1 s, 16 layers 74 s;
measured on 2026-11-22, docs/benchmarks.md). ``create_sharded_model`` now builds the model without its
layers in one small program and every layer with one jitted ``init(key, i)`` compiled
once per distinct layer shape (:class:`scaletrain.models.factory.Initialiser`). This
compiles both for each depth, each in a fresh process (so no in-process cache of the jit
or of ``ptxas`` serves the next), and prints the ratio and each process's peak resident
memory (``*_host_peak_rss_gb``: VmHWM of the process that compiled, imports included).

``--target h100`` compiles for an H100 on this host (no GPU needed) through the CUDA
compiler of ``bench/aot.py``'s venv, without GEMM autotuning (which needs a device), so
absolute seconds differ from a real H100 host; the ratio is the point. ``--target cpu``
compiles for this host's CPU and also runs both programs and checks that they give
bit-identical parameters.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import aot  # noqa: E402  (no JAX import at module level)
from common import host_memory_gb  # noqa: E402


def _compile_s(lowered: Any) -> float:
    t0 = time.perf_counter()
    lowered.compile()
    return time.perf_counter() - t0


def measure(model: dict[str, Any], layers: int, devices: list[Any], mode: str) -> dict[str, Any]:
    """Compile seconds of the ``whole`` model initialiser or of its ``per_layer`` programs (``layers`` layers);
    ``check`` runs both on this host and says whether their parameters are bit-identical."""
    import jax
    import numpy as np
    from flax import nnx

    from scaletrain.models import factory
    from scaletrain.models.llama.config import LlamaConfig
    from scaletrain.models.llama import LlamaForCausalLM

    cfg = LlamaConfig(**dict(model, num_hidden_layers=layers), scan_layers=mode == "scan")
    mesh = factory.mesh_for_config(cfg, devices)
    abstract = factory.abstract_model(LlamaForCausalLM, cfg, mesh=mesh)
    _, abstract_state, shardings = factory._split_sharded(abstract, cfg, mesh)
    make = factory._maker(LlamaForCausalLM, cfg, "float32", "float32", None, 0)
    with jax.set_mesh(mesh):
        whole = jax.jit(lambda: nnx.to_pure_dict(nnx.state(make())), out_shardings=shardings)
        init = factory.Initialiser(make, nnx.to_pure_dict(abstract_state), shardings, mesh)
        if mode == "whole":
            return {"whole_program_compile_s": round(_compile_s(whole.lower()), 2), **_host_peak("whole_program")}
        if mode in ("per_layer", "scan"):
            parts = {name: round(_compile_s(lowered), 2) for name, lowered in init.lower().items()}
            return {f"{mode}_compile_s": parts, f"{mode}_total_s": round(sum(parts.values()), 2), **_host_peak(mode)}
        a, b = whole(), init()
        same = jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b)
        return {"bit_identical": all(jax.tree.leaves(same))}


def _host_peak(mode: str) -> dict[str, float | None]:
    """This measuring process's peak resident memory (VmHWM, GB): imports, the abstract model and the compile."""
    peak = host_memory_gb("VmHWM")
    return {f"{mode}_host_peak_rss_gb": None if peak is None else round(peak, 2)}


def _in_fresh_process(argv: list[str], mode: str, layers: int) -> dict[str, Any]:
    """One measurement in its own process, so no in-process cache (jit, ptxas) serves the next."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--one", f"{mode}:{layers}"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="h100", help="h100 (AOT, CUDA compiler) or cpu")
    p.add_argument("--layers", default="1,4,16", help="depths to compile")
    p.add_argument("--model", default="1b", choices=["1b", "tiny"], help="Llama-3.2-1B's shape, or a toy")
    p.add_argument("--out", default=None, help="result JSON (default bench/results/init-compile-<target>-<date>.json)")
    p.add_argument("--scan-layers", action="store_true",
                   help="also the initialiser of the stacked layout (model.scan_layers: one vmapped layer)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # MODE:LAYERS, run by main() in a subprocess
    a = p.parse_args(argv)
    if a.target != "cpu" and not aot.has_compiler("cuda"):
        sys.exit(aot.reexec_in_venv("cuda", argv, __file__))
    import jax

    from gpu_cases import LLAMA_1B, TINY

    devices = jax.devices("cpu")[:1] if a.target == "cpu" else aot.gpu_devices(a.target, 1)[0]
    model = LLAMA_1B if a.model == "1b" else TINY
    if a.one:
        mode, layers = a.one.split(":")
        print(json.dumps(measure(model, int(layers), devices, mode)))
        return None
    base = [x for x in argv if not x.startswith("--one")]
    runs = []
    for n in (int(x) for x in a.layers.split(",")):
        r: dict[str, Any] = {"layers": n}
        modes = ("whole", "per_layer") + (("scan",) if a.scan_layers else ()) + (("check",) if a.target == "cpu" else ())
        for mode in modes:
            r.update(_in_fresh_process(base, mode, n))
        r["speedup"] = round(r["whole_program_compile_s"] / r["per_layer_total_s"], 2)
        runs.append(r)
        print(f"{n:>3} layers: whole program {r['whole_program_compile_s']:7.2f} s, per layer "
              f"{r['per_layer_total_s']:6.2f} s ({r['speedup']}x); host peak RSS whole program "
              f"{_gb(r['whole_program_host_peak_rss_gb'])}, per layer {_gb(r['per_layer_host_peak_rss_gb'])}"
              + (f"; stacked layers (scan_layers) {r['scan_total_s']:6.2f} s, host peak RSS "
                 f"{_gb(r['scan_host_peak_rss_gb'])}" if "scan_total_s" in r else "")
              + (f", bit-identical: {r['bit_identical']}" if "bit_identical" in r else ""), flush=True)
    result = {"date": dt.datetime.now().isoformat(timespec="seconds"),
              "command": "python bench/init_compile.py " + " ".join(argv), "target": a.target,
              "device": str(devices[0].device_kind), "jax": jax.__version__, "model": a.model, "runs": runs}
    out = a.out or os.path.join(HERE, "results", f"init-compile-{a.target}-{a.model}-{dt.date.today()}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")
    return result


def _gb(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f} GB"


if __name__ == "__main__":
    main()
