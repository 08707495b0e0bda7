"""Rollout tokens/s: scaletrain's engines against transformers' ``generate`` and ``generate_batch``, side by side.

``python bench/rollout.py [--model DIR | --arch NAME | --tiny] [--workloads fixed,long-tailed]
[--contenders static,continuous,generate,generate_batch] [--batches 16,64] [--prompts 16] [--new 64]
[--repeats 3] [--chat-prompts 32] [--generations 4] [--cap 256] [--tail-repeats 1] [--slots 16]``

Every contender samples the same model (a local Hugging Face folder, ``--model``; default the converted
SmolLM2-135M-Instruct in ``~/.cache/scaletrain``; or, with ``--arch smollm2-135m|llama-1b|tiny``, random
weights of that architecture written once by transformers to a temporary folder) in ``--dtype``, at
temperature 1 without top-k or top-p, the same prompts, group size and cap, in one process:

- **fixed**: ``--prompts`` random prompts (8-40 tokens), batch B = prompts x B / prompts generations, every
  row exactly ``--new`` tokens (no stop): the decode step alone;
- **long-tailed**: ``--chat-prompts`` chat requests (bench/rollout_workload.py; answers from one word to a
  list past the cap) x ``--generations``, stopping at the end of the assistant's turn, at most ``--cap``
  tokens: a few rows run to the cap while most stop early, as RL completions do. With random weights
  (``--arch``, ``--tiny``) the prompts are random and a sixteenth of the vocabulary stops a row.

Contenders (bench/rollout_contenders.py): ``static`` (today's engine), ``continuous`` (the continuous-batching
engine where this tree has one; otherwise a printed line says it was skipped), ``generate``,
``generate_batch``. Per case, scaletrain's first calls run first (tracing and compiling included; before
torch is loaded, whose idle threads would share the CPU), then the timed calls alternate between contenders.
Reported: completion tokens/s (the completion tokens, stop token included, over the wall seconds, tokens in
hand) and per CPU-second, the ratios, the first call and its compile (first call less a steady call of the
same seed, in wall and in CPU seconds), the cache each held at its peak against the bytes of the tokens its
unfinished rows held at that peak (``cache_over_live``), and the completion lengths. Writes ``--out`` (default
``bench/results/rollout-<date>.json``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import write_record  # noqa: E402
import rollout_contenders as rc  # noqa: E402
import rollout_workload as wl  # noqa: E402

DEFAULT_MODEL = os.path.expanduser("~/.cache/scaletrain/smollm2-135m-instruct")
#: SmolLM2-135M's architecture (its config.json), for random weights where the converted folder is absent
SMOLLM2_135M: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)
#: ``--tiny``: the smoke test's sizes (a random 2-layer model, a few tokens)
TINY_ARGS = dict(arch="tiny", batches="4", prompts=2, new=4, repeats=1, chat_prompts=4, generations=2, cap=16,
                 tail_repeats=1, slots=4)


def architectures() -> dict[str, dict[str, Any]]:
    from gpu_cases import LLAMA_1B, TINY

    return {"smollm2-135m": SMOLLM2_135M, "llama-1b": LLAMA_1B, "tiny": TINY}


def random_model_dir(arch: str, folder: str) -> str:
    """A Hugging Face folder of random weights (seed 0, transformers' init) of the named architecture."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**architectures()[arch])
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def cases(a: argparse.Namespace, model_dir: str, vocab: int, eos: Any) -> list[dict[str, Any]]:
    """The workloads' cases: name, prompts, generations, cap and stop ids."""
    out = []
    if "fixed" in a.workloads:
        prompts = wl.fixed_prompts(a.prompts, vocab)
        out += [dict(workload="fixed", batch=b, prompts=prompts, generations=b // a.prompts, cap=a.new, stop=())
                for b in a.batch_list]
    if "long-tailed" in a.workloads:
        if wl.has_chat_template(model_dir) and eos is not None:
            prompts, stop = wl.chat_prompts(model_dir, a.chat_prompts), tuple(np.atleast_1d(eos).tolist())
        else:
            prompts, stop = wl.random_stop_prompts(a.chat_prompts, vocab), wl.random_stop_ids(vocab)
        out.append(dict(workload="long-tailed", batch=len(prompts) * a.generations, prompts=prompts,
                        generations=a.generations, cap=a.tail_cap, stop=stop))
    return out


def summarise(case: dict[str, Any], name: str, calls: list[rc.Call], first: rc.Call | None, per_token: int,
              slots: int | None) -> dict[str, Any]:
    """One contender's figures on one case (medians over its timed calls)."""
    rates = [c.lengths.sum() / c.wall_s for c in calls]
    cpu_rates = [c.lengths.sum() / c.cpu_s for c in calls]
    mid = rc.median_call(calls)
    live = wl.live_peak_tokens(wl.row_prompt_lengths(case["prompts"], case["generations"]), mid.lengths,
                               slots if name == "continuous" else None) * per_token
    row = {"tok_s": round(statistics.median(rates), 1), "tok_cpu_s": round(statistics.median(cpu_rates), 1),
           "wall_s": [round(c.wall_s, 3) for c in calls], "lengths": wl.length_summary(mid.lengths, case["cap"]),
           "cache_bytes": mid.cache_bytes, "used_bytes": mid.used_bytes, "live_bytes": live,
           "cache_over_live": None if mid.cache_bytes is None else round(mid.cache_bytes / live, 2),
           "preemptions": mid.preemptions}
    if first is not None:
        same_seed = calls[0]  # the first timed call repeats the first call's seed
        # compile CPU-s: the first call's CPU less the same call's steady CPU (the steadier figure on a busy machine)
        row.update(first_call_s=round(first.wall_s, 2), first_call_cpu_s=round(first.cpu_s, 2),
                   compile_s=round(first.wall_s - same_seed.wall_s, 2),
                   compile_cpu_s=round(first.cpu_s - same_seed.cpu_s, 2))
    return row


def ratios(figures: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Tokens/s of each scaletrain engine over every other contender's."""
    out = {}
    for mine in rc.SCALETRAIN:
        for other in rc.ALL:
            if mine != other and mine in figures and other in figures and (mine, other) != ("static", "continuous"):
                out[f"{mine}_vs_{other}"] = round(figures[mine]["tok_s"] / figures[other]["tok_s"], 2)
    return out


def legacy(row: dict[str, Any]) -> dict[str, Any]:
    """The fixed workload's keys from before the long-tailed one (bench/gpu.py --rollout reads them)."""
    st, hf = row["contenders"].get("static", {}), row["contenders"].get("generate", {})
    out = {"scaletrain_tok_s": st.get("tok_s"), "transformers_tok_s": hf.get("tok_s", float("nan")),
           "first_call_s": st.get("first_call_s"), "compile_s": st.get("compile_s")}
    out["ratio"] = round(out["scaletrain_tok_s"] / out["transformers_tok_s"], 2) if hf else float("nan")
    return out


def print_case(row: dict[str, Any]) -> None:
    print(f"\n{row['workload']}: {row['prompt_count']} prompts x {row['generations']}, cap {row['cap']}")
    print("| contender | tok/s | tok/CPU-s | first call (compile; compile CPU-s) | lengths min/median/max, at cap | "
          "cache MiB | live MiB | cache / live |")
    for name, f in row["contenders"].items():
        first = (f"{f['first_call_s']:.1f} s ({f['compile_s']:.1f} s; {f['compile_cpu_s']:.1f} CPU-s)"
                 if "first_call_s" in f else "")
        ln = f["lengths"]
        cache = "" if f["cache_bytes"] is None else f"{f['cache_bytes'] / 2**20:,.1f}"
        print(f"| {name} | {f['tok_s']:,.1f} | {f['tok_cpu_s']:,.1f} | {first} | {ln['min']}/{ln['median']:g}/"
              f"{ln['max']}, {ln['at_cap']} | {cache} | {f['live_bytes'] / 2**20:,.1f} | "
              f"{'' if f['cache_over_live'] is None else f['cache_over_live']} |")
    for name, f in row["contenders"].items():
        if f.get("used_bytes") is not None:
            print(f"{name}: pages held at peak {f['used_bytes'] / 2**20:,.1f} MiB "
                  f"({f['used_bytes'] / f['live_bytes']:.2f}x live), {f['preemptions']} rows preempted")
    print("ratios: " + ", ".join(f"{k} {v:.2f}x" for k, v in row["ratios"].items()), flush=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--arch", default=None, help="random weights of smollm2-135m, llama-1b or tiny instead of --model")
    p.add_argument("--tiny", action="store_true", help="the smoke test's sizes: " + str(TINY_ARGS))
    p.add_argument("--torch-device", default=None, help="transformers' device (default: cuda if available, else cpu)")
    p.add_argument("--workloads", default="fixed,long-tailed")
    p.add_argument("--contenders", default=",".join(rc.ALL))
    p.add_argument("--batches", default="16,64", help="fixed: batch sizes (multiples of --prompts)")
    p.add_argument("--prompts", type=int, default=16, help="fixed: prompts")
    p.add_argument("--new", type=int, default=64, help="fixed: tokens per row")
    p.add_argument("--repeats", type=int, default=3, help="fixed: timed calls per contender")
    p.add_argument("--chat-prompts", type=int, default=32, help="long-tailed: prompts")
    p.add_argument("--generations", type=int, default=4, help="long-tailed: completions per prompt (G)")
    p.add_argument("--cap", type=int, default=256, dest="tail_cap", help="long-tailed: max completion tokens")
    p.add_argument("--tail-repeats", type=int, default=1, help="long-tailed: timed calls per contender")
    p.add_argument("--slots", type=int, default=16, help="the continuous engine's decode slots")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-transformers", action="store_true", help="scaletrain's engines alone")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.tiny:
        for k, v in TINY_ARGS.items():
            setattr(a, "tail_cap" if k == "cap" else k, v)
    a.workloads = [w for w in a.workloads.split(",") if w]
    a.contenders = [c for c in a.contenders.split(",") if c and not (a.no_transformers and c in rc.TRANSFORMERS)]
    if bad := [w for w in a.workloads if w not in ("fixed", "long-tailed")]:
        p.error(f"--workloads: unknown {bad}; choose from fixed, long-tailed")
    if bad := [c for c in a.contenders if c not in rc.ALL]:
        p.error(f"--contenders: unknown {bad}; choose from {', '.join(rc.ALL)}")
    a.batch_list = [int(b) for b in a.batches.split(",")]
    if bad := [b for b in a.batch_list if b % a.prompts]:
        p.error(f"--batches: {bad} not a multiple of --prompts {a.prompts}")
    if a.arch is not None and a.arch not in architectures():
        p.error(f"--arch: unknown {a.arch!r}; choose from {', '.join(architectures())}")
    if a.arch is None and not os.path.isfile(os.path.join(a.model, "config.json")):
        p.error(f"--model: {a.model} has no config.json (convert SmolLM2 with scripts/convert_smollm2.py, "
                f"or pass --arch smollm2-135m for random weights)")
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse(argv)
    if a.arch is not None:
        a.model = random_model_dir(a.arch, tempfile.mkdtemp(prefix="scaletrain-rollout-bench-"))
    t_load = time.perf_counter()
    engines: dict[str, Any] = {}
    for name in (c for c in a.contenders if c in rc.SCALETRAIN):
        made = rc.scaletrain_engine(name, a.model, a.dtype, a.slots)
        if made is None:
            print(f"{name}: skipped (this tree's scaletrain.generation has no ContinuousBatchEngine)", flush=True)
            continue
        engines[name] = made
    load_s = time.perf_counter() - t_load
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(a.model)
    per_token = wl.kv_bytes_per_token(hf_config, np.dtype(a.dtype).itemsize)
    todo = cases(a, a.model, hf_config.vocab_size, getattr(hf_config, "eos_token_id", None))
    # every case's first call of scaletrain's engines before torch is loaded (seed 1: the first timed seed)
    first = {(i, n): run(c["prompts"], c["generations"], c["cap"], c["stop"], 1)
             for i, c in enumerate(todo) for n, run in engines.items()}
    theirs = {n: rc.transformers_contender(n, a.model, a.dtype, a.torch_device)
              for n in a.contenders if n in rc.TRANSFORMERS}
    runs = {**engines, **theirs}
    rows = []
    for i, c in enumerate(todo):
        for run in theirs.values():  # transformers' own warm-up
            run(c["prompts"][:2], 1, 4, c["stop"], 0)
        calls: dict[str, list[rc.Call]] = {n: [] for n in runs}
        for r in range(a.repeats if c["workload"] == "fixed" else a.tail_repeats):
            for n, run in runs.items():
                calls[n].append(run(c["prompts"], c["generations"], c["cap"], c["stop"], r + 1))
        figures = {n: summarise(c, n, calls[n], first.get((i, n)), per_token, a.slots) for n in runs}
        row = {"workload": c["workload"], "batch": c["batch"], "prompt_count": len(c["prompts"]),
               "prompts": len(c["prompts"]), "generations": c["generations"], "cap": c["cap"],
               "new_tokens": c["cap"], "stop_ids": list(c["stop"])[:8], "contenders": figures,
               "ratios": ratios(figures), "load_avg": os.getloadavg()[0]}
        if c["workload"] == "fixed":
            row.update(legacy(row))
        print_case(row)
        rows.append(row)
    import jax

    result = {"model": a.arch or a.model, "dtype": a.dtype, "measured_on": str(jax.devices()[0].device_kind),
              "load_s": round(load_s, 2), "cpus": os.cpu_count(), "kv_bytes_per_token": per_token,
              "slots": a.slots, "skipped": [n for n in a.contenders if n not in runs], "rows": rows,
              "command": "python bench/rollout.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    write_record(result, "rollout", a.out)
    return result


if __name__ == "__main__":
    main()
