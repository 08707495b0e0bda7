"""Load a model from a training checkpoint, and export it as a Hugging Face folder.

The checkpoint's metadata carries the model config and the arguments, so the
exact model structure is rebuilt before the restore; nothing else about the original
run (its data, its recipe file) needs to exist. Only the parameters are read
(:meth:`~scaletrain.training.checkpoint.Checkpointer.restore_params`): the optimizer
state, twice the parameters' bytes with AdamW, is never built or read, so a model whose
parameters fit on a device exports from it.
"""

from __future__ import annotations

import os
from typing import Any

from scaletrain.config_keys import InvalidConfig
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

    A full model's parameters are restored into an abstract target (shapes, dtypes
    and shardings, nothing allocated), so the device holds the checkpoint's parameters
    once, never a freshly initialised copy beside them, and never the optimizer state
    saved with them. A LoRA checkpoint holds only the adapters: its frozen base is
    built (read from ``lora.base_model``, or initialised from the config, which its
    digest then checks) and the small adapters restored over it.
    """
    from scaletrain.arguments import TrainingArguments
    from scaletrain.models import get_modules_by_type
    from scaletrain.peft.lora import join_trainable
    from scaletrain.training.checkpoint import Checkpointer, resolve_checkpoint
    from scaletrain.training.lora_state import base_record, check_lora_base

    directory, latest = resolve_checkpoint(path)
    step = latest if step is None else step
    checkpointer = Checkpointer(directory)
    try:
        if step not in checkpointer.all_steps():
            raise CheckpointError(f"no complete checkpoint for step {step} in {directory}; "
                                  f"available: {checkpointer.all_steps()}")
        meta = checkpointer.read_meta(step)
        config_dict = dict(meta["config"])
        config_class, module_class = get_modules_by_type(config_dict.get("model_type", "llama"), _task(meta))
        try:
            config = config_class.from_dict({**config_dict, **(config_overrides or {})})
            args = TrainingArguments(**meta["arguments"])
        except InvalidConfig as err:  # saved before a check that now refuses it (a window of 0 tokens)
            raise CheckpointError(f"checkpoint {checkpointer.path(step)}: its saved configuration is not valid: "
                                  f"{err}") from None
        dtype = dtype if dtype is not None else args.dtype
        param_dtype = param_dtype if param_dtype is not None else args.param_dtype
        if args.lora is None:
            graphdef, params, frozen = _abstract_model(module_class, config, dtype, param_dtype, precision)
        else:
            graphdef, params, frozen = _lora_model(module_class, config, args, dtype, param_dtype, precision)
        check_lora_base(meta.get("lora"), base_record(join_trainable(graphdef, params, frozen), frozen),
                        checkpointer.path(step))
        value_head = _has_value_head(meta)
        if value_head:  # PPO: the value head is read with the policy, then left out of the policy
            params = {**params, **value_head_shapes(params, config.hidden_size)}
        params = checkpointer.restore_params(step, params)
        if value_head:  # a reward model's own `score` is its head, not a value head: it stays
            params.pop(VALUE_HEAD, None)
    finally:
        checkpointer.close()
    return join_trainable(graphdef, params, frozen), meta


VALUE_HEAD = "score"


def value_head_shapes(params: Any, hidden_size: int) -> dict[str, Any]:
    """``{"score": {"kernel": [hidden, 1]}}`` as a ``ShapeDtypeStruct``, replicated on the mesh of ``params``
    (``models/common/score_head.attach_value_head`` places it so), to restore a PPO checkpoint's value head."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    leaf = jax.tree.leaves(params)[0]
    sharding = NamedSharding(leaf.sharding.mesh, PartitionSpec())
    return {VALUE_HEAD: {"kernel": jax.ShapeDtypeStruct((hidden_size, 1), leaf.dtype, sharding=sharding)}}


def _abstract_model(module_class: type, config: Any, dtype: Any, param_dtype: Any,
                    precision: Any) -> tuple[Any, Any, None]:
    """``(graphdef, params, None)`` of a full model, ``params`` as ``ShapeDtypeStruct`` leaves with their
    shardings: nothing is initialised."""
    from scaletrain.models.factory import abstract_sharded_model, mesh_for_config

    graphdef, params = abstract_sharded_model(module_class, config, dtype=dtype, param_dtype=param_dtype,
                                              precision=precision, mesh=mesh_for_config(config))
    return graphdef, params, None


def _lora_model(module_class: type, config: Any, args: Any, dtype: Any, param_dtype: Any,
                precision: Any) -> tuple[Any, Any, Any]:
    """``(graphdef, adapters, frozen base)`` of a LoRA run: the real base (not in the checkpoint) and fresh
    adapters to restore over, split as the run's TrainState splits them."""
    from scaletrain.models import create_sharded_model
    from scaletrain.peft.lora import split_trainable
    from scaletrain.models.registry import AutoModelForCausalLM
    from scaletrain.training.lora_state import with_lora

    if args.lora.base_model and os.path.isdir(args.lora.base_model):
        model = AutoModelForCausalLM.from_pretrained(args.lora.base_model, dtype=dtype, param_dtype=param_dtype,
                                                     sharding_axis_dims=config.sharding_axis_dims,
                                                     partition_axis=config.partition_axis, precision=precision,
                                                     scan_layers=getattr(config, "scan_layers", False))
    else:  # a base trained from scratch is rebuilt from its config (its digest says whether that is it)
        model, _ = create_sharded_model(module_class, config, dtype=dtype, param_dtype=param_dtype,
                                        precision=precision)
    # the checkpoint holds the adapters: not the ones an init_from folder has
    model = with_lora(model, args.lora.model_copy(update={"init_from": None}))
    return split_trainable(model)


#: what a folder that holds a tokenizer has (``save_pretrained`` writes both; either one loads)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def tokenizer_for(meta: dict[str, Any]) -> Any | None:
    """The tokenizer the run used, when its recipe names one that still exists. A run from Python has no
    recipe: a LoRA run's base folder (``lora.base_model``, e.g. the ``model=`` folder of ``DPOTrainer``) then
    holds it, rather than the bundled tokenizer, which would not fit that model."""
    from scaletrain.data import load_processor, resolve_tokenizer_path

    recipe = meta.get("recipe") or {}
    path = (recipe.get("tokenizer") or {}).get("path")
    lora = (meta.get("arguments") or {}).get("lora") or {}
    base = lora.get("base_model")
    base = base if base and any(os.path.isfile(os.path.join(base, f)) for f in _TOKENIZER_FILES) else None
    pretrained = (recipe.get("model") or {}).get("pretrained") or base  # a base folder without one: as before
    path = resolve_tokenizer_path(path or pretrained or "bundled")
    return load_processor(path) if os.path.isdir(path) else None


def export_checkpoint(run_dir: str, out_dir: str, step: int | None = None, max_shard_size: str = "2GB",
                      merge: bool = False) -> str:
    """Write checkpoint ``step`` (default: newest) of ``run_dir`` as an HF folder ``out_dir``.

    A LoRA run's checkpoint is written as a PEFT adapter folder, or with ``merge`` as
    the full model with the adapters merged into its weights.
    """
    from scaletrain.models.hf import save_hf_checkpoint
    from scaletrain.peft.lora import lora_config_of, merge_lora
    from scaletrain.peft.adapter import save_peft_adapter

    model, meta = load_checkpoint_model(run_dir, step)
    if lora_config_of(model) is not None and not merge:
        return save_peft_adapter(model, out_dir)
    return save_hf_checkpoint(merge_lora(model), out_dir, tokenizer=tokenizer_for(meta), max_shard_size=max_shard_size)


def _has_value_head(meta: dict[str, Any]) -> bool:
    """Whether the checkpoint's objective trains a value head beside the policy (PPO's ``score``)."""
    from scaletrain.objectives.registry import get_objective_type, objective_types

    name = (meta.get("objective") or {}).get("name")
    return name in objective_types() and get_objective_type(name).value_head


def _task(meta: dict[str, Any]) -> str:
    """The task of the model a checkpoint holds: its objective's (a reward run's: the score-head model)."""
    from scaletrain.models.task import CAUSAL_LM
    from scaletrain.objectives.registry import get_objective_type, objective_types

    name = (meta.get("objective") or {}).get("name")
    return get_objective_type(name).model_task if name in objective_types() else CAUSAL_LM
