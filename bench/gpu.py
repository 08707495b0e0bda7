"""One GPU, a real ~1B Llama, bf16 compute: scaletrain and HF transformers + torch side by side.

``python bench/gpu.py`` trains Llama-3.2-1B's architecture (hidden 2048, 16 layers,
32 heads / 8 kv heads, head dim 64, intermediate 8192, vocab 128,256, tied
embeddings, llama3 RoPE; 1.24B parameters) on random tokens in three cases, each
16,384 tokens per step: ``single`` (seq 2048, batch 8, one sequence per row),
``packed`` (seq 2048, batch 8, rows of documents of 64-1,024 tokens: same-document
causal attention) and ``long`` (seq 8192, batch 2). ``--cases`` picks some, or adds ``long32k``
(seq 32768, batch 1).

Each system × case runs in its own fresh process, one after the other (never two on
the GPU at once), with empty compile caches (JAX's, inductor's, Triton's), so
``first_step_s`` — wall time from the process's start to the end of step 1 — is a
cold start and ``host_peak_rss_gb`` (the process's ``VmHWM``) is that run's own.

* scaletrain: ``scaletrain.Trainer`` with bfloat16 compute, float32 master weights
  and AdamW state, cuDNN fused attention where the backend has it
  (``attn_mechanism="auto"``), the chunked loss for the 128k vocabulary; ``--attn``,
  ``--remat``, ``--fp8`` (FP8 projection GEMMs, ``model.fp8``), ``--dtype`` apply to it.
* the contender (``--contender compile``, the default; ``eager``; ``none``):
  ``bench/torch_contender.py``, HF ``LlamaForCausalLM`` from the same architecture dict,
  SDPA, bf16 autocast over float32 weights, fused AdamW, the whole step under
  ``torch.compile`` (its docstring says what SDPA gets in each case).

Both see the same rows in the same order (:func:`gpu_cases.case_rows`) and read the
clock at the same steps; tokens/s is the median over the windows after the first. MFU
uses one ``LlamaConfig.flops_per_token(seq)`` and one ``peak_flops_per_device()``
(989 TFLOP/s dense bf16 for H100/H200), both computed here, for both systems; with
``--fp8`` the peak stays bf16's, so MFUs compare like tokens/s. ``ratios``:
``vs_hf_compile`` (``vs_hf_eager`` with ``--contender eager``), scaletrain's tokens/s
over the contender's per case, and ``packed_vs_single``, scaletrain's packed tokens/s
over its single. A run that fails is recorded with its error (its ratios null) and the
others go on.

``--rollout`` adds the rollout case: ``bench/rollout.py`` in a fresh process (scaletrain's rollout
engine against transformers' ``generate`` on the same device, random weights of Llama-3.2-1B's
architecture, ``--dtype``, 16 prompts x 64 sampled tokens at batch 16 and 64:
:data:`gpu_cases.ROLLOUT`), its result under ``rollout`` (``--cases ''`` runs it alone).

``--paged`` adds the continuous engine's case (:func:`run_paged`, :data:`gpu_cases.PAGED_ROLLOUT`): SmolLM2-135M's
and Llama-3.2-1B's architectures at 256 decode slots, the engine's decode attention the Pallas paged kernel,
beside the static engine and ``generate``, and again with the pages gathered by XLA; under ``paged``.

``--tiny`` runs the same code paths on a CPU with a toy model and a few steps (the
contender eager unless ``--contender compile``): that is what the test suite does; its
numbers mean nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, ROOT)

from common import host_memory_gb  # noqa: E402

# LLAMA_1B and TINY are also read from here by bench/aot.py
from gpu_cases import (  # noqa: E402
    CASES, DEFAULT_CASES, DOC_LENGTHS, LLAMA_1B, PAGED_ROLLOUT, ROLLOUT, TINY, TINY_CASES, TINY_DOC_LENGTHS,
    TINY_PAGED_ROLLOUT, TINY_ROLLOUT, case_rows, clock_marks, process_start_time, steady_rate,
)

SYSTEMS = ("scaletrain", "hf")
RATIO_KEY = {"compile": "vs_hf_compile", "eager": "vs_hf_eager"}


def run_scaletrain(spec: dict[str, Any]) -> dict[str, Any]:
    """The scaletrain worker: ``scaletrain.Trainer`` on the case's rows, clocked by a callback."""
    launched = process_start_time()
    import jax

    import scaletrain as st
    from scaletrain.data.packing import PackedRows
    from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
    from scaletrain.models.kernels.attention import use_fused_attention
    from scaletrain.training.callbacks import memory_stats

    batch, seq, steps, dtype = spec["batch"], spec["seq"], spec["steps"], spec["dtype"]
    cfg = LlamaConfig(**spec["arch"], gradient_checkpointing=spec["remat"], attn_mechanism=spec["attn"],
                      fp8=spec["fp8"], scan_layers=spec.get("scan_layers", False))
    model, _ = create_sharded_model(LlamaForCausalLM, cfg, dtype=dtype, param_dtype="float32")
    data = PackedRows(*case_rows(spec))  # one-sequence rows are single_segment: tokens only, plain causal
    marks = set(clock_marks(steps, spec["window"]))
    times: dict[int, float] = {}
    first: dict[str, float] = {}

    class Clock(st.Callback):
        def post_step(self, trainer: Any, step: int, metrics: Any) -> None:
            if step in marks:
                loss = jax.block_until_ready(metrics.device("loss"))
                times[step] = time.perf_counter()
                if step == 1:
                    first.update(first_step_s=time.time() - launched, first_loss=float(loss))

    with tempfile.TemporaryDirectory(prefix="scaletrain-gpu-bench-") as tmp:
        args = st.TrainingArguments(
            output_dir=tmp, total_batch_size=batch, max_length=seq, num_train_epochs=None, max_training_steps=steps,
            learning_rate=3e-4, scheduler="constant", dtype=dtype, param_dtype="float32", do_eval=False,
            log_steps=spec["window"], progress_bar=False, report_to=(), save_at_end=False,
            shuffle_train_dataset=False,  # a first run's cache, unless the driver shares one (--cached)
            compilation_cache_dir=spec.get("cache_dir") or os.path.join(tmp, "jax-cache"),
        )
        trainer = st.Trainer(args, model=model, dataset_train=data, callbacks=[Clock()])
        trainer.train()
        final_loss = trainer.metrics_logger.last_train.get("loss")
        num_params = trainer.model_state.num_params
    tps, rates = steady_rate(times, batch * seq)
    memory = memory_stats()
    device = jax.devices()[0]
    return {
        "tokens_per_s": tps, "window_tokens_per_s": rates, "first_step_s": first.get("first_step_s"),
        "host_peak_rss_gb": host_memory_gb(),
        "device_peak_gb": memory["device_peak_bytes_in_use"] / 1e9 if "device_peak_bytes_in_use" in memory else None,
        "device_memory": memory, "first_loss": first.get("first_loss"), "final_loss": final_loss,
        "num_params": num_params,
        "info": {"measured_on": f"{device.platform}: {device.device_kind}", "jax": jax.__version__,
                 "dtype": dtype, "param_dtype": "float32", "remat": spec["remat"], "attn_mechanism": spec["attn"],
                 "fp8": spec["fp8"], "scan_layers": spec.get("scan_layers", False),
                 "fused_attention": use_fused_attention(spec["attn"], jax.numpy.dtype(dtype), cfg.head_dim)},
    }


def worker_command(system: str, spec: dict[str, Any], out: str, torch_python: str) -> list[str]:
    if system == "scaletrain":
        return [sys.executable, os.path.abspath(__file__), "--worker", "--spec", json.dumps(spec), "--out", out]
    return [torch_python, os.path.join(HERE, "torch_contender.py"), "--spec", json.dumps(spec), "--out", out]


def run_worker(cmd: list[str], workdir: str, timeout: float, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """One run in a fresh process with empty compile caches (and ``extra_env``); its result, or its error."""
    os.makedirs(workdir)
    out = cmd[cmd.index("--out") + 1]
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"} | (extra_env or {})
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(workdir, "inductor-cache")
    env["TRITON_CACHE_DIR"] = os.path.join(workdir, "triton-cache")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    t0 = time.time()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=workdir)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s", "wall_s": time.time() - t0}
    except OSError as e:  # e.g. no such interpreter (--torch-python)
        return {"error": f"could not start {cmd[0]}: {e}", "wall_s": time.time() - t0}
    wall = time.time() - t0
    if done.returncode != 0 or not os.path.exists(out):
        tail = (done.stderr or done.stdout).strip().splitlines()[-15:]
        return {"error": f"exit {done.returncode}: " + " | ".join(tail)[-2000:], "wall_s": wall}
    with open(out) as f:
        return json.load(f) | {"error": None, "wall_s": wall}


def run_rollout(a: argparse.Namespace, workdir: str) -> dict[str, Any]:
    """The rollout case in a fresh process: bench/rollout.py's result (rows: tokens/s of both, the ratio,
    the engine's first call), or its error."""
    case = TINY_ROLLOUT if a.tiny else ROLLOUT
    out = os.path.join(workdir, "result.json")
    cmd = [sys.executable, os.path.join(HERE, "rollout.py"), "--arch", case["arch"], "--dtype", a.dtype,
           "--prompts", str(case["prompts"]), "--batches", case["batches"], "--new", str(case["new"]),
           "--repeats", str(case["repeats"]), "--workloads", "fixed", "--contenders", "static,generate"]
    cmd += ["--no-transformers"] if a.contender == "none" else []
    print("[gpu] rollout: running", flush=True)
    entry = run_worker(cmd + ["--out", out], workdir, a.timeout)
    entry["command"] = shlex.join(cmd)
    for row in entry.get("rows", []):
        print(f"[gpu] rollout batch {row['batch']}: scaletrain {row['scaletrain_tok_s']:,.0f} tok/s (first call "
              f"{row['first_call_s']:.1f}s), transformers {row['transformers_tok_s']:,.0f} tok/s: {row['ratio']}x",
              flush=True)
    if entry["error"]:
        print(f"[gpu] rollout: FAILED {entry['error']}", flush=True)
    return entry


def run_paged(a: argparse.Namespace, workdir: str) -> dict[str, Any]:
    """The continuous engine's case (:data:`gpu_cases.PAGED_ROLLOUT`), per architecture, each run in a fresh
    process: its decode attention the Pallas paged kernel (the GPU default) beside the static engine and
    transformers' ``generate``, then the continuous engine alone with the pages gathered by XLA
    (``SCALETRAIN_PAGED_KERNEL=0``), so ``kernel_vs_gather`` is the kernel's own gain. On a CPU (``--tiny``) both
    runs gather: the plumbing only."""
    case = TINY_PAGED_ROLLOUT if a.tiny else PAGED_ROLLOUT
    result: dict[str, Any] = {}
    for arch in case["archs"]:
        base = [sys.executable, os.path.join(HERE, "rollout.py"), "--arch", arch, "--dtype", a.dtype,
                "--workloads", "fixed,long-tailed", "--slots", str(case["slots"])]
        for key in ("prompts", "batches", "new", "repeats", "chat_prompts", "generations", "cap"):
            base += ["--" + key.replace("_", "-"), str(case[key])]
        runs: dict[str, Any] = {}
        for variant, contenders, env in (("kernel", "continuous,static,generate", {}),
                                         ("gather", "continuous", {"SCALETRAIN_PAGED_KERNEL": "0"})):
            cmd = base + ["--contenders", contenders] + (["--no-transformers"] if a.contender == "none" else [])
            print(f"[gpu] paged {arch} / {variant}: running", flush=True)
            entry = run_worker(cmd + ["--out", os.path.join(workdir, arch, variant, "result.json")],
                               os.path.join(workdir, arch, variant), a.timeout, env)
            entry["command"] = " ".join(f"{k}={v}" for k, v in env.items()) + (" " if env else "") + shlex.join(cmd)
            for row in entry.get("rows", []):
                print(f"[gpu] paged {arch} / {variant} {row['workload']}: " + ", ".join(
                    f"{n} {f['tok_s']:,.0f} tok/s" for n, f in row["contenders"].items()), flush=True)
            if entry["error"]:
                print(f"[gpu] paged {arch} / {variant}: FAILED {entry['error']}", flush=True)
            runs[variant] = entry
        pairs = zip(runs["kernel"].get("rows", []), runs["gather"].get("rows", []))
        runs["kernel_vs_gather"] = {k["workload"]: round(k["contenders"]["continuous"]["tok_s"]
                                                         / g["contenders"]["continuous"]["tok_s"], 2)
                                    for k, g in pairs if "continuous" in k["contenders"] and
                                    "continuous" in g["contenders"]}
        result[arch] = runs
    return result


def usable(entry: dict[str, Any] | None) -> bool:
    tps = (entry or {}).get("tokens_per_s")
    return tps is not None and math.isfinite(tps) and tps > 0


def ratios(cases: dict[str, dict[str, Any]], contender: str) -> tuple[dict[str, Any], dict[str, str]]:
    """scaletrain over the contender per case, and scaletrain's packed over its single; notes for nulls."""
    out: dict[str, Any] = {}
    notes: dict[str, str] = {}
    if contender in RATIO_KEY:
        key = RATIO_KEY[contender]
        out[key] = {}
        for name, case in cases.items():
            st, hf = case.get("scaletrain"), case.get("hf")
            if usable(st) and usable(hf):
                out[key][name] = st["tokens_per_s"] / hf["tokens_per_s"]
            else:
                out[key][name] = None
                failed = [s for s in SYSTEMS if not usable(case.get(s))]
                notes[f"{key}.{name}"] = "; ".join(f"{s}: {(case.get(s) or {}).get('error') or 'no tokens/s'}"
                                                   for s in failed)
    single, packed = (cases.get(n, {}).get("scaletrain") for n in ("single", "packed"))
    if usable(single) and usable(packed):
        out["packed_vs_single"] = packed["tokens_per_s"] / single["tokens_per_s"]
    else:
        out["packed_vs_single"] = None
        notes["packed_vs_single"] = ("needs both cases single and packed" if single is None or packed is None
                                     else "a scaletrain run failed")
    return out, notes


def table(result: dict[str, Any]) -> str:
    """A markdown table: one line per case × system."""
    hf_name = f"HF + torch ({result['contender']})"
    lines = ["| case | system | tokens/s | MFU | first step (s) | host peak RSS (GB) | device peak (GB) | "
             "final loss |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def num(x: Any, fmt: str) -> str:
        return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)

    for name, case in result["cases"].items():
        for system in SYSTEMS:
            e = case.get(system)
            if e is None:
                continue
            label = "scaletrain" if system == "scaletrain" else hf_name
            if e.get("error"):
                lines.append(f"| {name} | {label} | failed: {e['error'][:100]} | | | | | |")
                continue
            mfu = None if e["mfu"] is None else 100 * e["mfu"]
            first = num(e["first_step_s"], ".1f") + (f" ({num(e['first_step_cached_s'], '.1f')} cached)"
                                                       if "first_step_cached_s" in e else "")
            lines.append(f"| {name} | {label} | {num(e['tokens_per_s'], ',.0f')} | {num(mfu, '.1f')} % | "
                         f"{first} | {num(e['host_peak_rss_gb'], '.2f')} | "
                         f"{num(e['device_peak_gb'], '.1f')} | {num(e['final_loss'], '.3f')} |")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy model, CPU-friendly (tests the plumbing only)")
    p.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated, from {', '.join(CASES)}")
    p.add_argument("--contender", choices=("compile", "eager", "none"), default=None,
                   help="HF + torch with torch.compile (default; tiny: eager), eager, or not at all")
    p.add_argument("--steps", type=int, default=None, help="default 30 (tiny: 4)")
    p.add_argument("--window", type=int, default=None, help="steps per timing window (default 5; tiny: 2)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step, every case (default: the case's)")
    p.add_argument("--seq", type=int, default=None, help="sequence length, every case (default: the case's)")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype of both systems")
    p.add_argument("--remat", default="none", help="scaletrain's gradient_checkpointing policy (none, full, dots, ...)")
    p.add_argument("--attn", default="auto", help="scaletrain's attn_mechanism: auto (cuDNN on GPU), cudnn, xla, "
                                                  "pallas")
    p.add_argument("--fp8", action="store_true", help="scaletrain's FP8 projection matmuls (model.fp8)")
    p.add_argument("--scan-layers", action="store_true",
                   help="scaletrain's layers stored stacked and run by lax.scan (model.scan_layers; pair with "
                        "--remat dots): one layer body to compile")
    p.add_argument("--cached", action="store_true",
                   help="run scaletrain a second time per case on the first run's compilation cache: first_step_cached_s")
    p.add_argument("--torch-python", default=sys.executable, help="interpreter for the contender (default: this one)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--out", default=None, help="result JSON (default bench/results/gpu-<date>.json)")
    p.add_argument("--rollout", action="store_true",
                   help="also run the rollout case (bench/rollout.py: the engine vs transformers' generate)")
    p.add_argument("--paged", action="store_true",
                   help="also run the continuous engine's case (gpu_cases.PAGED_ROLLOUT: 256 slots, the paged kernel)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # internal: run scaletrain's side
    p.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.case_names = [c.strip() for c in a.cases.split(",") if c.strip()]
    unknown = [c for c in a.case_names if c not in CASES]
    if unknown or not (a.case_names or a.rollout or a.paged):
        p.error(f"--cases: unknown {unknown}; choose from {', '.join(CASES)}")
    a.contender = a.contender or ("eager" if a.tiny else "compile")
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse(argv)
    if a.worker:
        result = run_scaletrain(json.loads(a.spec))
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
        return result
    steps, window = a.steps or (4 if a.tiny else 30), a.window or (2 if a.tiny else 5)
    arch, shapes = (TINY, TINY_CASES) if a.tiny else (LLAMA_1B, CASES)
    systems = SYSTEMS if a.contender != "none" else SYSTEMS[:1]
    cases: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="scaletrain-gpu-side-by-side-") as work:
        for name in a.case_names:
            batch, seq, packed = shapes[name]
            batch, seq = a.batch or batch, a.seq or seq
            spec = {"case": name, "arch": arch, "cache_dir": os.path.join(work, f"{name}-jax-cache"), "batch": batch, "seq": seq, "packed": packed,
                    "doc_lengths": TINY_DOC_LENGTHS if a.tiny else DOC_LENGTHS, "steps": steps, "window": window,
                    "dtype": a.dtype, "remat": a.remat, "attn": a.attn, "fp8": a.fp8, "scan_layers": a.scan_layers,
                    "compile": a.contender == "compile"}
            cases[name] = {"batch": batch, "seq": seq, "packed": packed}
            for system in systems:
                run_dir = os.path.join(work, f"{name}-{system}")
                cmd = worker_command(system, spec, os.path.join(run_dir, "result.json"), a.torch_python)
                print(f"[gpu] {name} / {system}: running", flush=True)
                entry = run_worker(cmd, run_dir, a.timeout)
                entry["command"] = shlex.join(cmd[:-2])  # without the temporary --out
                cases[name][system] = entry
                print(f"[gpu] {name} / {system}: " + (f"FAILED {entry['error']}" if entry["error"] else
                      f"{entry['tokens_per_s']:,.0f} tokens/s, first step {entry['first_step_s']:.1f}s, "
                      f"wall {entry['wall_s']:.0f}s"), flush=True)
                if system == "scaletrain" and a.cached and not entry["error"]:  # the same run, its programs cached
                    again = run_worker(worker_command(system, spec, os.path.join(run_dir + "-cached", "result.json"),
                                                      a.torch_python), run_dir + "-cached", a.timeout)
                    entry["first_step_cached_s"] = again.get("first_step_s")
                    entry["cached_run_error"] = again["error"]
                    print(f"[gpu] {name} / scaletrain from the compilation cache: first step "
                          f"{again.get('first_step_s') or float('nan'):.1f}s", flush=True)

        rollout = run_rollout(a, os.path.join(work, "rollout")) if a.rollout else None
        paged = run_paged(a, os.path.join(work, "paged")) if a.paged else None

    # only now (every run has ended) does this process start a JAX backend of its own
    import jax

    from scaletrain.models import LlamaConfig
    from scaletrain.training.metrics import peak_flops_per_device

    peak = peak_flops_per_device()
    for case in cases.values():
        case["flops_per_token"] = fpt = LlamaConfig(**arch).flops_per_token(case["seq"])
        for system in systems:
            e = case[system]
            tps = e.get("tokens_per_s")
            e["tflops"] = None if tps is None else tps * fpt / 1e12
            e["mfu"] = None if tps is None else tps * fpt / peak
    ratio_values, notes = ratios(cases, a.contender)
    device = jax.devices()[0]
    result = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": "python bench/gpu.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "tiny": a.tiny,
        "measured_on": f"{device.platform}: {device.device_kind}",
        "contender": a.contender,
        "peak_flops_per_device": peak,
        "config": {"steps": steps, "window": window, "cached": a.cached, "dtype": a.dtype, "param_dtype": "float32", "remat": a.remat,
                   "attn_mechanism": a.attn, "fp8": a.fp8, "scan_layers": a.scan_layers,
                   "doc_lengths": TINY_DOC_LENGTHS if a.tiny else DOC_LENGTHS},
        "cases": cases,
        "ratios": ratio_values,
        "ratio_notes": notes,
        "rollout": rollout,
        "paged": paged,
    }
    out = a.out or os.path.join(HERE, "results", f"gpu-{dt.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(table(result))
    print("ratios: " + json.dumps(ratio_values))
    print(f"{result['measured_on']}, peak {peak / 1e12:.1f} TFLOP/s; wrote {out}")
    return result


if __name__ == "__main__":
    main()
