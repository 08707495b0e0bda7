"""Contender: ``scaletrain.Trainer`` exactly as a user runs it.

Default callbacks stay on (metrics JSONL, stopping rules); only what a benchmark has
no use for is off: evaluation, TensorBoard, the progress bar and the final
checkpoint. ``log_steps`` equals the benchmark window, so the trainer's own metric
fetch is the only host sync, and the clock callback reads the time right after it.
Like the ``scaletrain`` CLI, it restarts itself with glibc's huge-page tunable
(``scaletrain.host_memory``), as the docs tell script users to do.
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# appended, not prepended: PYTHONPATH (set by run.py, e.g. to a baseline checkout) wins
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from common import StepClock, contender_args  # noqa: E402


def main() -> None:
    cfg, tokens_path, out = contender_args()
    clock = StepClock("scaletrain", cfg)
    import jax
    import numpy as np

    import scaletrain as st
    from scaletrain.data.packing import PackedRows
    from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model

    tokens = np.load(tokens_path)

    class Clock(st.Callback):
        def post_step(self, trainer, step, metrics):  # type: ignore[override]
            if clock.wants(step):
                jax.block_until_ready(metrics.device("loss"))
                clock.mark(step)

    rows = PackedRows(tokens, np.ones_like(tokens), np.broadcast_to(np.arange(cfg.seq_len, dtype=np.int32),
                                                                    tokens.shape).copy())
    mcfg = LlamaConfig(**cfg.hf_config())
    model, _ = create_sharded_model(LlamaForCausalLM, mcfg, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                                    seed=cfg.seed)
    with tempfile.TemporaryDirectory(prefix="bench-scaletrain-") as tmp:
        args = st.TrainingArguments(
            output_dir=tmp, total_batch_size=cfg.batch_size, max_length=cfg.seq_len, num_train_epochs=None,
            max_training_steps=cfg.steps, learning_rate=cfg.learning_rate, scheduler="constant",
            dtype=cfg.dtype, param_dtype=cfg.param_dtype, do_eval=False, log_steps=cfg.window,
            progress_bar=False, report_to=(), save_at_end=False, seed=cfg.seed,
        )
        trainer = st.Trainer(args, model=model, dataset_train=rows, callbacks=[Clock()])
        trainer.train()
        clock.finish(out, final_loss=trainer.metrics_logger.last_train.get("loss"),
                     devices=jax.device_count(), backend=jax.default_backend(), scaletrain_file=st.__file__)


if __name__ == "__main__":
    try:
        from scaletrain.host_memory import reexec_with_hugepages
    except ImportError:  # a baseline checkout from before it existed
        pass
    else:
        reexec_with_hugepages()
    main()
