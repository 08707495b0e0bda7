"""Contender for ``bench/distill.py``: TRL 1.16's ``DistillationTrainer`` (transformers generation, no vLLM), torch CPU.

``python bench/contenders/trl_distill.py --config CASE.json --out RESULT.json``: the case's student and teacher
folders, prompt rows, batch and completion length; every step samples one completion a prompt from the student
and takes one step of the reverse KL (``beta`` 1) at temperature 1 with the teacher; float32 both (TRL's default
is bf16), no gradient checkpointing (TRL's default is on; ours is off), AdamW with the Hugging Face defaults. A
``TrainerCallback`` reads the clock at each step's end; eager torch on CPU is synchronous.
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
    from trl import DistillationConfig, DistillationTrainer

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(os.cpu_count() or 1)
    times: list[float] = []
    cpu: list[float] = []
    lengths: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # type: ignore[override]
            times.append(time.perf_counter())
            cpu.append(time.process_time())

        def on_log(self, args, state, control, logs=None, **kw):  # type: ignore[override]
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    with tempfile.TemporaryDirectory(prefix="bench-trl-distill-") as tmp:
        args = DistillationConfig(
            output_dir=tmp, per_device_train_batch_size=case["batch"],
            max_completion_length=case["max_completion_length"],
            temperature=1.0, top_p=1.0, top_k=0, beta=1.0, learning_rate=case["learning_rate"],
            lr_scheduler_type="constant", optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
            weight_decay=0.0, max_grad_norm=1.0, max_steps=case["steps"], logging_steps=1, save_strategy="no",
            report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False,
            model_init_kwargs={"dtype": "float32"}, teacher_model_init_kwargs={"dtype": "float32"}, seed=0,
            disable_tqdm=True, dataloader_num_workers=0)
        trainer = DistillationTrainer(model=case["student"], teacher_model=case["teacher"], args=args,
                                      train_dataset=Dataset.from_list(case["rows"]), callbacks=[Clock()])
        start, start_cpu = time.perf_counter(), time.process_time()
        trainer.train()
    steps = [t1 - t0 for t0, t1 in zip([start, *times[:-1]], times)]
    steps_cpu = [c1 - c0 for c0, c1 in zip([start_cpu, *cpu[:-1]], cpu)]
    result = {"contender": "trl_distill", "step_s": steps, "step_cpu_s": steps_cpu, "mean_completion_length": lengths,
              "trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
              "threads": torch.get_num_threads()}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
