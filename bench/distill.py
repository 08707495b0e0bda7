"""One on-policy distillation step (the student samples, the teacher scores, one update): scaletrain's
``DistillationTrainer`` against TRL 1.16's, side by side.

``python bench/distill.py [--student DIR] [--teacher DIR] [--prompts examples/grpo/prompts.jsonl] [--batch 8]
[--max-completion-length 32] [--steps 6] [--warmup 2] [--only trl,scaletrain]``

Both contenders train the same student from the same teacher (local Hugging Face folders; default the converted
SmolLM2-135M-Instruct as both: the only model of its tokenizer available offline, so the teacher is a second
copy of the same weights, which costs what a same-size teacher costs), float32, on the same prompt rows (the GRPO
example's), ``--batch`` prompts a step, one completion each of at most ``--max-completion-length`` tokens at
temperature 1, ``beta`` 1 (the reverse KL over the whole vocabulary), full fine-tuning. Each runs in its own
process, one after the other, as ``bench/grpo.py``'s contenders (its timing and summary: the median step after
``--warmup``, wall and process CPU seconds, the load average around each). Sampled lengths differ between the
two (each samples its own), so each reports its mean completion length. Writes ``--out`` (default
``bench/results/distill-<date>.json``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import grpo  # noqa: E402  (its contender runner, rows and summary)
from common import write_record  # noqa: E402

grpo.CONTENDERS.update({"trl_distill": "trl_distill.py", "scaletrain_distill": "scaletrain_distill.py"})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--student", default=grpo.DEFAULT_MODEL)
    p.add_argument("--teacher", default=grpo.DEFAULT_MODEL)
    p.add_argument("--prompts", default=os.path.join(grpo.ROOT, "examples", "grpo", "prompts.jsonl"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=32)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--learning-rate", type=float, default=1e-6)
    p.add_argument("--only", default="trl,scaletrain")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.steps <= a.warmup:
        raise SystemExit(f"--steps {a.steps} must exceed --warmup {a.warmup}")
    case = {"student": a.student, "teacher": a.teacher, "rows": grpo.load_rows(a.prompts, 4 * a.batch),
            "batch": a.batch, "max_completion_length": a.max_completion_length, "steps": a.steps,
            "learning_rate": a.learning_rate}
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-distill-") as workdir:
        for name in a.only.split(","):
            before = os.getloadavg()
            rows[name] = grpo.summarise(grpo.run_contender(f"{name}_distill", case, workdir), a.warmup, a.batch)
            r = rows[name]
            r["load_avg_before"] = [round(x, 2) for x in before]
            r["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
            print(f"{name:>10}: {r['median_step_s']:.2f} s/step median after {a.warmup} (first {r['first_step_s']:.1f} "
                  f"s), mean completion length {statistics.mean(r['mean_completion_length'] or [0]):.1f}, "
                  f"{r['median_step_cpu_s']:.2f} CPU-s/step, load {r['load_avg_before'][0]:.1f} -> "
                  f"{r['load_avg_after'][0]:.1f}", flush=True)
    result = {"student": a.student, "teacher": a.teacher, "batch": a.batch,
              "max_completion_length": a.max_completion_length, "steps": a.steps, "warmup": a.warmup,
              "cpus": os.cpu_count(), "contenders": rows,
              "command": "python bench/distill.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    if "trl" in rows and "scaletrain" in rows:
        result["steps_per_s_ratio"] = round(rows["scaletrain"]["steps_per_s"] / rows["trl"]["steps_per_s"], 2)
        result["steps_per_cpu_s_ratio"] = round(rows["scaletrain"]["steps_per_cpu_s"]
                                                / rows["trl"]["steps_per_cpu_s"], 2)
        print(f"scaletrain / TRL steps per second: {result['steps_per_s_ratio']:.2f}x wall, "
              f"{result['steps_per_cpu_s_ratio']:.2f}x per CPU-s")
    write_record(result, "distill", a.out)
    return result


if __name__ == "__main__":
    main()
