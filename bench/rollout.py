"""Rollout tokens/s: scaletrain's rollout engine against transformers' ``generate``, side by side in one run.

``python bench/rollout.py [--model DIR | --arch NAME] [--batches 16,64] [--prompts 16] [--new 64] [--repeats 3]
[--dtype float32] [--profile]``

Both sample the same model (a local Hugging Face folder, ``--model``; default the converted
SmolLM2-135M-Instruct in ``~/.cache/scaletrain``; or, with ``--arch smollm2-135m|llama-1b|tiny``,
random weights of that architecture written once by transformers to a temporary folder: what
``bench/gpu.py --rollout`` uses where no checkpoint is at hand) in ``--dtype`` from the same prompts (random
token ids of 8 to 40 tokens, fixed seed), ``--new`` tokens each at temperature 1 without
top-k or top-p and without early stop (scaletrain: no stop ids; transformers:
``min_new_tokens`` = ``max_new_tokens``). A batch of B rows is ``--prompts`` prompts x
B / prompts generations each (scaletrain's ``num_generations``, transformers' rows repeated
likewise). Per batch: the engine's first call (tracing and compiling included; all batches' first
calls run before transformers is loaded, whose idle torch threads would share the CPU) and then
``--repeats`` alternating timed calls of each, reported as the median tokens/s (B x new /
wall seconds, host tokens in hand), tokens per CPU-second of the process, and the ratios. The engine is called as GRPO calls it,
on ``(graphdef, params)`` split once, so nothing is copied or re-split per call.

transformers runs on ``--torch-device`` (default: cuda when torch sees a GPU, else the CPU).
``--profile`` adds where one rollout's time goes by XLA op category (``bench/profile_step.py``'s
grouping; CPU time summed over threads). Writes ``--out`` (default
``bench/results/rollout-<date>.json``).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import write_record  # noqa: E402

DEFAULT_MODEL = os.path.expanduser("~/.cache/scaletrain/smollm2-135m-instruct")
#: SmolLM2-135M's architecture (its config.json), for random weights where the converted folder is absent
SMOLLM2_135M: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)


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


def make_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of random token ids (8 to 40 tokens; ids above the special ones)."""
    import numpy as np

    rs = np.random.RandomState(seed)
    return [rs.randint(16, vocab, rs.randint(8, 41)).tolist() for _ in range(count)]


def ours(model_dir: str, dtype: str) -> Any:
    """``(run(prompts, generations, new, seed) -> seconds, first_call_marker)`` for scaletrain's engine."""
    import jax
    import numpy as np
    from flax import nnx

    from scaletrain.generation import SamplingParams, rollout
    from scaletrain.models.registry import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    graphdef, params = nnx.split(model)
    mesh = jax.tree.leaves(params)[0].sharding.mesh

    def run(prompts: list[list[int]], generations: int, new: int, seed: int) -> tuple[float, Any]:
        sampling = SamplingParams(max_completion_length=new, temperature=1.0)
        t0, c0 = time.perf_counter(), time.process_time()
        with jax.set_mesh(mesh):
            out = rollout((graphdef, params), prompts, sampling, num_generations=generations, seed=seed)
        tokens = np.asarray(out.completion_ids)
        return time.perf_counter() - t0, (tokens, out, time.process_time() - c0)

    return run, model


def theirs(model_dir: str, dtype: str, device: str | None) -> Any:
    """``run(prompts, generations, new, seed) -> seconds`` for transformers' ``generate`` on ``device``."""
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    model = model.to(device)

    def run(prompts: list[list[int]], generations: int, new: int, seed: int) -> tuple[float, Any]:
        from scaletrain.generation import left_pad

        ids, mask = left_pad([p for p in prompts for _ in range(generations)])
        torch.manual_seed(seed)
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.no_grad():
            out = model.generate(torch.tensor(ids, dtype=torch.long, device=device),
                                 attention_mask=torch.tensor(mask, device=device), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
            tokens = out[:, ids.shape[1]:].cpu().numpy()  # the tokens in hand, as for scaletrain
        return time.perf_counter() - t0, (tokens, None, time.process_time() - c0)

    return run


def profile(run: Any, prompts: list[list[int]], generations: int, new: int) -> dict[str, float]:
    """CPU ms of one rollout by op category (the call compiled beforehand)."""
    from profile_step import CATEGORIES, categorise, trace

    ops = trace(lambda: run(prompts, generations, new, 0)[1][1].completion_ids, 1)
    cats: collections.Counter[str] = collections.Counter()
    for op, s in ops.items():
        cats[categorise(op)] += s
    print(f"  profile, one rollout of {len(prompts) * generations} x {new} (CPU ms, all threads):")
    for c in CATEGORIES:
        print(f"    {c:<16}{1e3 * cats[c]:10.1f}")
    for c in CATEGORIES:
        top = sorted(((s, op) for op, s in ops.items() if categorise(op) == c), reverse=True)[:3]
        print(f"    top {c}: " + ", ".join(f"{op} {1e3 * s:.0f} ms" for s, op in top))
    return {c: 1e3 * cats[c] for c in CATEGORIES}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--arch", default=None, help="random weights of smollm2-135m, llama-1b or tiny instead of --model")
    p.add_argument("--torch-device", default=None, help="transformers' device (default: cuda if available, else cpu)")
    p.add_argument("--batches", default="16,64")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-transformers", action="store_true", help="time scaletrain alone (profiling)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.profile:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()
    if a.arch is not None:
        import tempfile

        if a.arch not in architectures():
            p.error(f"--arch: unknown {a.arch!r}; choose from {', '.join(architectures())}")
        a.model = random_model_dir(a.arch, tempfile.mkdtemp(prefix="scaletrain-rollout-bench-"))
    elif not os.path.isfile(os.path.join(a.model, "config.json")):
        p.error(f"--model: {a.model} has no config.json (convert SmolLM2 with scripts/convert_smollm2.py, "
                f"or pass --arch smollm2-135m for random weights)")
    t_load = time.perf_counter()
    run_ours, model = ours(a.model, a.dtype)
    load_s = time.perf_counter() - t_load
    prompts = make_prompts(a.prompts, model.config.vocab_size)
    batches = [int(b) for b in a.batches.split(",")]
    if bad := [b for b in batches if b % a.prompts]:
        p.error(f"--batches: {bad} not a multiple of --prompts {a.prompts}")
    # each bucket's first call before torch is loaded: its idle worker threads would share the CPU
    first = {}
    for batch in batches:
        wall, (tokens, _, cpu) = run_ours(prompts, batch // a.prompts, a.new, 0)
        first[batch] = (wall, cpu)
        assert tokens.shape == (batch, a.new), tokens.shape
    run_theirs = None if a.no_transformers else theirs(a.model, a.dtype, a.torch_device)
    rows = []
    for batch in batches:
        g, (first_s, first_cpu_s) = batch // a.prompts, first[batch]
        if run_theirs is not None:
            run_theirs(prompts[:2], 1, 4, 0)  # transformers' own warm-up
        mine, ref, mine_cpu, ref_cpu = [], [], [], []
        for r in range(a.repeats):
            wall, (_, _, cpu) = run_ours(prompts, g, a.new, r + 1)
            mine.append(wall)
            mine_cpu.append(cpu)
            if run_theirs is not None:
                wall, (_, _, cpu) = run_theirs(prompts, g, a.new, r + 1)
                ref.append(wall)
                ref_cpu.append(cpu)
        ref, ref_cpu = ref or [float("nan")], ref_cpu or [float("nan")]
        tok = batch * a.new
        row = {"batch": batch, "prompts": a.prompts, "generations": g, "new_tokens": a.new,
               "first_call_s": round(first_s, 2), "first_call_cpu_s": round(first_cpu_s, 2),
               # the first call less a steady call: tracing and compiling the bucket's program
               "compile_s": round(first_s - statistics.median(mine), 2),
               "scaletrain_tok_s": round(tok / statistics.median(mine), 1),
               "transformers_tok_s": round(tok / statistics.median(ref), 1),
               # per CPU-second of this process: what a descheduled process does not accrue (shared CPU)
               "scaletrain_tok_cpu_s": round(tok / statistics.median(mine_cpu), 1),
               "transformers_tok_cpu_s": round(tok / statistics.median(ref_cpu), 1),
               "scaletrain_s": [round(x, 3) for x in mine], "transformers_s": [round(x, 3) for x in ref]}
        row["ratio"] = round(row["scaletrain_tok_s"] / row["transformers_tok_s"], 2)
        row["ratio_cpu_s"] = round(row["scaletrain_tok_cpu_s"] / row["transformers_tok_cpu_s"], 2)
        print(f"batch {batch:>3} ({a.prompts} prompts x {g}), {a.new} new tokens: scaletrain "
              f"{row['scaletrain_tok_s']:.0f} tok/s (first call {first_s:.1f} s, {first_cpu_s:.1f} CPU-s), transformers "
              f"{row['transformers_tok_s']:.0f} tok/s: {row['ratio']:.2f}x (per CPU-s {row['ratio_cpu_s']:.2f}x, "
              f"load {os.getloadavg()[0]:.1f})", flush=True)
        if a.profile:
            row["profile_cpu_ms"] = profile(run_ours, prompts, g, a.new)
        rows.append(row)
    import jax

    result = {"model": a.arch or a.model, "dtype": a.dtype, "measured_on": str(jax.devices()[0].device_kind),
              "load_s": round(load_s, 2), "cpus": os.cpu_count(), "load_avg": os.getloadavg()[0], "rows": rows,
              "command": "python bench/rollout.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    write_record(result, "rollout", a.out)
    return result


if __name__ == "__main__":
    main()
