"""Compile scaletrain's train step for accelerators this host does not have: memory and kernels, ahead of time.

``python bench/aot.py [--target h100 | v5e:2x4 | ...] [--batch 8] [--seq 2048] [--remat none] [--layers N]``

XLA's GPU compiler runs without a GPU when it is given the device's description
(``bench/aot_targets/<target>.txtpb``) instead of asking a driver, and libtpu compiles
for a named TPU topology (``v5e:2x4``, ``v6e:2x4``, ``v5p:2x2x1``, ``v4:2x2x1``) without
TPUs. This compiles the exact step the Trainer jits (``make_step_functions`` over the
abstract train state of ``bench/gpu.py``'s Llama-3.2-1B, or Llama-3.1-8B, bf16 compute,
float32 master weights and AdamW) for those devices, once for each kind of batch the
loader gives (``--batches``):

- ``packed``: ``segment_ids`` and ``positions`` (packed documents, padding), so the
  attention mask is a ``[B, 1, T, S]`` tensor (on cuDNN: a bias);
- ``tokens``: ``input_ids`` alone, what the loader gives for rows that are each one
  unpadded sequence (``PackedRows.single_segment``): plain causal attention.

It reports XLA's per-device memory analysis (temporaries, arguments, outputs,
aliased/donated bytes, and their sum against the device's memory; on TPU a step that
does not fit fails to compile, reported as ``fits: false``), which cuDNN attention
kernels the step calls, the custom-call, conditional and collective census, compile
time, and the compiling process's host memory (``host_peak_rss_gb``: VmHWM while that one
step lowers and compiles, reset before each; ``host_rss_before_compile_gb``). ``--layers N``
compiles the model with ``num_hidden_layers=N`` instead, to see how compile time and host
memory grow with depth. Nothing runs, so no speed: time and MFU come from ``bench/gpu.py``
on a real device. Without autotuning (no device) XLA may pick other GPU GEMM kernels than on the
device; measured on an H100 spec, forcing cuBLAS instead of Triton GEMMs moved the
temporaries by 0.5 of 25 GB.

The compilers come with JAX's CUDA plugin or libtpu, which scaletrain's environment does
not have: the first run creates ``bench/.venvs/aot_cuda`` (``pip install .[cuda12]``,
~6 GB of CUDA wheels) or ``bench/.venvs/aot_tpu`` (``.[tpu]``, ~1.8 GB), see
``bench/envs.py``, and re-runs itself there with this checkout first on ``PYTHONPATH``.
``--cpu`` compiles for this host's CPU instead and ``--tiny`` a toy model (the tests do
both).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

#: the environment each compiler needs on a host without the devices
AOT_ENV = {
    "cuda": {
        "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",  # else the plugin's cuInit check fails and it is not registered
        "CUDA_VISIBLE_DEVICES": "-1",
        "XLA_FLAGS": "--xla_gpu_autotune_level=0",  # autotuning would need a device
    },
    "tpu": {
        "JAX_PLATFORMS": "cpu",  # no TPU backend to initialise: libtpu is used for the topology and compiler only
        "TPU_SKIP_MDS_QUERY": "1",  # not on a Cloud TPU VM: no metadata server
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",  # libtpu otherwise locks /tmp/libtpu_lockfile per process
    },
}
#: HBM per TPU device by ``device_kind`` (v4 topologies list each chip's two cores as devices)
TPU_MEMORY = {"TPU v5 lite": 16 * 2**30, "TPU v6 lite": 32 * 2**30, "TPU v5": 95 * 2**30, "TPU v4": 16 * 2**30}
VENV = {"cuda": "aot_cuda", "tpu": "aot_tpu"}

from common import host_memory_gb, reset_host_peak  # noqa: E402  (no JAX import)
from gpu_cases import LLAMA_1B, TINY  # noqa: E402  (constants only: no JAX import)

#: Llama-3.1-8B's architecture (its config.json)
LLAMA_8B: dict[str, Any] = dict(
    LLAMA_1B, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    tie_word_embeddings=False,
)
#: Gemma-3-1B's architecture (google/gemma-3-1b-pt's config.json): 26 layers, five local (window 512,
#: RoPE base 1e4) to each global one (RoPE base 1e6), a 262k vocabulary, tied head
GEMMA3_1B: dict[str, Any] = dict(
    model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
    num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_theta=1e6, rope_local_base_freq=1e4, sliding_window=512, sliding_window_pattern=6,
    query_pre_attn_scalar=256, tie_word_embeddings=True,
)
#: GPT-OSS-20B's architecture (openai/gpt-oss-20b's config.json; its MXFP4 experts load dequantised, so the
#: step trains bf16/fp32 weights): 24 layers alternating a 128-token window and full attention, attention
#: sinks, top-4 of 32 biased experts, YaRN; 20.9B parameters, 3.6B active
GPT_OSS_20B: dict[str, Any] = dict(
    model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
    num_attention_heads=64, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_theta=150000.0, rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                       "truncate": False, "original_max_position_embeddings": 4096},
    sliding_window=128, num_local_experts=32, num_experts_per_tok=4, swiglu_limit=7.0, attention_bias=True,
    router_aux_loss_coef=0.9, tie_word_embeddings=False,
)
#: Qwen3.5-35B-A3B's language model (Qwen/Qwen3.5-35B-A3B's text_config): 40 layers, three Gated DeltaNet layers
#: to one gated full-attention layer, each MLP top-8 of 256 experts plus a gated shared expert; 34.66B parameters,
#: 3.3B active. Its two layer kinds hold different parameters, so no scan_layers
QWEN3_5_35B_A3B: dict[str, Any] = dict(
    model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, max_position_embeddings=262144,
    rms_norm_eps=1e-6, rope_theta=1e7, partial_rotary_factor=0.25, router_aux_loss_coef=0.001,
    tie_word_embeddings=False,
)
MODELS = {"1b": LLAMA_1B, "8b": LLAMA_8B, "gemma3-1b": GEMMA3_1B, "gpt-oss-20b": GPT_OSS_20B,
          "qwen3.5-35b-a3b": QWEN3_5_35B_A3B}


def platform_of(target: str) -> str:
    """``tpu`` for a TPU topology name (``v5e:2x4``), ``cuda`` for a GPU spec in aot_targets/."""
    return "tpu" if ":" in target else "cuda"


def has_compiler(platform: str) -> bool:
    """Whether this Python has JAX's CUDA plugin or libtpu."""
    import importlib.util

    name = "jax_plugins.xla_cuda12" if platform == "cuda" else "libtpu"
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def reexec_in_venv(platform: str, argv: list[str], script: str = __file__) -> int:
    """Run ``script`` (this one by default) again in the venv with that platform's compiler (created on first use)."""
    from envs import ensure_venv

    interp = ensure_venv(VENV[platform])
    if interp.python is None:
        print(f"[aot] {interp.reason}", file=sys.stderr)
        return 1
    env = {**os.environ, **AOT_ENV[platform], "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([interp.python, os.path.abspath(script), *argv], env=env).returncode


def gpu_devices(target: str, count: int = 1) -> tuple[list[Any], dict[str, Any]]:
    """The devices of a one-host topology of ``count`` GPUs described by ``bench/aot_targets/<target>.txtpb``."""
    from jax.experimental import topologies

    with open(os.path.join(HERE, "aot_targets", f"{target}.txtpb")) as f:
        spec = f.read()
    topology = topologies.get_topology_desc(platform="cuda", target_config=spec, topology=f"1x1x{count}")
    memory = int(re.search(r"device_memory_size:\s*(\d+)", spec).group(1))  # type: ignore[union-attr]
    name = re.search(r'device_description_str:\s*"([^"]+)"', spec)
    cc = re.search(r"cuda_compute_capability\s*\{\s*major:\s*(\d+)(?:\s*minor:\s*(\d+))?", spec)
    capability = (int(cc.group(1)), int(cc.group(2) or 0)) if cc else (0, 0)
    return list(topology.devices), {"device_memory_bytes": memory, "device": name.group(1) if name else target,
                                    "compute_capability": capability}


def tpu_devices(target: str) -> tuple[list[Any], dict[str, Any]]:
    """The devices of the TPU topology named ``target`` (``v5e:2x4``: 8 chips)."""
    from jax.experimental import topologies

    devices = list(topologies.get_topology_desc(topology_name=target, platform="tpu").devices)
    kind = devices[0].device_kind
    return devices, {"device_memory_bytes": TPU_MEMORY.get(kind), "device": f"{kind} ({target})"}


def answer_cudnn_checks_for(capability: tuple[int, int]) -> None:
    """JAX's cuDNN attention asks the local GPU for its compute capability; answer for the target."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    def parse(c: str) -> tuple[int, ...]:
        return tuple(int(x) for x in c.split("."))

    fa.check_compute_capability = lambda c: capability >= parse(c)
    fa.is_cuda_compute_capability_equal = lambda c: capability == parse(c)


def compile_step(cfg: Any, devices: list[Any], batch: int, seq: int, dtype: str, kind: str,
                 dump: str | None = None) -> dict[str, Any]:
    """Lower and compile the Trainer's train step for ``devices`` against shapes only
    (the optimized HLO goes to ``dump/<kind>.hlo.txt`` if ``dump`` is given)."""
    import jax
    import jax.numpy as jnp

    from scaletrain.models.factory import abstract_sharded_model, mesh_for_config
    from scaletrain.models.registry import get_modules_by_type
    from scaletrain.training.state import abstract_train_state
    from stepfn import benchmark_optimizer, jit_train_step, memory_of

    mesh = mesh_for_config(cfg, devices)
    graphdef, params = abstract_sharded_model(get_modules_by_type(cfg.model_type)[1], cfg, dtype=dtype,
                                              param_dtype="float32", mesh=mesh)
    args, tx = benchmark_optimizer(batch, seq, dtype, "float32")
    state = abstract_train_state(graphdef, params, tx, mesh)
    train, bs, chunk = jit_train_step(cfg, tx, state, mesh, args, seq)
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=bs)
    data = {"input_ids": ids} if kind == "tokens" else {"input_ids": ids, "segment_ids": ids, "positions": ids}
    # the host's peak while this one step lowers and compiles (reset: an earlier batch kind's does not count)
    peak_is_this_compile = reset_host_peak()
    rss_before = host_memory_gb("VmRSS")
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        lowered = train.lower(state, data)
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as exc:  # TPU: a step that does not fit fails to compile
            if "RESOURCE_EXHAUSTED" not in str(exc):
                raise
            return {"batch_kind": kind, "num_params": state.num_params, "fits": False,
                    "compile_s": round(time.perf_counter() - t0, 1), "error": str(exc).splitlines()[0][:400],
                    **_host_memory(rss_before, peak_is_this_compile)}
    seconds = time.perf_counter() - t0
    host = _host_memory(rss_before, peak_is_this_compile)
    hlo = compiled.as_text()
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, f"{kind}.hlo.txt"), "w") as f:
            f.write(hlo)
    memory = memory_of(compiled)
    calls: dict[str, int] = {}
    for target in re.findall(r'custom_call_target="([^"]+)"', hlo):
        calls[target] = calls.get(target, 0) + 1
    return {
        "batch_kind": kind,
        "num_params": state.num_params,
        "fits": True,
        "loss_chunk": chunk,
        "compile_s": round(seconds, 1),
        **host,
        "memory": memory,
        # donated inputs are aliased to outputs: counted once
        "peak_bytes": memory["temp_size_in_bytes"] + memory["argument_size_in_bytes"]
        + memory["output_size_in_bytes"] - memory["alias_size_in_bytes"],
        "custom_calls": dict(sorted(calls.items())),
        "cudnn_attention": {k: v for k, v in calls.items() if k.startswith("__cudnn$fmha")},
        "conditionals": len(re.findall(r"\sconditional\(", hlo)),
        "host_transfers": len(re.findall(r"\s(?:send|recv|outfeed|infeed)\(", hlo)),
        "collectives": {op: n for op in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                                         "collective-permute")
                        if (n := len(re.findall(rf"\s{op}(?:-start)?\(", hlo)))},
    }


def _host_memory(rss_before: float | None, peak_is_this_compile: bool) -> dict[str, Any]:
    """The compiling process's resident memory (GB): before the compile, and its peak during it
    (``host_peak_is_process_peak``: the kernel refused the reset, so the peak is the process's)."""
    peak = host_memory_gb("VmHWM")
    return {"host_rss_before_compile_gb": None if rss_before is None else round(rss_before, 2),
            "host_peak_rss_gb": None if peak is None else round(peak, 2),
            "host_peak_is_process_peak": not peak_is_this_compile}


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="h100",
                   help="a GPU spec in bench/aot_targets (h100) or a TPU topology (v5e:2x4, v6e:2x4, v5p:2x2x1)")
    p.add_argument("--batch", type=int, default=None,
                   help="sequences per step (default 8, tiny 2; at least one per device)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; tiny: 64)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--remat", default="none", help="gradient_checkpointing policy")
    p.add_argument("--attn", default="auto", help="attn_mechanism: auto (cuDNN on GPU), cudnn, xla")
    p.add_argument("--batches", default="packed,tokens", help="batch kinds to compile (packed, tokens)")
    p.add_argument("--fp8", action="store_true", help="the projections in FP8 (model.fp8): look for cuBLASLt f8 GEMMs")
    p.add_argument("--devices", type=int, default=1, help="GPUs on the one host (a TPU topology names its own)")
    p.add_argument("--dims", default=None,
                   help="sharding_axis_dims dp,fsdp,ep,tp,sp (default: all devices on fsdp)")
    p.add_argument("--model", default="1b", choices=sorted(MODELS),
                   help="architecture (Llama-3.2-1B, Llama-3.1-8B, Gemma-3-1B, GPT-OSS-20B, Qwen3.5-35B-A3B)")
    p.add_argument("--layers", type=int, default=None,
                   help="num_hidden_layers instead of the model's own (16 for 1b): how compile time and host "
                        "memory grow with depth")
    p.add_argument("--scan-layers", action="store_true",
                   help="the layers stored stacked and run by lax.scan (model.scan_layers): one layer body to compile")
    p.add_argument("--tiny", action="store_true", help="a toy model (tests the plumbing)")
    p.add_argument("--cpu", action="store_true", help="compile for this host's CPU instead (tests, no plugin)")
    p.add_argument("--out", default=None,
                   help="result JSON (default bench/results/gpu-aot-<target>[x<devices>]-<model>-<date>.json)")
    p.add_argument("--dump", default=None, help="folder for the optimized HLO of each batch kind")
    a = p.parse_args(argv)
    platform = platform_of(a.target)
    if not a.cpu and platform == "cuda" and not os.path.exists(os.path.join(HERE, "aot_targets", f"{a.target}.txtpb")):
        specs = sorted(f[:-len(".txtpb")] for f in os.listdir(os.path.join(HERE, "aot_targets")))
        p.error(f"--target {a.target!r}: no GPU spec bench/aot_targets/{a.target}.txtpb (have: {', '.join(specs)}); "
                "a TPU topology looks like v5e:2x4")
    if not a.cpu and not has_compiler(platform):
        sys.exit(reexec_in_venv(platform, argv))
    if not a.cpu:  # before JAX loads its plugins
        for key, value in AOT_ENV[platform].items():
            os.environ.setdefault(key, value)

    import jax

    from scaletrain.models.registry import get_modules_by_type

    if a.cpu:
        devices, device = jax.devices()[:1], {"device_memory_bytes": None, "device": "this host's CPU"}
    elif platform == "tpu":
        devices, device = tpu_devices(a.target)
    else:
        devices, device = gpu_devices(a.target, a.devices)
        answer_cudnn_checks_for(device["compute_capability"])
    batch = a.batch or max(2 if a.tiny else 8, len(devices))
    seq = a.seq or (64 if a.tiny else 2048)
    dims = tuple(int(d) for d in a.dims.split(",")) if a.dims else (1, -1, 1, 1, 1)
    arch = dict(TINY if a.tiny else MODELS[a.model])
    if a.layers is not None:
        if a.layers < 1:
            p.error(f"--layers {a.layers}: give at least 1")
        arch["num_hidden_layers"] = a.layers
    config_class = get_modules_by_type(arch.pop("model_type", "llama"))[0]
    cfg = config_class(**arch, gradient_checkpointing=a.remat, attn_mechanism=a.attn, sharding_axis_dims=dims, fp8=a.fp8,
                      scan_layers=a.scan_layers)
    model = (("tiny" if a.tiny else a.model) + ("" if a.layers is None else f"-{a.layers}layers")
             + ("-scan" if a.scan_layers else ""))
    runs = [compile_step(cfg, devices, batch, seq, a.dtype, kind, a.dump) for kind in a.batches.split(",")]
    result = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": "python bench/aot.py " + " ".join(argv),
        "target": device,
        "jax": jax.__version__,
        "config": {"model": model, "num_hidden_layers": cfg.num_hidden_layers, "devices": len(devices),
                   "sharding_axis_dims": dims,
                   "batch": batch, "seq": seq, "dtype": a.dtype, "param_dtype": "float32", "remat": a.remat,
                   "attn_mechanism": a.attn, "fp8": a.fp8, "scan_layers": a.scan_layers},
        "runs": runs,
    }
    where = "cpu" if a.cpu else a.target.replace(":", "-") + (f"x{len(devices)}" if platform == "cuda"
                                                               and len(devices) > 1 else "")
    out = a.out or os.path.join(HERE, "results", f"aot-{where}-{model}-{dt.date.today()}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    total = device["device_memory_bytes"]
    for r in runs:
        if not r["fits"]:
            print(f"{r['batch_kind']:>7}: does not fit: {r['error']} (host peak RSS {_gb(r['host_peak_rss_gb'])})")
            continue
        fits = f" of {total / 1e9:.1f} GB" if total else ""
        temp = r["memory"]["temp_size_in_bytes"] / 1e9
        print(f"{r['batch_kind']:>7}: {r['num_params'] / 1e9:.3f}B params on {len(devices)} device(s), per device: "
              f"temp {temp:.2f} GB, peak {r['peak_bytes'] / 1e9:.2f} GB{fits}, "
              f"cuDNN attention {r['cudnn_attention'] or 'none'}, "
              f"conditionals {r['conditionals']}, collectives {r['collectives'] or 'none'}, "
              f"compiled in {r['compile_s']} s, host peak RSS {_gb(r['host_peak_rss_gb'])} "
              f"(before the compile {_gb(r['host_rss_before_compile_gb'])})")
    print(f"wrote {out}")
    return result


def _gb(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f} GB"


if __name__ == "__main__":
    main()
