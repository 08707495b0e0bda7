"""lm-eval loglikelihood requests through scaletrain's model vs lm-eval's own ``hf`` model, side by side.

``PYTHONPATH=. python bench/eval.py [--requests 512] [--batch-size 16] [--repeats 3] [--tiny] [--out FILE]``

One random Llama (hidden 256, 4 layers, the bundled 4096-token tokenizer, float32) saved as an
HF folder; the same ``--requests`` multiple-choice-like requests (Shakespeare lines as contexts
of 8-120 tokens, 1-6-token continuations), the same batch size and the same CPU. Each system
is timed ``--repeats`` times after one warm-up pass (ours compiles its shape buckets there),
interleaved ours / theirs so the machine's drift hits both; the figure is the median of each,
in requests/s, and their ratio. The summed log-likelihoods are compared too (max relative
difference), so the speed is for the same answers. Wall clock and process CPU time are
both recorded (a shared VM's neighbours slow wall time, not CPU time).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def make_folder(folder: str, tiny: bool) -> str:
    import torch
    import transformers

    from scaletrain.data import load_processor, resolve_tokenizer_path

    tok = load_processor(resolve_tokenizer_path("bundled"))
    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2) if tiny else dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=4)
    config = transformers.LlamaConfig(vocab_size=len(tok), num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **size)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def make_requests(n: int, seed: int = 0) -> list[Any]:
    """``n`` loglikelihood Instances: a Shakespeare passage as context, a few following words to score."""
    import gzip

    from lm_eval.api.instance import Instance

    with gzip.open(os.path.join(os.path.dirname(HERE), "scaletrain", "assets", "shakespeare.jsonl.gz"), "rt") as f:
        words = " ".join(json.loads(next(f))["text"].split()[:20000]).split(" ")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        start, length = rng.randrange(0, len(words) - 200), rng.randint(6, 90)
        ctx = " ".join(words[start: start + length])
        cont = " " + " ".join(words[start + length: start + length + rng.randint(1, 4)])
        out.append(Instance("loglikelihood", {}, (ctx, cont), i))
    return out


def timed(fn: Any) -> tuple[float, float, Any]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model (the smoke test)")
    p.add_argument("--out", default=None)
    a = p.parse_args()

    import torch
    from lm_eval.models.huggingface import HFLM

    from scaletrain.eval.lm_eval_model import ScaletrainLM

    folder = make_folder(tempfile.mkdtemp(prefix="scaletrain-bench-eval-"), a.tiny)
    requests = make_requests(a.requests)
    ours = ScaletrainLM(pretrained=folder, batch_size=a.batch_size)
    theirs = HFLM(pretrained=folder, batch_size=a.batch_size, dtype="float32", device="cpu")
    runs: dict[str, list[tuple[float, float]]] = {"scaletrain": [], "hf": []}
    warm: dict[str, float] = {}
    answers: dict[str, Any] = {}
    for name, lm in (("scaletrain", ours), ("hf", theirs)):
        warm[name], _, answers[name] = timed(lambda lm=lm: lm.loglikelihood(requests, disable_tqdm=True))
    for _ in range(a.repeats):
        for name, lm in (("scaletrain", ours), ("hf", theirs)):
            wall, cpu, _ = timed(lambda lm=lm: lm.loglikelihood(requests, disable_tqdm=True))
            runs[name].append((wall, cpu))
    rel = max(abs(x[0] - y[0]) / max(abs(y[0]), 1e-9) for x, y in zip(answers["scaletrain"], answers["hf"]))
    same_greedy = all(x[1] == y[1] for x, y in zip(answers["scaletrain"], answers["hf"]))
    result: dict[str, Any] = {"requests": a.requests, "batch_size": a.batch_size, "repeats": a.repeats,
                              "tiny": a.tiny, "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                              "load_avg": os.getloadavg()[0], "max_rel_diff": rel, "same_greedy": same_greedy,
                              "shapes_compiled": sorted(ours.scorer.shapes_seen)}
    for name, r in runs.items():
        wall, cpu = statistics.median(x[0] for x in r), statistics.median(x[1] for x in r)
        result[name] = {"first_pass_s": warm[name], "wall_s": wall, "cpu_s": cpu,
                        "requests_per_s": a.requests / wall, "requests_per_cpu_s": a.requests / cpu}
    result["ratio_wall"] = result["scaletrain"]["requests_per_s"] / result["hf"]["requests_per_s"]
    result["ratio_cpu"] = result["scaletrain"]["requests_per_cpu_s"] / result["hf"]["requests_per_cpu_s"]
    print("| model | first pass s | requests/s | requests/CPU-s |\n| --- | ---: | ---: | ---: |")
    for name in ("scaletrain", "hf"):
        r = result[name]
        print(f"| {name} | {r['first_pass_s']:.2f} | {r['requests_per_s']:.1f} | {r['requests_per_cpu_s']:.1f} |")
    print(f"ratio {result['ratio_wall']:.2f}x wall, {result['ratio_cpu']:.2f}x per CPU-s; max relative "
          f"log-likelihood difference {rel:.2e}; same is_greedy {same_greedy}; shapes {result['shapes_compiled']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
