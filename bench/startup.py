"""Where a small run's start-up goes: imports, data, tracing, lowering, compiling, the steps.

``python bench/startup.py [--steps 2] [--grpo] [--out PATH] [-- RECIPE [OVERRIDES ...]]`` runs ``scaletrain
train`` (``examples/shakespeare.yaml`` by default, ``make train``'s job; ``--grpo``: a tiny GRPO recipe)
twice, each in a fresh process with a fresh output folder: first with an empty compilation cache (``cold``:
a first run), then with the cache that run left (``warm``: a second run, a resume, the next rung of a
sweep). Each process runs the CLI under ``cProfile`` and JAX's monitoring events and reports, in seconds:

- ``wall`` (process start to exit) and ``cpu`` (user + system of the process and its threads, which a
  descheduled process does not accrue: read proportions, not absolute figures, on a loaded machine);
- ``imports``: ``import`` statements, cumulative (an import inside a traced function counts here too);
- ``data``: building the data sets (reading and tokenizing; ``build_datasets``, GRPO's ``load_prompts``);
- ``trace`` / ``lower`` / ``compile``: JAX's jaxpr tracing, StableHLO lowering and backend compile
  (which includes reading the persistent cache: ``cache_read`` of it, with ``cache_hits`` of
  ``compiles`` programs);
- ``train``: the trainer's ``train()`` call (the steps, evaluation, checkpoints; its compiles included).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_RECIPE = os.path.join(ROOT, "examples", "shakespeare.yaml")

#: functions whose cumulative profile time is reported, by (file suffixes, function name)
PROFILED = {
    "imports": (("<frozen importlib._bootstrap>",), ("_find_and_load",)),
    "data": (("scaletrain/data/build.py", "scaletrain/data/prompts.py"), ("build_datasets", "load_prompts")),
    "train": (("scaletrain/training/trainer.py", "scaletrain/rl/trainer.py"), ("train",)),
}
EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read",
}


def child(out: str, argv: list[str]) -> None:
    """Run the CLI with ``argv`` in this process and write the breakdown to ``out``."""
    import cProfile
    import pstats
    import resource

    import jax

    seconds = dict.fromkeys(EVENTS.values(), 0.0)
    counts = {"compiles": 0, "cache_hits": 0}
    durations: list[float] = []

    def on_duration(event: str, duration: float, **_: Any) -> None:
        if event in EVENTS:
            seconds[EVENTS[event]] += duration
        if event == "/jax/core/compile/backend_compile_duration":
            counts["compiles"] += 1
            durations.append(duration)

    def on_event(event: str, **_: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            counts["cache_hits"] += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    from scaletrain.cli import main

    profile = cProfile.Profile()
    rc = profile.runcall(main, argv)
    stats = pstats.Stats(profile).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    for key, (suffixes, names) in PROFILED.items():
        seconds[key] = max((v[3] for (f, _, n), v in stats.items() if n in names and f.endswith(suffixes)),
                           default=0.0)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    durations.sort(reverse=True)
    record = {"rc": rc, "cpu": usage.ru_utime + usage.ru_stime, **seconds, **counts,
              "compiles_over_1s": sum(d >= 1.0 for d in durations),
              "compile_over_1s": sum(d for d in durations if d >= 1.0)}
    with open(out, "w") as f:
        json.dump(record, f)


#: ``--grpo``: a tiny GRPO run (a 1-layer Llama on the bundled tokenizer, a built-in reward), written to a temporary
#: folder: 12 completions a step in groups of 4, 8 tokens each
GRPO_PROMPTS = ["ROMEO.", "JULIET.", "Enter HAMLET.", "KING LEAR.", "What light", "To be, or", "Exit.", "MACBETH."]
GRPO_RECIPE = {
    "model": {"type": "llama", "vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64},
    "tokenizer": {"path": "bundled"},
    "data": {"kind": "prompt", "source": None},
    "training": {"total_batch_size": 12, "max_length": 32, "num_train_epochs": None, "learning_rate": 1e-3,
                 "scheduler": "constant", "log_steps": 1, "progress_bar": False, "report_to": []},
    "objective": {"type": "grpo", "num_generations": 4, "max_completion_length": 8,
                  "reward_funcs": [{"function": "format_regex", "pattern": "(?s).*[.!?].*"}]},
}


def grpo_recipe(folder: str) -> str:
    """Write the tiny GRPO recipe and its prompts under ``folder``; return the recipe's path."""
    import yaml

    prompts = os.path.join(folder, "prompts.jsonl")
    with open(prompts, "w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in GRPO_PROMPTS)
    recipe = json.loads(json.dumps(GRPO_RECIPE))
    recipe["data"]["source"] = prompts
    path = os.path.join(folder, "grpo.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(recipe, f)
    return path


def measure(argv: list[str], cache: str, label: str) -> dict[str, Any]:
    """One run in a fresh process; ``wall`` is measured from outside it (interpreter start included)."""
    with tempfile.TemporaryDirectory(prefix="scaletrain-startup-") as tmp:
        out = os.path.join(tmp, "record.json")
        env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
        cmd = [sys.executable, __file__, "--child", out, "--", *argv, f"training.output_dir={tmp}/run",
               f"training.compilation_cache_dir={cache}"]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        with open(out) as f:
            record = {"run": label, "wall": round(wall, 2), **json.load(f)}
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in record.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="training.max_training_steps of each run")
    parser.add_argument("--out", default=None, help="write the records here as JSON")
    parser.add_argument("--grpo", action="store_true", help="measure a tiny GRPO run instead of make train's job")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("recipe", nargs="*", help="a recipe and its overrides (default: make train's)")
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, ["train", *args.recipe])
        return
    with tempfile.TemporaryDirectory(prefix="scaletrain-startup-cache-") as cache:
        recipe = args.recipe or [grpo_recipe(cache) if args.grpo else DEFAULT_RECIPE]
        recipe = [*recipe, f"training.max_training_steps={args.steps}"]
        cache = os.path.join(cache, "jax")
        records = [measure(recipe, cache, "cold"), measure(recipe, cache, "warm")]
    load = os.getloadavg()[0]
    for r in records:
        print(json.dumps(r))
    print(f"load average (1 min) at the end: {load:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": sys.argv, "load": load, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
