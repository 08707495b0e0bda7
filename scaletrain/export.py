"""Load a model from a training checkpoint, and export it as a Hugging Face folder.

The checkpoint's metadata carries the model config and the arguments, so the
exact model and optimizer structure are rebuilt before the restore; nothing else
about the original run (its data, its recipe file) needs to exist.
"""

from __future__ import annotations

import os
from typing import Any

from scaletrain.errors import CheckpointError


def load_checkpoint_model(
    path: str,
    step: int | None = None,
    *,
    config_overrides: dict[str, Any] | None = None,
    dtype: Any = None,
    param_dtype: Any = None,
    precision: Any = None,
) -> tuple[Any, dict[str, Any]]:
    """``(model, metadata)`` from a run folder, its ``checkpoints`` folder or one step folder.

    ``config_overrides`` replaces runtime keys of the saved config (mesh axes,
    partition axis, remat) so a checkpoint loads onto another mesh; ``dtype`` /
    ``param_dtype`` default to the saved run's.

    A full model is restored into an abstract target (shapes, dtypes and shardings,
    nothing allocated), so the device holds the checkpoint's arrays once, never a
    freshly initialised copy beside them. A LoRA checkpoint holds only the adapters:
    its frozen base is built (read from ``lora.base_model``, or initialised from the
    config, which its digest then checks) and the small adapters restored over it.
    """
    from scaletrain.arguments import TrainingArguments
    from scaletrain.models import get_modules_by_type
    from scaletrain.training.checkpoint import Checkpointer, resolve_checkpoint
    from scaletrain.training.lora_state import base_record, check_lora_base
    from scaletrain.training.optim import make_optimizer, make_schedule

    directory, latest = resolve_checkpoint(path)
    step = latest if step is None else step
    checkpointer = Checkpointer(directory)
    try:
        if step not in checkpointer.all_steps():
            raise CheckpointError(f"no complete checkpoint for step {step} in {directory}; "
                                  f"available: {checkpointer.all_steps()}")
        meta = checkpointer.read_meta(step)
        config_dict = dict(meta["config"])
        config_class, module_class = get_modules_by_type(config_dict.get("model_type", "llama"))
        config = config_class.from_dict({**config_dict, **(config_overrides or {})})
        args = TrainingArguments(**meta["arguments"])
        dtype = dtype if dtype is not None else args.dtype
        param_dtype = param_dtype if param_dtype is not None else args.param_dtype
        tx = make_optimizer(args, make_schedule(args, max(args.max_training_steps or 1, 1)))
        if args.lora is None:
            template = _abstract_template(module_class, config, tx, dtype, param_dtype, precision)
        else:
            template = _lora_template(module_class, config, args, tx, dtype, param_dtype, precision)
        check_lora_base(meta.get("lora"), base_record(template.model, template.frozen), checkpointer.path(step))
        state, _, _ = checkpointer.restore(step, template)
    finally:
        checkpointer.close()
    return state.model, meta


def _abstract_template(module_class: type, config: Any, tx: Any, dtype: Any, param_dtype: Any,
                       precision: Any) -> Any:
    """The TrainState of a full model as ``ShapeDtypeStruct`` leaves with their shardings: nothing is initialised."""
    from scaletrain.models.factory import abstract_sharded_model, mesh_for_config
    from scaletrain.training.state import abstract_train_state

    mesh = mesh_for_config(config)
    graphdef, params = abstract_sharded_model(module_class, config, dtype=dtype, param_dtype=param_dtype,
                                              precision=precision, mesh=mesh)
    return abstract_train_state(graphdef, params, tx, mesh)


def _lora_template(module_class: type, config: Any, args: Any, tx: Any, dtype: Any, param_dtype: Any,
                   precision: Any) -> Any:
    """A LoRA run's TrainState: the real frozen base (not in the checkpoint) and fresh adapters to restore over."""
    import jax
    from flax import nnx

    from scaletrain.models import create_sharded_model
    from scaletrain.models.registry import AutoModelForCausalLM
    from scaletrain.training.lora_state import with_lora
    from scaletrain.training.state import create_train_state

    if args.lora.base_model and os.path.isdir(args.lora.base_model):
        model = AutoModelForCausalLM.from_pretrained(args.lora.base_model, dtype=dtype, param_dtype=param_dtype,
                                                     sharding_axis_dims=config.sharding_axis_dims,
                                                     partition_axis=config.partition_axis, precision=precision,
                                                     scan_layers=getattr(config, "scan_layers", False))
        mesh = jax.tree.leaves(nnx.state(model))[0].sharding.mesh
    else:  # a base trained from scratch is rebuilt from its config (its digest says whether that is it)
        model, mesh = create_sharded_model(module_class, config, dtype=dtype, param_dtype=param_dtype,
                                           precision=precision)
    # the checkpoint holds the adapters: not the ones an init_from folder has
    model = with_lora(model, args.lora.model_copy(update={"init_from": None}))
    return create_train_state(model, tx, mesh, seed=args.seed)


def tokenizer_for(meta: dict[str, Any]) -> Any | None:
    """The tokenizer the run used, when its recipe names one that still exists."""
    from scaletrain.data import load_processor, resolve_tokenizer_path

    recipe = meta.get("recipe") or {}
    path = (recipe.get("tokenizer") or {}).get("path")
    pretrained = (recipe.get("model") or {}).get("pretrained")
    path = resolve_tokenizer_path(path or pretrained or "bundled")
    return load_processor(path) if os.path.isdir(path) else None


def export_checkpoint(run_dir: str, out_dir: str, step: int | None = None, max_shard_size: str = "2GB",
                      merge: bool = False) -> str:
    """Write checkpoint ``step`` (default: newest) of ``run_dir`` as an HF folder ``out_dir``.

    A LoRA run's checkpoint is written as a PEFT adapter folder, or with ``merge`` as
    the full model with the adapters merged into its weights.
    """
    from scaletrain.models.hf import save_hf_checkpoint
    from scaletrain.models.lora import lora_config_of, merge_lora
    from scaletrain.models.peft_adapter import save_peft_adapter

    model, meta = load_checkpoint_model(run_dir, step)
    if lora_config_of(model) is not None and not merge:
        return save_peft_adapter(model, out_dir)
    return save_hf_checkpoint(merge_lora(model), out_dir, tokenizer=tokenizer_for(meta), max_shard_size=max_shard_size)
