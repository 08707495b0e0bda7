"""Contender for ``bench/grpo.py``: scaletrain's ``GRPOTrainer`` (rollouts from the live parameters), JAX CPU.

``python bench/contenders/scaletrain_grpo.py --config CASE.json --out RESULT.json``: the case's model
folder, prompt rows, reward (``exact_answer``), batch and lengths, as the TRL contender; float32,
``beta`` 0, one rollout per step, full fine-tuning, AdamW with the Hugging Face defaults (betas 0.9 /
0.999, eps 1e-8, clip 1.0, no weight decay) as TRL's. A callback reads the clock after each step
(the GRPO step ends on the host: its figures are read there), so a step's time includes its
rollout, the trainer's scoring forward, the rewards and the update.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

#: the trainer's own time split of a step, recorded per step beside the clock
SPLIT = ("time/rollout", "time/reference", "time/rewards", "time/update")


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
    from scaletrain.rl.rewards import exact_answer

    times: list[float] = []
    cpu: list[float] = []  # process CPU seconds (all threads) at each step's end
    lengths: list[float] = []
    split: dict[str, list[float]] = {k: [] for k in SPLIT}  # the trainer's own time split, per step

    class Clock(st.Callback):
        def post_step(self, trainer, step, metrics):
            values = metrics.host()  # the step is done once its figures are on the host
            times.append(time.perf_counter())
            cpu.append(time.process_time())
            if "completions/mean_length" in values:
                lengths.append(float(values["completions/mean_length"]))
            for k in SPLIT:
                split[k].append(round(float(values.get(k, 0.0)), 3))

    model = AutoModelForCausalLM.from_pretrained(case["model"], dtype="float32")
    tok = transformers.AutoTokenizer.from_pretrained(case["model"])
    with tempfile.TemporaryDirectory(prefix="bench-st-grpo-") as tmp:
        args = st.TrainingArguments(
            output_dir=tmp, total_batch_size=case["batch"], max_length=128, learning_rate=case["learning_rate"],
            scheduler="constant", max_training_steps=case["steps"], log_steps=1, save_at_end=False,
            progress_bar=False, report_to=(), seed=0, optimizer="adamw", beta1=0.9, beta2=0.999,
            epsilon=1e-8, weight_decay=0.0, clip_grad=1.0)
        options = {"num_generations": case["num_generations"], "max_completion_length": case["max_completion_length"],
                   "temperature": 1.0, "top_p": 1.0, "top_k": 0, "beta": 0.0, "loss_type": "dapo",
                   "scale_rewards": "group", "num_iterations": 1, "mask_truncated_completions": False,
                   "log_completions": False, "rollout_engine": case.get("rollout_engine", "static")}
        trainer = st.GRPOTrainer(model=model, reward_funcs=[exact_answer], args=args, train_dataset=case["rows"],
                                 processing_class=tok, options=options, callbacks=[Clock()])
        start, start_cpu = time.perf_counter(), time.process_time()
        trainer.train()
    steps = [t1 - t0 for t0, t1 in zip([start, *times[:-1]], times)]
    steps_cpu = [c1 - c0 for c0, c1 in zip([start_cpu, *cpu[:-1]], cpu)]
    result = {"contender": "scaletrain_grpo", "step_s": steps, "step_cpu_s": steps_cpu,
              "mean_completion_length": lengths, "time_split": split, "jax": jax.__version__,
              "devices": len(jax.devices())}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
