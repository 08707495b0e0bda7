"""scaletrain's jitted train step for a given model and batch shape, outside the Trainer.

Used by ``bench/scaling.py``, ``bench/variant_ab.py`` and (with an abstract state)
``bench/aot.py``: they need the exact step the
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


MEMORY_FIELDS = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                 "generated_code_size_in_bytes")


def benchmark_optimizer(batch: int, seq: int, dtype: str, param_dtype: str) -> tuple[Any, Any]:
    """``(TrainingArguments, optax chain)`` of the benchmark steps: the Trainer's defaults, constant schedule."""
    import scaletrain as st
    from scaletrain.training.optim import make_optimizer, make_schedule

    args = st.TrainingArguments(max_training_steps=1000, num_train_epochs=None, scheduler="constant", dtype=dtype,
                                param_dtype=param_dtype, total_batch_size=batch, max_length=seq)
    return args, make_optimizer(args, make_schedule(args, 1000))


def jit_train_step(cfg: Any, tx: Any, state: Any, mesh: Any, args: Any, seq: int) -> tuple[Any, Any, int | None]:
    """``(jitted train step, batch sharding, loss chunk)`` for ``state`` (real or abstract) on ``mesh``,
    as ``Trainer.configure_functions`` builds them."""
    from jax.sharding import NamedSharding, PartitionSpec

    from scaletrain.objectives import LanguageModelObjective
    from scaletrain.objectives.loss import resolve_chunk_size
    from scaletrain.training.state import state_shardings
    from scaletrain.training.steps import make_step_functions

    bs = NamedSharding(mesh, PartitionSpec(*args.step_partition_spec))
    chunk = resolve_chunk_size("auto", cfg.vocab_size, seq)
    train, _ = make_step_functions(tx, state_shardings(state), bs, NamedSharding(mesh, PartitionSpec()),
                                   LanguageModelObjective(chunk_size=chunk))
    return train, bs, chunk


def memory_of(compiled: Any) -> dict[str, int]:
    """XLA's compile-time memory analysis of ``compiled`` (per device), in bytes (0 where it has none)."""
    analysis = compiled.memory_analysis()
    return {k: int(getattr(analysis, k, 0) or 0) for k in MEMORY_FIELDS}


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

    from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
    from scaletrain.training.state import create_train_state

    cfg = LlamaConfig(**model_kwargs)
    model, mesh = create_sharded_model(LlamaForCausalLM, cfg, dtype=dtype, param_dtype=param_dtype, seed=seed)
    args, tx = benchmark_optimizer(batch, seq, dtype, param_dtype)
    holder: dict[str, Any] = {"state": create_train_state(model, tx, mesh, seed=seed)}
    train, bs, _ = jit_train_step(cfg, tx, holder["state"], mesh, args, seq)
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, seq), dtype=np.int32)
    batch = {"input_ids": ids} if tokens_only else {
        "input_ids": ids, "segment_ids": np.ones_like(ids),
        "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), ids.shape).copy()}
    data = jax.device_put(batch, bs)
    with jax.set_mesh(mesh):
        compiled = train.lower(holder["state"], data).compile(compiler_options)
    memory = memory_of(compiled)

    def run() -> Any:
        with jax.set_mesh(mesh):
            holder["state"], metrics = compiled(holder["state"], data)
        return metrics["loss"]

    return CompiledStep(run, memory, holder["state"].num_params, cfg.flops_per_token(seq))
