"""Checks a recipe can pass before any data is read: all of them, reported together.

Why a pass of its own: tokenizing a large source takes minutes, and each of these
problems (a model folder without a usable config.json, a mesh the batch does not fit,
LoRA targets the model does not have, sequences longer than its positions, a run
already in ``output_dir`` that this recipe cannot continue) is known from the recipe,
the tokenizer and a few small files. Finding them one per start, each after
tokenizing, costs a user one long wait per mistake. The checks deeper in the stack
(the trainer's, the checkpoint restore's) stay: they guard the Python API too.
"""

from __future__ import annotations

import os
from typing import Any

from scaletrain.errors import ScaletrainError
from scaletrain.recipe import Recipe

#: config keys that fix the shapes of a model's parameters: a checkpoint saved with others cannot be resumed
ARCHITECTURE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
                     "num_experts", "num_local_experts", "moe_intermediate_size", "attention_bias", "mlp_bias",
                     "qk_norm")
#: LoRA settings that fix the adapters' shapes and meaning
LORA_KEYS = ("rank", "alpha", "rslora", "target_modules", "train_embeddings", "train_norms", "quantize")


class PreflightError(ScaletrainError):
    """Every problem the recipe has before its data is read, one per line."""


def problems_before_data(recipe: Recipe, config: Any, module_class: type) -> list[str]:
    """Every problem found, one sentence each; ``config`` is the model's, as it will be built."""
    return [
        *mesh_problems(recipe, config),
        *position_problems(recipe, config),
        *lora_problems(recipe, config, module_class),
        *existing_run_problems(recipe, config),
        *reward_problems(recipe),
    ]


def raise_problems(problems: list[str | None]) -> None:
    """One :class:`PreflightError` listing each distinct problem (none: return)."""
    unique = list(dict.fromkeys(p for p in problems if p))
    if unique:
        head = "this recipe cannot start" + (f" ({len(unique)} problems)" if len(unique) > 1 else "")
        raise PreflightError(head + ":\n" + "\n".join(f"- {p}" for p in unique))


def mesh_problems(recipe: Recipe, config: Any) -> list[str]:
    """The mesh against the devices, the batch and sequence against the mesh, expert parallelism against the model."""
    import jax

    from scaletrain.parallel.mesh import resolve_axis_dims
    from scaletrain.parallel.partition import batch_problems

    try:
        dims = resolve_axis_dims(recipe.mesh.axis_dims, jax.device_count(), name="mesh.axis_dims")
    except ScaletrainError as err:
        return [str(err)]
    shape = dict(zip(recipe.mesh.axis_names, dims))
    a = recipe.training
    out = batch_problems(a.step_partition_spec, shape, total_batch_size=a.total_batch_size, max_length=a.max_length)
    experts = getattr(config, "num_experts", None)
    ep = shape.get("ep", 1)
    if ep > 1 and not experts:  # its devices would each compute the same replica: refused, not wasted
        out.append(f"mesh.axis_dims={list(recipe.mesh.axis_dims)} puts {ep} devices on ep (expert parallelism), but "
                   f"{config.model_type} has no experts; put them on fsdp or dp instead")
    sp = shape.get("sp", 1)
    if sp > 1 and "linear_attention" in (getattr(config, "layer_types", None) or ()):
        # the recurrence runs along the whole sequence; passing its state across sequence shards is not built
        out.append(f"mesh.axis_dims={list(recipe.mesh.axis_dims)} splits each sequence over sp={sp}, but "
                   f"{config.model_type}'s linear-attention layers (Gated DeltaNet) need whole sequences; set sp to 1 "
                   "and put the devices on fsdp or dp")
    return out


def position_problems(recipe: Recipe, config: Any) -> list[str]:
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and recipe.training.max_length > positions:
        return [f"training.max_length={recipe.training.max_length} is longer than the model's "
                f"max_position_embeddings={positions}; lower training.max_length"]
    return []


def lora_problems(recipe: Recipe, config: Any, module_class: type) -> list[str]:
    """LoRA targets against the model's linear layers, found on an abstract model (no arrays made)."""
    lora = recipe.lora
    if lora is None:
        return []
    from scaletrain.models.factory import abstract_model
    from scaletrain.peft.lora import target_paths

    try:
        target_paths(abstract_model(module_class, config), lora)
    except ScaletrainError as err:
        return [str(err)]
    return []


def existing_run_problems(recipe: Recipe, config: Any) -> list[str]:
    """A run already in ``output_dir`` (or ``resume_from``): refused unless resumed, and resumed only if it fits."""
    from scaletrain.training.checkpoint import (
        CHECKPOINT_DIR,
        read_meta,
        refuse_start_over,
        resolve_checkpoint,
        step_folders,
    )

    args = recipe.training
    if args.resume_from:
        try:
            directory, step = resolve_checkpoint(args.resume_from)
        except ScaletrainError as err:
            return [f"training.resume_from: {err}"]
    else:
        directory = os.path.join(args.output_dir, CHECKPOINT_DIR)
        steps = step_folders(directory)
        if not steps:
            return []
        if not args.resume_if_possible:
            try:
                refuse_start_over(directory, steps)
            except ScaletrainError as err:
                return [str(err)]
        step = steps[-1]
    where = os.path.join(directory, str(step))
    try:
        meta = read_meta(where)
    except ScaletrainError:  # unreadable: the restore itself says so, naming the earlier checkpoints
        return []
    if not isinstance(meta, dict):
        return []
    return [*_config_differences(where, meta.get("config") or {}, config.to_dict()),
            *_lora_differences(where, (meta.get("arguments") or {}).get("lora"), recipe.lora)]


def _config_differences(where: str, saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    diffs = [f"model.{k}={now[k]!r} (saved: {saved[k]!r})" for k in ARCHITECTURE_KEYS
             if k in saved and k in now and saved[k] != now[k]]
    if not diffs:
        return []
    return [f"checkpoint {where} was saved from another model: {', '.join(diffs)}; use the saved values to "
            "resume it, or choose a new training.output_dir"]


def _lora_differences(where: str, saved: dict[str, Any] | None, lora: Any) -> list[str]:
    if saved is None and lora is None:
        return []
    if saved is None or lora is None:
        has = "with" if saved is not None else "without"
        return [f"checkpoint {where} was saved {has} LoRA adapters and this recipe "
                f"{'has no' if lora is None else 'has a'} lora section; match the saved run to resume it, "
                "or choose a new training.output_dir"]
    now = lora.model_dump(mode="json")
    diffs = [f"lora.{k}={_plain(now.get(k))!r} (saved: {_plain(saved.get(k))!r})" for k in LORA_KEYS
             if k in saved and _plain(saved.get(k)) != _plain(now.get(k))]
    if not diffs:
        return []
    return [f"checkpoint {where} holds adapters of other LoRA settings: {', '.join(diffs)}; set the saved values "
            "to resume it, or choose a new training.output_dir"]


def _plain(value: Any) -> Any:
    """Lists and tuples compare alike (JSON keeps lists, the config tuples)."""
    return list(value) if isinstance(value, (list, tuple)) else value


def reward_problems(recipe: Recipe) -> list[str]:
    """GRPO's ``reward_funcs``, each imported (from the recipe's folder, the working directory, then ``sys.path``):
    a misspelt module or function is known in a second, not after the prompts are tokenized."""
    if recipe.objective.type != "grpo":
        return []
    from scaletrain.rl.rewards import load_rewards

    options = recipe.objective.options
    if not options.get("reward_funcs") and options.get("environment_factory") is not None:
        return []  # the environment may be the reward (get_reward, a multi-turn one's step rewards): the trainer checks
    try:
        load_rewards(options.get("reward_funcs") or [], options.get("reward_weights"),
                     folders=[recipe.folder] if recipe.folder else [], field="objective.reward_funcs")
    except ScaletrainError as err:
        return [str(err)]
    return []
