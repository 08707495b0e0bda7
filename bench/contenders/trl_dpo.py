"""The TRL contender of ``bench/preference.py``: TRL's ``DPOTrainer`` as a TRL user would run it, on CPU.

``python bench/contenders/trl_dpo.py --spec FILE --out FILE``. The spec (written by
``bench/preference.py``) names the model folder, the pairs (TRL's conversational JSONL,
exactly the rows scaletrain's side trains on), the batch in pairs, ``max_length``,
the warm-up and timed step counts, beta, the learning rate and the reference choice:
``frozen`` (TRL's default: a second copy of the model loaded from the same folder),
``precomputed`` (``precompute_ref_log_probs=True``: one pass before training, outside
the timed steps) or ``lora`` (a PEFT model: the reference is the base with its
adapters disabled). Two of DPOConfig's defaults are turned off so both sides compute the
same thing: ``bf16`` (float32 here, as scaletrain's side) and ``gradient_checkpointing``
(scaletrain's step does not recompute activations; the spec may turn it back on). TRL's
own defaults otherwise (its optimizer, its per-batch padding to the longest sequence,
sigmoid loss), no gradient accumulation, no logging or saving in the timed steps. Seconds per step are read by a callback at each
step's end (wall and this process's CPU seconds); the result is the mean over the timed steps
after the warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from typing import Any


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``warmup + steps`` DPO steps with TRL; seconds per step, memory and the last loss."""
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    torch.manual_seed(0)
    rows = [json.loads(line) for line in open(spec["pairs"])]
    dataset = datasets.Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    variant = spec.get("reference", spec["variant"])
    peft_config = None
    if variant == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=spec["lora_rank"], lora_alpha=2 * spec["lora_rank"], lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    total = spec["warmup"] + spec["steps"]
    marks: list[float] = []
    cpu_marks: list[float] = []
    losses: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            marks.append(time.perf_counter())
            cpu_marks.append(time.process_time())

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    with tempfile.TemporaryDirectory(prefix="trl-dpo-") as out:
        args = trl.DPOConfig(
            output_dir=out, per_device_train_batch_size=spec["batch"], gradient_accumulation_steps=1,
            max_steps=total, max_length=spec["max_length"], beta=spec["beta"], learning_rate=spec["learning_rate"],
            precompute_ref_log_probs=variant == "precomputed", logging_steps=total, save_strategy="no",
            report_to=[], use_cpu=True, dataloader_num_workers=0, dataloader_pin_memory=False, seed=0,
            disable_tqdm=True, model_init_kwargs={"dtype": torch.float32}, bf16=spec.get("bf16", False),
            gradient_checkpointing=spec.get("gradient_checkpointing", False))
        # the model as a path when TRL must build the reference itself (what a TRL user writes)
        trainer = trl.DPOTrainer(model=spec["model"] if variant == "frozen" else model, args=args,
                                 train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config)
        trainer.add_callback(Clock())
        ref = trainer.ref_model
        ref_bytes = 0 if ref is None else sum(p.numel() * p.element_size() for p in ref.parameters())
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
    timed = marks[spec["warmup"]:]
    start = marks[spec["warmup"] - 1]
    per_step = (timed[-1] - start) / len(timed)
    return {
        "variant": spec["variant"],
        "reference": variant,
        "seconds_per_step": per_step,
        "cpu_seconds_per_step": (cpu_marks[-1] - cpu_marks[spec["warmup"] - 1]) / len(timed),
        "pairs_per_s": spec["batch"] / per_step,
        "step_seconds": [b - a for a, b in zip(marks, marks[1:])],
        "train_wall_s": wall,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "reference_weight_bytes": ref_bytes,
        "final_loss": losses[-1] if losses else None,
        "info": {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                 "threads": torch.get_num_threads(), "optimizer": str(args.optim), "bf16": args.bf16,
                 "gradient_checkpointing": args.gradient_checkpointing,
                 "padding": "per batch, to its longest sequence (TRL's collator)"},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True, help="the run as a JSON file (bench/preference.py writes it)")
    p.add_argument("--out", required=True, help="result JSON")
    a = p.parse_args(argv)
    with open(a.spec) as f:
        result = run(json.load(f))
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
