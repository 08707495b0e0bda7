"""Run a recipe end to end in this process: tokenizer -> data -> model -> Trainer -> sample.

``scaletrain train RECIPE`` reaches :func:`run_training` through
:func:`scaletrain.distributed.launcher.run_recipe`, which decides between this process
and Ray; this module never imports :mod:`scaletrain.distributed` (it is what the Ray
workers run). It holds no training logic of its own, only the wiring from recipe
sections to library objects.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from scaletrain.compile_cache import enable_compilation_cache
from scaletrain.errors import ConfigError, DataError
from scaletrain.recipe import Recipe

logger = logging.getLogger("scaletrain")


def load_datasets(recipe: Recipe, tokenizer: Any) -> Any:
    """Packed train/eval rows for ``data`` (pre-training text or chat), see scaletrain.data.build."""
    from scaletrain.data.build import build_datasets

    args = recipe.training
    splits = build_datasets(recipe.data, tokenizer, max_length=args.max_length, seed=args.seed,
                            truncation_mode=args.truncation_mode)
    logger.info("data: %s", json.dumps(splits.stats, default=float))
    with open(os.path.join(args.ensure_output_dir(), "data_stats.json"), "w") as f:
        json.dump(splits.stats, f, indent=2, sort_keys=True, default=float)
    return splits


def tokenizer_path(recipe: Recipe) -> str:
    """``tokenizer.path`` as a folder (``bundled``, ``prepared:NAME`` or a path); unset means the
    pretrained model's folder, else the bundled tokenizer."""
    from scaletrain.data.prepared import resolve_tokenizer_path

    return resolve_tokenizer_path(recipe.tokenizer.path or recipe.model.pretrained or "bundled")


def load_tokenizer(recipe: Recipe) -> Any:
    from scaletrain.data import load_processor

    return load_processor(tokenizer_path(recipe))


def build_model(recipe: Recipe, tokenizer: Any) -> Any:
    """A new model from ``model`` keys, sized to the tokenizer, sharded on the recipe's mesh."""
    from scaletrain.models import create_sharded_model, get_modules_by_type

    if recipe.model.pretrained:
        return load_pretrained(recipe, tokenizer)
    config_class, module_class = get_modules_by_type(recipe.model.type)
    keys = dict(recipe.model.config_overrides)
    vocab = len(tokenizer)
    keys.setdefault("vocab_size", -(-vocab // 128) * 128)
    keys.setdefault("max_position_embeddings", recipe.training.max_length)
    if tokenizer.eos_token_id is not None:
        keys.setdefault("eos_token_id", tokenizer.eos_token_id)
        keys.setdefault("bos_token_id", tokenizer.bos_token_id)
    if tokenizer.pad_token_id is not None:
        keys.setdefault("pad_token_id", tokenizer.pad_token_id)
    config = config_class(
        **keys,
        sharding_axis_dims=recipe.mesh.axis_dims,
        sharding_axis_names=recipe.mesh.axis_names,
        partition_axis=recipe.mesh.partition_axis,
    )
    check_vocab(tokenizer, config.vocab_size, recipe)
    model, _ = create_sharded_model(
        module_class, config, dtype=recipe.training.dtype, param_dtype=recipe.training.param_dtype,
        seed=recipe.training.seed,
    )
    return model


def check_vocab(tokenizer: Any, vocab_size: int, recipe: Recipe) -> None:
    """A tokenizer with more ids than the embedding table would index past it."""
    if len(tokenizer) > vocab_size:
        name = recipe.tokenizer.path or recipe.model.pretrained or "bundled"
        raise DataError(
            f"tokenizer {name!r} has {len(tokenizer)} tokens but model.vocab_size is "
            f"{vocab_size}; raise model.vocab_size or use another tokenizer"
        )


def load_pretrained(recipe: Recipe, tokenizer: Any) -> Any:
    """The local Hugging Face model of ``model.pretrained``, sharded on the recipe's mesh.

    Keys under ``model`` other than ``type``/``pretrained`` may only change runtime
    options (remat, attention softmax dtype); architecture keys come from the folder.
    """
    from scaletrain.models.config import RUNTIME_KEYS
    from scaletrain.models.registry import AutoModelForCausalLM

    extra = set(recipe.model.config_overrides) - set(RUNTIME_KEYS)
    if extra:
        raise ConfigError(f"model.{sorted(extra)[0]}: architecture keys cannot be changed for a pretrained model "
                          f"({recipe.model.pretrained}); only {sorted(RUNTIME_KEYS)} may be set")
    model = AutoModelForCausalLM.from_pretrained(
        recipe.model.pretrained,
        dtype=recipe.training.dtype,
        param_dtype=recipe.training.param_dtype,
        sharding_axis_dims=recipe.mesh.axis_dims,
        partition_axis=recipe.mesh.partition_axis,
    )
    for key, value in recipe.model.config_overrides.items():
        setattr(model.config, key, value)
    check_vocab(tokenizer, model.config.vocab_size, recipe)
    return model


def run_training(recipe: Recipe, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Train as the recipe says, in this process; returns the summary written to ``summary.json``."""
    import jax

    from scaletrain.training.outputs import write_summary
    from scaletrain.training.trainer import Trainer

    args = recipe.training
    enable_compilation_cache(args.compilation_cache_dir)  # before the model's initialiser compiles
    out = args.ensure_output_dir()
    if jax.process_index() == 0:
        with open(os.path.join(out, "recipe.yaml"), "w") as f:
            f.write(recipe.to_yaml())
    tokenizer = load_tokenizer(recipe)
    splits = load_datasets(recipe, tokenizer)
    model = build_model(recipe, tokenizer)
    has_eval = len(splits.eval) > 0
    trainer = Trainer(
        arguments=args,
        model=model,
        dataset_train=splits.train,
        dataset_eval=splits.eval if has_eval else None,
        eval_bytes_per_token=splits.eval_bytes_per_token if has_eval and splits.eval_bytes_per_token > 0 else None,
        tokenizer=tokenizer,
        callbacks=callbacks,
    )
    trainer.recipe = recipe.to_dict()
    output = trainer.train()
    summary = dict(trainer.summary)
    if recipe.sample.max_new_tokens > 0 and jax.process_count() > 1:
        logger.warning("sample.max_new_tokens is ignored in a multi-process run; use `scaletrain generate` "
                       "on the exported model")
    elif recipe.sample.max_new_tokens > 0 and trainer.is_main_process:
        text = sample_text(output.state.model, tokenizer, recipe)
        summary["sample"] = text
        with open(os.path.join(out, "sample.txt"), "w") as f:
            f.write(text)
        write_summary(out, summary)  # the trainer's file, now with the sample (same atomic writer)
    return summary


def sample_text(model: Any, tokenizer: Any, recipe: Recipe) -> str:
    """Continue ``sample.prompt`` with the trained model."""
    import jax

    from scaletrain.generation import generate

    s = recipe.sample
    ids = tokenizer(s.prompt)["input_ids"] or [tokenizer.eos_token_id]
    with jax.set_mesh(jax.tree.leaves(model)[0].sharding.mesh):
        new = generate(model, [ids], max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                       top_k=s.top_k, top_p=s.top_p, seed=s.seed)
    return s.prompt + tokenizer.decode(new[0].tolist(), skip_special_tokens=True)
