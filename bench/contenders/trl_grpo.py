"""Contender for ``bench/grpo.py``: TRL's ``GRPOTrainer`` (transformers generation, no vLLM), torch CPU.

``python bench/contenders/trl_grpo.py --config CASE.json --out RESULT.json``: the case's model
folder, prompt rows, reward (``scaletrain.rl.rewards.exact_answer``: a TRL-signature function, so
the same callable scores both contenders), batch and lengths; one generation per step
(``steps_per_generation`` 1, ``num_iterations`` 1), float32 (``model_init_kwargs`` and ``bf16``
off: TRL's default is bf16), no gradient checkpointing (TRL's default is on; ours is off), ``beta``
0, AdamW with the Hugging Face defaults (betas 0.9 / 0.999, eps 1e-8, clip 1.0, no weight decay), the
scaletrain contender's settings. A ``TrainerCallback`` reads the clock at each step's end; eager
torch on CPU is synchronous.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    with open(a.config) as f:
        case = json.load(f)
    import tempfile

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from scaletrain.rl.rewards import exact_answer

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(os.cpu_count() or 1)
    times: list[float] = []
    cpu: list[float] = []  # process CPU seconds (all threads) at each step's end
    lengths: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # type: ignore[override]
            times.append(time.perf_counter())
            cpu.append(time.process_time())

        def on_log(self, args, state, control, logs=None, **kw):  # type: ignore[override]
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    dataset = Dataset.from_list(case["rows"])
    with tempfile.TemporaryDirectory(prefix="bench-trl-grpo-") as tmp:
        args = GRPOConfig(
            output_dir=tmp, per_device_train_batch_size=case["batch"], num_generations=case["num_generations"],
            steps_per_generation=1, num_iterations=1, max_completion_length=case["max_completion_length"],
            temperature=1.0, top_p=1.0, top_k=0, beta=0.0, loss_type="dapo", scale_rewards="group",
            mask_truncated_completions=False, learning_rate=case["learning_rate"], lr_scheduler_type="constant",
            optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0,
            max_grad_norm=1.0, max_steps=case["steps"], logging_steps=1, save_strategy="no", report_to="none",
            use_cpu=True, bf16=False, gradient_checkpointing=False, model_init_kwargs={"dtype": "float32"},
            seed=0, log_completions=False, disable_tqdm=True, dataloader_num_workers=0)
        trainer = GRPOTrainer(model=case["model"], reward_funcs=[exact_answer], args=args, train_dataset=dataset,
                              callbacks=[Clock()])
        start, start_cpu = time.perf_counter(), time.process_time()
        trainer.train()
    steps = [t1 - t0 for t0, t1 in zip([start, *times[:-1]], times)]
    steps_cpu = [c1 - c0 for c0, c1 in zip([start_cpu, *cpu[:-1]], cpu)]
    result = {"contender": "trl_grpo", "step_s": steps, "step_cpu_s": steps_cpu, "mean_completion_length": lengths,
              "trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
              "threads": torch.get_num_threads()}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
