"""Contender for ``bench/distill.py``: scaletrain's ``DistillationTrainer`` (the student samples from its live
parameters, the teacher's forward inside the jitted update), JAX CPU.

``python bench/contenders/scaletrain_distill.py --config CASE.json --out RESULT.json``: the TRL contender's case
and settings (float32 both, ``beta`` 1, temperature 1, full fine-tuning, AdamW with the Hugging Face defaults). A
callback reads the clock after each step (its figures are read on the host), so a step's time includes the
rollout and the update.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SPLIT = ("time/rollout", "time/update")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    with open(a.config) as f:
        case = json.load(f)
    import tempfile

    import jax
    import transformers

    import scaletrain as st
    from scaletrain.models.registry import AutoModelForCausalLM

    times: list[float] = []
    cpu: list[float] = []
    lengths: list[float] = []
    split: dict[str, list[float]] = {k: [] for k in SPLIT}

    class Clock(st.Callback):
        def post_step(self, trainer, step, metrics):
            values = metrics.host()
            times.append(time.perf_counter())
            cpu.append(time.process_time())
            if "completions/mean_length" in values:
                lengths.append(float(values["completions/mean_length"]))
            for k in SPLIT:
                split[k].append(round(float(values.get(k, 0.0)), 3))

    model = AutoModelForCausalLM.from_pretrained(case["student"], dtype="float32")
    tok = transformers.AutoTokenizer.from_pretrained(case["student"])
    with tempfile.TemporaryDirectory(prefix="bench-st-distill-") as tmp:
        args = st.DistillationConfig(
            output_dir=tmp, total_batch_size=case["batch"], max_length=128, learning_rate=case["learning_rate"],
            scheduler="constant", max_training_steps=case["steps"], log_steps=1, save_at_end=False,
            progress_bar=False, report_to=(), seed=0, optimizer="adamw", beta1=0.9, beta2=0.999,
            adam_epsilon=1e-8, weight_decay=0.0, clip_grad=1.0, beta=1.0, temperature=1.0,
            max_completion_length=case["max_completion_length"])
        trainer = st.DistillationTrainer(model=model, teacher_model=case["teacher"], args=args,
                                         train_dataset=case["rows"], processing_class=tok, callbacks=[Clock()])
        start, start_cpu = time.perf_counter(), time.process_time()
        trainer.train()
    steps = [t1 - t0 for t0, t1 in zip([start, *times[:-1]], times)]
    steps_cpu = [c1 - c0 for c0, c1 in zip([start_cpu, *cpu[:-1]], cpu)]
    result = {"contender": "scaletrain_distill", "step_s": steps, "step_cpu_s": steps_cpu,
              "mean_completion_length": lengths, "time_split": split, "jax": jax.__version__,
              "devices": len(jax.devices())}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
