"""One whole GRPO step (rollout, rewards, update): scaletrain's ``GRPOTrainer`` against TRL 1.16's, side by side.

``python bench/grpo.py [--model DIR] [--prompts examples/grpo/prompts.jsonl] [--batch 16]
[--num-generations 4] [--max-completion-length 32] [--steps 8] [--warmup 2] [--only trl,scaletrain]
[--rollout-engine static|continuous] [--compare-tree DIR --rounds 2]``

Both contenders train the same model (a local Hugging Face folder; default the converted
SmolLM2-135M-Instruct in ``~/.cache/scaletrain``), full fine-tuning in float32, on the same
prompt rows (the GRPO example's arithmetic questions) with the same reward
(``exact_answer``, which has TRL's signature), ``--batch`` completions per step in groups of
``--num-generations``, at most ``--max-completion-length`` tokens at temperature 1 (both stop at
the end-of-turn token, so each reports its mean completion length), ``beta`` 0, DAPO's loss,
one generation per step. TRL generates with transformers (no vLLM). Each runs in its own
process, one after the other (never at once), so neither shares threads, allocators or a JIT
cache with the other. A step's time is the wall time between the ends of consecutive steps;
reported is the median over the steps after ``--warmup`` (the first includes compilation,
reported apart), in wall seconds and in the process's CPU seconds (all threads: what a neighbour's
load does not add), with the load average before and after each contender. Writes ``--out``
(default ``bench/results/grpo-<date>.json``).

``--compare-tree DIR``: scaletrain before and after a change instead of against TRL: the contender of
another checkout (``DIR``, e.g. ``git worktree add /tmp/grpo-before <commit>``) and this one's, on the same
case, alternating (before, after, before, after, ... for ``--rounds`` rounds, so a change in the machine's
load falls on both), each in its own process; prints each run and the ratio of the medians
(after / before steps per second).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import write_record  # noqa: E402
ROOT = os.path.dirname(HERE)
DEFAULT_MODEL = os.path.expanduser("~/.cache/scaletrain/smollm2-135m-instruct")
CONTENDERS = {"trl": "trl_grpo.py", "scaletrain": "scaletrain_grpo.py"}


def load_rows(path: str, count: int) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows[:count]]


def run_contender(name: str, case: dict[str, Any], workdir: str, root: str = ROOT) -> dict[str, Any]:
    """Run one contender (of the checkout ``root``: its code and its contender script) in its own process; its
    result JSON."""
    config, out = os.path.join(workdir, "case.json"), os.path.join(workdir, f"{name}.json")
    with open(config, "w") as f:
        json.dump(case, f)
    script = os.path.join(root, "bench", "contenders", CONTENDERS[name])
    cmd = [sys.executable, script, "--config", config, "--out", out]
    env = {**os.environ, "PYTHONPATH": root}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def summarise(result: dict[str, Any], warmup: int, batch: int) -> dict[str, Any]:
    steps, cpu = result["step_s"], result["step_cpu_s"]
    median, median_cpu = statistics.median(steps[warmup:]), statistics.median(cpu[warmup:])
    return {"first_step_s": round(steps[0], 2), "median_step_s": round(median, 3), "steps_per_s": round(1 / median, 4),
            "median_step_cpu_s": round(median_cpu, 3), "steps_per_cpu_s": round(1 / median_cpu, 4),
            "completions_per_s": round(batch / median, 2), "step_s": [round(s, 3) for s in steps],
            "step_cpu_s": [round(s, 3) for s in cpu],
            "mean_completion_length": [round(x, 2) for x in result["mean_completion_length"]],
            **{k: v for k, v in result.items() if k not in ("step_s", "step_cpu_s", "mean_completion_length")}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompts", default=os.path.join(ROOT, "examples", "grpo", "prompts.jsonl"))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=32)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--learning-rate", type=float, default=1e-6)
    p.add_argument("--only", default="trl,scaletrain")
    p.add_argument("--rollout-engine", default="static", choices=("static", "continuous"),
                   help="the engine scaletrain's GRPOTrainer samples with (objective.rollout_engine)")
    p.add_argument("--out", default=None)
    p.add_argument("--compare-tree", default=None, help="another checkout: scaletrain there against here")
    p.add_argument("--rounds", type=int, default=2, help="with --compare-tree: before/after pairs, alternating")
    a = p.parse_args(argv)
    if a.steps <= a.warmup:
        raise SystemExit(f"--steps {a.steps} must exceed --warmup {a.warmup}")
    case = {"model": a.model, "rows": load_rows(a.prompts, 4 * a.batch), "batch": a.batch,
            "num_generations": a.num_generations, "max_completion_length": a.max_completion_length,
            "steps": a.steps, "learning_rate": a.learning_rate, "rollout_engine": a.rollout_engine}
    if a.compare_tree is not None:
        return compare_trees(a, case, argv)
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-grpo-") as workdir:
        for name in a.only.split(","):
            before = os.getloadavg()
            rows[name] = summarise(run_contender(name, case, workdir), a.warmup, a.batch)
            r = rows[name]
            r["load_avg_before"] = [round(x, 2) for x in before]
            r["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
            print(f"{name:>10}: {r['median_step_s']:.2f} s/step median after {a.warmup} (first {r['first_step_s']:.1f} s), "
                  f"{r['completions_per_s']:.2f} completions/s, mean completion length "
                  f"{statistics.mean(r['mean_completion_length'] or [0]):.1f}, "
                  f"{r['median_step_cpu_s']:.2f} CPU-s/step, "
                  f"load {r['load_avg_before'][0]:.1f} -> {r['load_avg_after'][0]:.1f}", flush=True)
    result = {"model": a.model, "batch": a.batch, "num_generations": a.num_generations,
              "rollout_engine": a.rollout_engine,
              "max_completion_length": a.max_completion_length, "steps": a.steps, "warmup": a.warmup,
              "cpus": os.cpu_count(), "load_avg": os.getloadavg()[0], "contenders": rows,
              "command": "python bench/grpo.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    if "trl" in rows and "scaletrain" in rows:
        result["steps_per_s_ratio"] = round(rows["scaletrain"]["steps_per_s"] / rows["trl"]["steps_per_s"], 2)
        per_cpu = rows["scaletrain"]["steps_per_cpu_s"] / rows["trl"]["steps_per_cpu_s"]
        result["steps_per_cpu_s_ratio"] = round(per_cpu, 2)
        print(f"scaletrain / TRL steps per second: {result['steps_per_s_ratio']:.2f}x wall, "
              f"{result['steps_per_cpu_s_ratio']:.2f}x per CPU-s")
    write_record(result, "grpo", a.out)
    return result


def compare_trees(a: argparse.Namespace, case: dict[str, Any], argv: list[str] | None) -> dict[str, Any]:
    """``--compare-tree``: scaletrain's contender of ``a.compare_tree`` ("before") and of this checkout ("after"),
    alternating for ``a.rounds`` rounds; the ratio of their median step times."""
    trees = {"before": os.path.abspath(a.compare_tree), "after": ROOT}
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="bench-grpo-") as workdir:
        for i in range(a.rounds):
            for name, root in trees.items():
                load = os.getloadavg()[0]
                r = summarise(run_contender("scaletrain", case, workdir, root), a.warmup, a.batch)
                r["load_avg"] = [round(load, 2), round(os.getloadavg()[0], 2)]
                runs[name].append(r)
                print(f"round {i + 1} {name:>6}: {r['median_step_s']:.3f} s/step median after {a.warmup} "
                      f"(first {r['first_step_s']:.1f} s), {r['median_step_cpu_s']:.3f} CPU-s/step, split "
                      f"{ {k: statistics.median(v[a.warmup:]) for k, v in r['time_split'].items()} }, "
                      f"load {r['load_avg'][0]:.1f} -> {r['load_avg'][1]:.1f}", flush=True)
    median = {k: statistics.median(r["median_step_s"] for r in v) for k, v in runs.items()}
    median_cpu = {k: statistics.median(r["median_step_cpu_s"] for r in v) for k, v in runs.items()}
    result = {"model": a.model, "batch": a.batch, "num_generations": a.num_generations,
              "rollout_engine": a.rollout_engine,
              "max_completion_length": a.max_completion_length, "steps": a.steps, "warmup": a.warmup,
              "cpus": os.cpu_count(), "trees": trees, "runs": runs, "median_step_s": median,
              "median_step_cpu_s": median_cpu,
              "steps_per_s_ratio": round(median["before"] / median["after"], 3),
              "steps_per_cpu_s_ratio": round(median_cpu["before"] / median_cpu["after"], 3),
              "command": "python bench/grpo.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(f"after / before steps per second: {result['steps_per_s_ratio']:.3f}x wall "
          f"({median['before']:.3f} -> {median['after']:.3f} s/step), "
          f"{result['steps_per_cpu_s_ratio']:.3f}x per CPU-s", flush=True)
    write_record(result, "grpo-compare", a.out)
    return result


if __name__ == "__main__":
    main()
