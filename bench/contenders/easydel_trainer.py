"""Contender: EasyDeL's ``Trainer`` (pinned version, in its own venv).

Settings chosen to match the others and to keep EasyDeL from doing extra work a
benchmark does not want: float32 parameters and the benchmark's compute dtype,
attention *and* its softmax in that dtype (EasyDeL otherwise computes attention in
bf16), AdamW b1=0.9 b2=0.95 clip 1.0, constant learning rate, no wandb, no
checkpoint, no evaluation, no shuffling. EasyDeL blocks on every step itself
(``jax.block_until_ready`` in ``_execute_train_step``), so ``on_step_end`` sees a
finished step and the clock needs no extra sync.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import StepClock, contender_args  # noqa: E402


def main() -> None:
    cfg, tokens_path, out = contender_args()
    clock = StepClock("easydel", cfg)
    import tempfile

    import easydel as ed
    import jax
    import jax.numpy as jnp
    import numpy as np
    from datasets import Dataset
    from flax import nnx

    tokens = np.load(tokens_path)
    ds = Dataset.from_dict({"input_ids": tokens.tolist(), "attention_mask": np.ones_like(tokens).tolist()})
    dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    config = ed.LlamaConfig(**cfg.hf_config(), attn_dtype=dtype, attn_softmax_dtype=jnp.float32)
    model = ed.LlamaForCausalLM(config=config, dtype=dtype, param_dtype=param_dtype, precision=None,
                                rngs=nnx.Rngs(cfg.seed))

    class Timed(ed.Trainer):
        def on_step_end(self, state, metrics, step):  # type: ignore[override]
            if clock.wants(int(step)):
                clock.mark(int(step))
            return super().on_step_end(state=state, metrics=metrics, step=step)

    with tempfile.TemporaryDirectory(prefix="bench-easydel-") as tmp:
        args = ed.TrainingArguments(
            save_directory=tmp, model_name="bench", num_train_epochs=1, total_batch_size=cfg.batch_size,
            max_training_steps=cfg.steps, max_length=cfg.seq_len, learning_rate=cfg.learning_rate,
            optimizer=ed.EasyDeLOptimizers.ADAMW, scheduler=ed.EasyDeLSchedulers.NONE, clip_grad=1.0,
            weight_decay=0.0, warmup_steps=0, extra_optimizer_kwargs={"b1": 0.9, "b2": 0.95},
            do_last_save=False, save_steps=None, do_eval=False, use_wandb=False, report_metrics=False,
            log_steps=cfg.window, shuffle_train_dataset=False, track_memory=False, progress_bar_type="json",
            training_time_limit=None,
        )
        trainer = Timed(arguments=args, model=model, dataset_train=ds)
        output = trainer.train()
        state = getattr(output, "state", None)
        clock.finish(out, final_loss=None, easydel=ed.__version__, jax=jax.__version__,
                     steps_done=None if state is None else int(jax.device_get(state.step)))


if __name__ == "__main__":
    main()
