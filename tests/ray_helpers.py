"""Shared pieces of the Ray tests; pickled *by value* into Ray workers (tests/ is not importable there)."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import scaletrain as st
from scaletrain.models import LlamaForCausalLM


def lm_data(n: int = 64, vocab: int = 128, seed: int = 0) -> list[dict]:
    """Rows that count upward from a random start: learnable in a few steps."""
    rng = np.random.default_rng(seed)
    return [{"input_ids": (rng.integers(0, vocab) + np.arange(rng.integers(8, 24))) % vocab} for _ in range(n)]


def tiny_trainer(tokenizer_dir: str):
    from scaletrain.distributed import RayDistributedTrainer

    return RayDistributedTrainer(
        tokenizer_dir,
        model_class=LlamaForCausalLM,
        config_scaling_variables={"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2,
                                  "num_key_value_heads": 1},
        config_variables={"dtype": jnp.float32, "param_dtype": jnp.float32, "attn_dtype": jnp.float32,
                          "attn_softmax_dtype": jnp.float32, "num_hidden_layers": 2, "vocab_size": 128,
                          "max_position_embeddings": 64, "seed": 3},
    )


def tiny_arguments(output_dir: str, **kw) -> st.TrainingArguments:
    defaults = dict(output_dir=output_dir, total_batch_size=8, max_length=16, num_train_epochs=None,
                    max_training_steps=8, learning_rate=1e-2, warmup_steps=2, log_steps=1, save_steps=2,
                    progress_bar=False, report_to=(), do_eval=True)
    return st.TrainingArguments(**{**defaults, **kw})


class RecordPlacement(st.Callback):
    """Write, per process, how the parameters are placed (checked by the test on the driver)."""

    def __init__(self, folder: str):
        self.folder = folder

    def post_init(self, trainer) -> None:
        leaves = jax.tree.leaves(trainer.model_state.params)
        record = {
            "process_index": jax.process_index(),
            "process_count": jax.process_count(),
            "local_devices": jax.local_device_count(),
            "global_devices": jax.device_count(),
            "mesh_processes": sorted({d.process_index for d in trainer.mesh.devices.flat}),
            "fully_addressable": [bool(x.is_fully_addressable) for x in leaves],
            "sharded": [not x.sharding.is_fully_replicated for x in leaves],
        }
        with open(os.path.join(self.folder, f"placement-{jax.process_index()}.json"), "w") as f:
            json.dump(record, f)
