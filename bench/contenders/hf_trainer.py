"""Contender: the Hugging Face ``Trainer`` (torch CPU), eager or with ``torch.compile``.

``--variant compile`` sets ``TrainingArguments(torch_compile=True)`` (inductor, the
default backend). The model is transformers' ``LlamaForCausalLM`` with the same
config, float32 weights (bf16 autocast when the benchmark's compute dtype is
bfloat16), the default attention implementation (SDPA), AdamW (torch) with the
same betas, clip 1.0 and a constant learning rate. A ``TrainerCallback`` reads the
clock at the benchmark's boundaries; eager torch on CPU is synchronous, so no sync
is needed.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import StepClock, contender_args, variant_arg  # noqa: E402


def main() -> None:
    cfg, tokens_path, out = contender_args()
    compiled = variant_arg() == "compile"
    clock = StepClock("hf_compile" if compiled else "hf_eager", cfg)
    import tempfile

    import numpy as np
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    transformers.logging.set_verbosity_error()
    torch.manual_seed(cfg.seed)
    tokens = torch.from_numpy(np.load(tokens_path).astype(np.int64))

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return tokens.shape[0]

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": tokens[i], "labels": tokens[i]}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # type: ignore[override]
            if clock.wants(state.global_step):
                clock.mark(state.global_step)

    model = LlamaForCausalLM(LlamaConfig(**cfg.hf_config()))
    bf16 = cfg.dtype == "bfloat16"
    with tempfile.TemporaryDirectory(prefix="bench-hf-") as tmp:
        args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=cfg.batch_size, max_steps=cfg.steps,
            learning_rate=cfg.learning_rate, lr_scheduler_type="constant", adam_beta1=0.9, adam_beta2=0.95,
            adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch",
            logging_steps=cfg.window, save_strategy="no", report_to=[], use_cpu=True, bf16=bf16,
            torch_compile=compiled, dataloader_num_workers=0, disable_tqdm=True, seed=cfg.seed,
        )
        trainer = Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[Clock()])
        result = trainer.train()
        clock.finish(out, final_loss=result.training_loss, torch=torch.__version__,
                     transformers=transformers.__version__, threads=torch.get_num_threads(),
                     attn_implementation=model.config._attn_implementation)


if __name__ == "__main__":
    main()
