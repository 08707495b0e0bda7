"""Rollout tokens/s: scaletrain's rollout engine against transformers' ``generate``, side by side in one run.

``python bench/rollout.py [--model DIR] [--batches 16,64] [--prompts 16] [--new 64] [--repeats 3] [--profile]``

Both sample the same model (a local Hugging Face folder; default the converted
SmolLM2-135M-Instruct in ``~/.cache/scaletrain``) in float32 from the same prompts (random
token ids of 8 to 40 tokens, fixed seed), ``--new`` tokens each at temperature 1 without
top-k or top-p and without early stop (scaletrain: no stop ids; transformers:
``min_new_tokens`` = ``max_new_tokens``). A batch of B rows is ``--prompts`` prompts x
B / prompts generations each (scaletrain's ``num_generations``, transformers' rows repeated
likewise). Per batch: the engine's first call (tracing and compiling included) and then
``--repeats`` alternating timed calls of each, reported as the median tokens/s (B x new /
wall seconds, host tokens in hand) and the ratio. The engine is called as GRPO calls it,
on ``(graphdef, params)`` split once, so nothing is copied or re-split per call.

``--profile`` adds where one rollout's time goes by XLA op category (``bench/profile_step.py``'s
grouping; CPU time summed over threads). Writes ``--out`` (default
``bench/results/rollout-<date>.json``).
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

DEFAULT_MODEL = os.path.expanduser("~/.cache/scaletrain/smollm2-135m-instruct")


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
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            out = rollout((graphdef, params), prompts, sampling, num_generations=generations, seed=seed)
        tokens = np.asarray(out.completion_ids)
        return time.perf_counter() - t0, (tokens, out)

    return run, model


def theirs(model_dir: str, dtype: str) -> Any:
    """``run(prompts, generations, new, seed) -> seconds`` for transformers' ``generate`` (torch CPU)."""
    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()

    def run(prompts: list[list[int]], generations: int, new: int, seed: int) -> tuple[float, Any]:
        from scaletrain.generation import left_pad

        ids, mask = left_pad([p for p in prompts for _ in range(generations)])
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                                 min_new_tokens=new, pad_token_id=0)
        return time.perf_counter() - t0, out[:, ids.shape[1]:].numpy()

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
    for op, s in sorted(ops.items(), key=lambda kv: -kv[1])[:10]:
        print(f"    {1e3 * s:10.1f} ms  {op}")
    return {c: 1e3 * cats[c] for c in CATEGORIES}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--batches", default="16,64")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.profile:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()
    t_load = time.perf_counter()
    run_ours, model = ours(a.model, a.dtype)
    load_s = time.perf_counter() - t_load
    run_theirs = theirs(a.model, a.dtype)
    prompts = make_prompts(a.prompts, model.config.vocab_size)
    rows = []
    for batch in (int(b) for b in a.batches.split(",")):
        if batch % a.prompts:
            raise SystemExit(f"--batches: {batch} is not a multiple of --prompts {a.prompts}")
        g = batch // a.prompts
        first_s, (tokens, _) = run_ours(prompts, g, a.new, 0)
        assert tokens.shape == (batch, a.new), tokens.shape
        run_theirs(prompts[:2], 1, 4, 0)  # transformers' own warm-up
        mine, ref = [], []
        for r in range(a.repeats):
            mine.append(run_ours(prompts, g, a.new, r + 1)[0])
            ref.append(run_theirs(prompts, g, a.new, r + 1)[0])
        tok = batch * a.new
        row = {"batch": batch, "prompts": a.prompts, "generations": g, "new_tokens": a.new,
               "first_call_s": round(first_s, 2), "scaletrain_tok_s": round(tok / statistics.median(mine), 1),
               "transformers_tok_s": round(tok / statistics.median(ref), 1),
               "scaletrain_s": [round(x, 3) for x in mine], "transformers_s": [round(x, 3) for x in ref]}
        row["ratio"] = round(row["scaletrain_tok_s"] / row["transformers_tok_s"], 2)
        print(f"batch {batch:>3} ({a.prompts} prompts x {g}), {a.new} new tokens: scaletrain "
              f"{row['scaletrain_tok_s']:.0f} tok/s (first call {first_s:.1f} s), transformers "
              f"{row['transformers_tok_s']:.0f} tok/s: {row['ratio']:.2f}x", flush=True)
        if a.profile:
            row["profile_cpu_ms"] = profile(run_ours, prompts, g, a.new)
        rows.append(row)
    result = {"model": a.model, "dtype": a.dtype, "load_s": round(load_s, 2), "cpus": os.cpu_count(),
              "load_avg": os.getloadavg()[0], "rows": rows,
              "command": "python bench/rollout.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    out = a.out or os.path.join(HERE, "results", f"rollout-{dt.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
