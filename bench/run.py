"""scaletrain against its peers, side by side: ``python bench/run.py [--steps N --repeats R --only ...]``.

Every contender trains the same Llama on the same tokens in its own process (no
shared JIT cache, no shared allocator), and the contenders run interleaved
(A B C … A B C …) so a change in machine load hits them all alike. The result is
printed as a table and written to ``bench/results/<date>.json`` with a ``ratios``
object: scaletrain's steady tokens/s over each peer's (null with a reason where a
peer could not run).

Contenders: ``scaletrain`` (the Trainer), ``bare_jax`` (a jitted flax-nnx + optax
loop on scaletrain's own model module, started with the same glibc huge-page tunable as
scaletrain), ``easydel`` (EasyDeL's Trainer, pinned, in
its own venv), ``hf_eager`` and ``hf_compile`` (the Hugging Face Trainer on torch
CPU, without and with ``torch.compile``); opt-in ``hf_compile_hugepages`` (the latter with the
glibc huge-page tunable scaletrain starts with).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, ROOT)

from common import T0_ENV, BenchConfig, ContenderResult, make_tokens  # noqa: E402

from scaletrain.host_memory import TUNABLE  # noqa: E402

#: name -> (script, variant, interpreter kind)
CONTENDERS: dict[str, tuple[str, str, str]] = {
    "scaletrain": ("scaletrain_trainer.py", "", "main"),
    "bare_jax": ("bare_jax.py", "", "main"),
    "easydel": ("easydel_trainer.py", "", "easydel"),
    "hf_eager": ("hf_trainer.py", "eager", "hf"),
    "hf_compile": ("hf_trainer.py", "compile", "hf"),
    "hf_compile_hugepages": ("hf_trainer.py", "compile", "hf"),
}
#: run only when named in ``--only``
OPT_IN = ("hf_compile_hugepages",)
#: extra environment of a contender. The glibc huge-page tunable that scaletrain's CLI and
#: contender start with (scaletrain/host_memory.py) is given to the bare JAX loop too, so that
#: ``vs_bare_jax`` measures the framework around the same step, not the process setting; and
#: to HF + torch.compile in the opt-in contender, to show what it is worth to torch
CONTENDER_ENV: dict[str, dict[str, str]] = {"bare_jax": {"GLIBC_TUNABLES": TUNABLE},
                                            "hf_compile_hugepages": {"GLIBC_TUNABLES": TUNABLE}}
IN_PROCESS = ("scaletrain", "bare_jax")  # need nothing but scaletrain's own environment

TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, seq_len=32, batch_size=4)


def child_env(t0: float, xla_flags: str = "", root: str = ROOT) -> dict[str, str]:
    """The environment of a contender: one real CPU device, scaletrain importable from ``root``."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    flags += xla_flags.split()
    env["XLA_FLAGS"] = " ".join(flags)
    if not env["XLA_FLAGS"]:
        del env["XLA_FLAGS"]
    env["JAX_PLATFORMS"] = env.get("BENCH_JAX_PLATFORMS", "cpu")
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env[T0_ENV] = repr(t0)
    return env


def probe(python: str, cfg: BenchConfig) -> dict[str, float]:
    """CPU peak FLOP/s (scaletrain's measured float32 matmul) and model FLOPs per token."""
    code = (
        "import json, sys; from scaletrain.models import LlamaConfig; "
        "from scaletrain.training.metrics import measured_cpu_peak_flops; import jax; "
        f"c = LlamaConfig(**json.loads(sys.argv[1])); "
        f"print(json.dumps(dict(peak=measured_cpu_peak_flops(repeats=10), fpt=c.flops_per_token({cfg.seq_len}), "
        "params=c.num_params, backend=jax.default_backend(), device_kind=jax.devices()[0].device_kind)))"
    )
    out = subprocess.run([python, "-c", code, json.dumps(cfg.hf_config())], capture_output=True, text=True,
                         env=child_env(time.time()), check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_one(name: str, python: str, cfg_path: str, tokens_path: str, workdir: str, timeout: float,
            xla_flags: str, root: str = ROOT) -> tuple[ContenderResult | None, str | None, float]:
    """Run one contender process; returns (result, error, wall seconds)."""
    script, variant, _ = CONTENDERS[name.split("@")[0]]
    out = os.path.join(workdir, f"{name}-{time.monotonic_ns()}.json")
    cmd = [python, os.path.join(HERE, "contenders", script), "--config", cfg_path, "--tokens", tokens_path,
           "--out", out, "--variant", variant]
    t0 = time.time()
    try:
        env = child_env(t0, xla_flags, root) | CONTENDER_ENV.get(name, {})
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=workdir)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f}s", time.time() - t0
    wall = time.time() - t0
    if done.returncode != 0 or not os.path.exists(out):
        tail = (done.stderr or done.stdout).strip().splitlines()[-15:]
        return None, f"exit {done.returncode}: " + " | ".join(tail)[-1500:], wall
    with open(out) as f:
        return ContenderResult(**json.load(f)), None, wall


def interpreters(names: list[str]) -> dict[str, tuple[str | None, str | None]]:
    """kind -> (python, reason it is missing)."""
    from envs import easydel_interpreter, hf_interpreter

    kinds = {CONTENDERS[n.split("@")[0]][2] for n in names}
    out: dict[str, tuple[str | None, str | None]] = {}
    for kind in kinds:
        if kind == "main":
            out[kind] = (sys.executable, None)
        elif kind == "hf":
            i = hf_interpreter()
            out[kind] = (i.python, i.reason)
        else:
            i = easydel_interpreter()
            out[kind] = (i.python, i.reason)
    return out


def summarise(results: list[ContenderResult], cfg: BenchConfig, peak: float, fpt: float) -> dict[str, Any]:
    """Medians over repeats of each repeat's steady tokens/s, first-step time and peak RSS."""
    tps = [r.steady_tokens_per_s(cfg.tokens_per_step) for r in results]
    tps = [t for t in tps if t is not None]
    med = statistics.median(tps) if tps else None
    cpu = [r.steady_tokens_per_cpu_s(cfg.tokens_per_step) for r in results if r.cpu_times]
    cpu = [c for c in cpu if c is not None]
    first = [r.first_step_s for r in results if r.first_step_s is not None]
    rss = [r.peak_rss_mb for r in results if r.peak_rss_mb is not None]
    return {
        "tokens_per_s": med,
        "tokens_per_s_per_repeat": tps,
        "tokens_per_cpu_s": statistics.median(cpu) if cpu else None,
        "first_step_s": statistics.median(first) if first else None,
        "peak_rss_mb": statistics.median(rss) if rss else None,
        "mfu": None if med is None else med * fpt / peak,
        "tflops": None if med is None else med * fpt / 1e12,
        "final_loss": results[-1].final_loss if results else None,
        "info": results[-1].info if results else {},
    }


def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, why_missing: str | None) -> dict[str, Any]:
    if a is None or b is None or not a.get("tokens_per_s") or not b.get("tokens_per_s"):
        return {"value": None, "reason": why_missing or "not measured"}
    return {"value": a["tokens_per_s"] / b["tokens_per_s"]}


def markdown_table(summary: dict[str, dict[str, Any]], errors: dict[str, str]) -> str:
    lines = ["| contender | tokens/s (median) | per repeat | MFU | tokens/CPU-s | first step (s) | peak RSS (MB) "
             "| scaletrain ÷ it |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    st = summary.get("scaletrain", {}).get("tokens_per_s")
    for name, s in summary.items():
        if s.get("tokens_per_s") is None:
            lines.append(f"| {name} | — | — | — | — | — | — | n/a: {errors.get(name, 'not run')[:120]} |")
            continue
        rel = f"{st / s['tokens_per_s']:.3f}" if st else "—"
        reps = ", ".join(f"{t:.0f}" for t in s["tokens_per_s_per_repeat"])
        cpu = "—" if s.get("tokens_per_cpu_s") is None else f"{s['tokens_per_cpu_s']:.0f}"
        lines.append(f"| {name} | {s['tokens_per_s']:.0f} | {reps} | {100 * s['mfu']:.1f}% | {cpu} | "
                     f"{s['first_step_s']:.1f} | {s['peak_rss_mb']:.0f} | {rel} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=25, help="training steps per run (default 25)")
    p.add_argument("--window", type=int, default=5, help="steps per timing window (default 5)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--only", default=",".join(n for n in CONTENDERS if n not in OPT_IN),
                   help=f"comma-separated contenders (opt-in: {', '.join(OPT_IN)})")
    p.add_argument("--dtype", default="float32", help="compute dtype for every contender")
    p.add_argument("--param-dtype", default="float32")
    p.add_argument("--data", default="random", choices=("random", "corpus"))
    p.add_argument("--tiny", action="store_true", help="a toy model (for tests): only checks the plumbing")
    p.add_argument("--xla-flags", default="", help="extra XLA_FLAGS for the JAX contenders")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per contender run")
    p.add_argument("--out", default=None, help="result JSON (default bench/results/<date>.json)")
    p.add_argument("--label", default="", help="free text stored in the JSON")
    p.add_argument("--baseline-root", default=None,
                   help="another scaletrain checkout: adds contender scaletrain@base run from it (before/after)")
    a = p.parse_args(argv)
    names = [n.strip() for n in a.only.split(",") if n.strip()]
    if a.baseline_root:
        names.insert(names.index("scaletrain") + 1 if "scaletrain" in names else 0, "scaletrain@base")
    unknown = [n for n in names if n.split("@")[0] not in CONTENDERS]
    if unknown:
        p.error(f"unknown contender(s) {unknown}; choose from {list(CONTENDERS)}")
    overrides = TINY if a.tiny else {}
    cfg = BenchConfig(steps=a.steps, window=a.window, dtype=a.dtype, param_dtype=a.param_dtype, data=a.data,
                      **overrides)
    command = "python bench/run.py " + " ".join(shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))
    load_before = os.getloadavg()
    pythons = interpreters(names)
    info = probe(sys.executable, cfg)
    print(f"[bench] {info['params'] / 1e6:.2f}M params, {info['fpt'] / 1e6:.1f} MFLOP/token, CPU peak "
          f"{info['peak'] / 1e9:.1f} GFLOP/s, load {load_before[0]:.2f}", flush=True)

    results: dict[str, list[ContenderResult]] = {n: [] for n in names}
    errors: dict[str, str] = {}
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="scaletrain-bench-") as work:
        cfg_path = os.path.join(work, "config.json")
        with open(cfg_path, "w") as f:
            f.write(cfg.to_json())
        tokens_path = os.path.join(work, "tokens.npy")
        import numpy as np

        np.save(tokens_path, make_tokens(cfg))
        for rep in range(a.repeats):
            for name in names:
                python, reason = pythons[CONTENDERS[name.split("@")[0]][2]]
                if python is None:
                    errors[name] = reason or "no interpreter"
                    continue
                if name in errors and not results[name]:
                    continue  # failed before: don't pay for it again
                load = os.getloadavg()[0]
                root = os.path.abspath(a.baseline_root) if name.endswith("@base") else ROOT
                res, err, wall = run_one(name, python, cfg_path, tokens_path, work, a.timeout, a.xla_flags, root)
                tps = None if res is None else res.steady_tokens_per_s(cfg.tokens_per_step)
                runs.append({"repeat": rep, "contender": name, "load_1min": load, "wall_s": wall,
                             "tokens_per_s": tps, "error": err,
                             "tokens_per_cpu_s": None if res is None else res.steady_tokens_per_cpu_s(cfg.tokens_per_step),
                             "window_tokens_per_s": None if res is None else res.window_rates(cfg.tokens_per_step)})
                if res is None:
                    errors[name] = err or "failed"
                    print(f"[bench] round {rep + 1} {name}: FAILED {err}", flush=True)
                    continue
                results[name].append(res)
                print(f"[bench] round {rep + 1} {name}: {tps or float('nan'):.0f} tokens/s, first step "
                      f"{res.first_step_s:.1f}s, {res.steady_tokens_per_cpu_s(cfg.tokens_per_step) or float('nan'):.0f} "
                      f"tokens/CPU-s, peak RSS {res.peak_rss_mb:.0f} MB, load {load:.2f}", flush=True)

    summary = {n: summarise(results[n], cfg, info["peak"], info["fpt"]) for n in names}
    st = summary.get("scaletrain")
    ratios = {
        "vs_bare_jax": ratio(st, summary.get("bare_jax"), errors.get("bare_jax")),
        "vs_easydel": ratio(st, summary.get("easydel"), errors.get("easydel")),
        "vs_hf_compile": ratio(st, summary.get("hf_compile"), errors.get("hf_compile")),
        "vs_hf_eager": ratio(st, summary.get("hf_eager"), errors.get("hf_eager")),
    }
    if "hf_compile_hugepages" in summary:
        ratios["vs_hf_compile_hugepages"] = ratio(st, summary["hf_compile_hugepages"],
                                                  errors.get("hf_compile_hugepages"))
    for key, other in (("vs_bare_jax", "bare_jax"), ("vs_easydel", "easydel"), ("vs_hf_compile", "hf_compile"),
                       ("vs_hf_eager", "hf_eager")):
        if other not in names:
            ratios[key] = {"value": None, "reason": "not selected (--only)"}
    if "scaletrain@base" in summary:
        ratios["vs_scaletrain_base"] = ratio(st, summary["scaletrain@base"], errors.get("scaletrain@base"))
    for key, other in (("cpu_vs_bare_jax", "bare_jax"), ("cpu_vs_hf_compile", "hf_compile"),
                       ("cpu_vs_easydel", "easydel")):
        mine, theirs = (st or {}).get("tokens_per_cpu_s"), summary.get(other, {}).get("tokens_per_cpu_s")
        if mine and theirs:
            ratios[key] = {"value": mine / theirs}
    if st and summary.get("easydel", {}).get("peak_rss_mb") and st.get("peak_rss_mb"):
        ratios["rss_vs_easydel"] = {"value": st["peak_rss_mb"] / summary["easydel"]["peak_rss_mb"]}
    record = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": command,
        "label": a.label,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(),
                    "load_before": load_before, "load_after": os.getloadavg(), "backend": info["backend"],
                    "device_kind": info["device_kind"]},
        "config": dataclasses.asdict(cfg),
        "num_params": info["params"],
        "flops_per_token": info["fpt"],
        "cpu_peak_flops": info["peak"],
        "xla_flags": a.xla_flags,
        "contenders": summary,
        "errors": errors,
        "ratios": {k: v["value"] for k, v in ratios.items()},
        "ratio_notes": {k: v["reason"] for k, v in ratios.items() if "reason" in v},
        "runs": runs,
    }
    out = a.out or os.path.join(HERE, "results", f"{dt.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=2)
    print(markdown_table(summary, errors))
    print("ratios: " + ", ".join(f"{k}={'n/a' if v is None else f'{v:.3f}'}" for k, v in record["ratios"].items()))
    print(f"load {load_before[0]:.2f} -> {record['machine']['load_after'][0]:.2f}; wrote {out}")
    return record


if __name__ == "__main__":
    main()
