"""scaletrain's jitted train step for a given model and batch shape, outside the Trainer.

Used by ``bench/scaling.py``: it needs the exact step the
Trainer compiles (same optimizer chain, shardings, donation) without its data loader
and callbacks, so compile-time memory analysis and step timing are of the real thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class CompiledStep:
    """``run()`` does one step (state kept inside); ``memory`` is XLA's compile-time analysis."""

    run: Callable[[], Any]
    memory: dict[str, int]
    num_params: int
    flops_per_token: float


def scaletrain_step(model_kwargs: dict[str, Any], batch: int, seq: int, dtype: str = "float32",
                    param_dtype: str = "float32", seed: int = 0,
                    compiler_options: dict[str, Any] | None = None, tokens_only: bool = False) -> CompiledStep:
    """Build model, optimizer state and the jitted step exactly as ``Trainer.configure_*`` do.

    ``compiler_options`` are XLA debug options for this one compilation (e.g.
    ``{"xla_cpu_enable_fast_math": True}``), so flags can be compared within one process.
    ``tokens_only``: the batch is ``input_ids`` alone, as the loader gives it for rows that
    are each one unpadded sequence; else with segment ids (of ones) and positions.
    """
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    import scaletrain as st
    from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
    from scaletrain.training.loss import resolve_chunk_size
    from scaletrain.training.optim import make_optimizer, make_schedule
    from scaletrain.training.state import create_train_state, state_shardings
    from scaletrain.training.steps import make_step_functions

    cfg = LlamaConfig(**model_kwargs)
    model, mesh = create_sharded_model(LlamaForCausalLM, cfg, dtype=dtype, param_dtype=param_dtype, seed=seed)
    args = st.TrainingArguments(max_training_steps=1000, num_train_epochs=None, scheduler="constant", dtype=dtype,
                                param_dtype=param_dtype, total_batch_size=batch, max_length=seq)
    tx = make_optimizer(args, make_schedule(args, 1000))
    holder: dict[str, Any] = {"state": create_train_state(model, tx, mesh, seed=seed)}
    bs = NamedSharding(mesh, PartitionSpec(*args.step_partition_spec))
    train, _ = make_step_functions(tx, state_shardings(holder["state"]), bs, NamedSharding(mesh, PartitionSpec()),
                                   1, 0.0, loss_chunk_size=resolve_chunk_size("auto", cfg.vocab_size, seq))
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, seq), dtype=np.int32)
    batch = {"input_ids": ids} if tokens_only else {
        "input_ids": ids, "segment_ids": np.ones_like(ids),
        "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), ids.shape).copy()}
    data = jax.device_put(batch, bs)
    with jax.set_mesh(mesh):
        compiled = train.lower(holder["state"], data).compile(compiler_options)
    analysis = compiled.memory_analysis()
    memory = {k: int(getattr(analysis, k, 0) or 0) for k in
              ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
               "generated_code_size_in_bytes")} if analysis is not None else {}

    def run() -> Any:
        with jax.set_mesh(mesh):
            holder["state"], metrics = compiled(holder["state"], data)
        return metrics["loss"]

    return CompiledStep(run, memory, holder["state"].num_params, cfg.flops_per_token(seq))
