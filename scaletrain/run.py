"""Run a recipe end to end in this process: tokenizer -> data -> model -> Trainer -> sample.

``scaletrain train RECIPE`` reaches :func:`run_training` through
:func:`scaletrain.launch.run_recipe`, which picks the recipe's backend (this process,
or Ray workers that each call it); this module never imports :mod:`scaletrain.launch`
(it is what those workers run). It holds no training logic of its own, only the wiring
from recipe sections to library objects.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from scaletrain.compile_cache import enable_compilation_cache
from scaletrain.errors import ConfigError, DataError, ScaletrainError
from scaletrain.folders import write_atomic
from scaletrain.recipe import Recipe

logger = logging.getLogger("scaletrain")


def load_datasets(recipe: Recipe, tokenizer: Any) -> Any:
    """Packed train/eval rows for ``data`` (pre-training text or chat), see scaletrain.data.build.

    The stats are logged here and written to ``data_stats.json`` only when training starts
    (:func:`_run_files_writer`), so a start refused later leaves an earlier run's file as it was.
    """
    from scaletrain.data.build import build_datasets

    args = recipe.training
    splits = build_datasets(recipe.data, tokenizer, max_length=args.max_length, seed=args.seed,
                            truncation_mode=args.truncation_mode)
    logger.info("data: %s", json.dumps(splits.stats, default=float))
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
    from scaletrain.models import create_sharded_model

    if recipe.model.pretrained:
        return load_pretrained(recipe, tokenizer)
    config, module_class = new_model_config(recipe, tokenizer)
    check_vocab(tokenizer, config.vocab_size, recipe)
    model, _ = create_sharded_model(
        module_class, config, dtype=recipe.training.dtype, param_dtype=recipe.training.param_dtype,
        seed=recipe.training.seed,
    )
    return model


def model_config(recipe: Recipe, tokenizer: Any) -> tuple[Any, type]:
    """``(config, module class)`` of the model the recipe will train: a pretrained folder's (with the
    recipe's layout and runtime keys) or a new one's, sized to the tokenizer. Reads no weights."""
    from scaletrain.models.common.config import LAYOUT_KEYS, RUNTIME_KEYS
    from scaletrain.models.hf_config import load_hf_config
    from scaletrain.models.registry import get_modules_by_type

    if not recipe.model.pretrained:
        return new_model_config(recipe, tokenizer)
    config = load_hf_config(recipe.model.pretrained, sharding_axis_dims=recipe.mesh.axis_dims,
                            partition_axis=recipe.mesh.partition_axis)
    keys = {k: v for k, v in recipe.model.config_overrides.items() if k in (*LAYOUT_KEYS, *RUNTIME_KEYS)}
    config = config.model_copy(update=keys) if keys else config
    return config, get_modules_by_type(config.model_type, model_task(recipe))[1]


def model_task(recipe: Recipe) -> str:
    """The task of the model ``objective.type`` trains: a causal LM, or a score-head model (``reward``)."""
    from scaletrain.objectives.registry import get_objective_type

    return get_objective_type(recipe.objective.type).model_task


def new_model_config(recipe: Recipe, tokenizer: Any) -> tuple[Any, type]:
    from scaletrain.models import get_modules_by_type

    config_class, module_class = get_modules_by_type(recipe.model.type, model_task(recipe))
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
    return config, module_class


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
    options (remat, attention softmax dtype) and the layout (``scan_layers``, applied as the
    weights are read); architecture keys come from the folder
    (:func:`check_pretrained_keys`).
    """
    from scaletrain.models.common.config import LAYOUT_KEYS, RUNTIME_KEYS
    from scaletrain.models.registry import AutoModelForCausalLM, AutoModelForSequenceClassification
    from scaletrain.models.task import SEQUENCE_CLASSIFICATION

    check_pretrained_keys(recipe)
    if recipe.training.learning_rate > 1e-3:
        logger.warning("training.learning_rate=%g is a from-scratch rate: fine-tuning %s at it usually damages "
                       "the model; 1e-5..1e-4 is typical (see examples/chat_sft_smollm2.yaml)",
                       recipe.training.learning_rate, recipe.model.pretrained)
    auto = AutoModelForSequenceClassification if model_task(recipe) == SEQUENCE_CLASSIFICATION else \
        AutoModelForCausalLM
    model = auto.from_pretrained(
        recipe.model.pretrained,
        dtype=recipe.training.dtype,
        param_dtype=recipe.training.param_dtype,
        sharding_axis_dims=recipe.mesh.axis_dims,
        partition_axis=recipe.mesh.partition_axis,
        **{k: v for k, v in recipe.model.config_overrides.items() if k in LAYOUT_KEYS},
    )
    for key, value in recipe.model.config_overrides.items():
        if key in RUNTIME_KEYS:  # the others equal the folder's (checked above)
            setattr(model.config, key, value)
    check_vocab(tokenizer, model.config.vocab_size, recipe)
    return model


def check_pretrained_keys(recipe: Recipe) -> None:
    """Architecture keys next to ``model.pretrained`` must equal the folder's config.json.

    Why refuse rather than apply them: the weights fix the architecture, so a differing
    ``hidden_size`` cannot be honoured, and silently ignoring it would train another
    model than the recipe says. Equal values are allowed, so a recipe may state them.
    """
    if problem := pretrained_key_problem(recipe):
        raise ConfigError(problem)


def pretrained_key_problem(recipe: Recipe) -> str | None:
    """:func:`check_pretrained_keys`'s finding as a sentence, or None."""
    from scaletrain.models.common.config import LAYOUT_KEYS, RUNTIME_KEYS
    from scaletrain.models.hf_config import load_hf_config

    extra = {k: v for k, v in recipe.model.config_overrides.items() if k not in (*RUNTIME_KEYS, *LAYOUT_KEYS)}
    if not extra:
        return None
    folder = recipe.model.pretrained
    saved = load_hf_config(folder)
    as_saved = saved.to_dict()
    base, asked = type(saved).from_dict(as_saved), type(saved).from_dict({**as_saved, **extra})
    conflicts = [f"model.{k}={v!r} (the folder has {getattr(base, k)!r})"
                 for k, v in sorted(extra.items()) if getattr(asked, k) != getattr(base, k)]
    if conflicts:
        return (
            f"model.pretrained={folder} takes its architecture from {folder}/config.json, but the recipe sets "
            f"{', '.join(conflicts)}; remove these keys from the model section (only "
            f"{sorted(RUNTIME_KEYS + LAYOUT_KEYS)} may differ), or start from examples/chat_sft_smollm2.yaml"
        )
    return None


def run_training(recipe: Recipe, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Train as the recipe says, in this process; returns the summary written to ``summary.json``.

    ``output_dir`` is locked for the whole call (:mod:`scaletrain.training.run_lock`), and
    ``recipe.yaml`` is written only once the data, the model and the trainer are built.
    """
    import jax

    from scaletrain.training.run_lock import acquire_run_lock, release_run_lock

    args = recipe.training
    # one run per output_dir: refuse before writing anything there (process 0 speaks for all)
    lock = acquire_run_lock(args.output_dir) if jax.process_index() == 0 else None
    try:
        return _run_locked(recipe, callbacks)
    finally:
        release_run_lock(lock)


def _run_locked(recipe: Recipe, callbacks: Sequence[Any]) -> dict[str, Any]:
    import jax

    from scaletrain.training.outputs import write_summary
    from scaletrain.training.trainer import Trainer

    args = recipe.training
    enable_compilation_cache(args.compilation_cache_dir)  # before the model's initialiser compiles
    out = args.output_dir
    tokenizer = load_tokenizer(recipe)
    check_recipe(recipe, tokenizer)
    splits = load_datasets(recipe, tokenizer)
    model = build_model(recipe, tokenizer)
    has_eval = len(splits.eval) > 0
    trainer_class, objective_kwargs = objective_trainer(recipe)
    trainer = (trainer_class or Trainer)(
        **objective_kwargs,
        arguments=args,
        model=model,
        dataset_train=splits.train,
        dataset_eval=splits.eval if has_eval else None,
        eval_bytes_per_token=splits.eval_bytes_per_token if has_eval and splits.eval_bytes_per_token > 0 else None,
        tokenizer=tokenizer,
        callbacks=[_run_files_writer(recipe, out, splits.stats), *_eval_callbacks(recipe), *callbacks],
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


def _eval_callbacks(recipe: Recipe) -> list[Any]:
    """The in-loop evaluation of ``eval_harness``, when it names tasks or data sets."""
    if not recipe.eval_harness.enabled:
        return []
    from scaletrain.eval.callback import HarnessEvaluation

    return [HarnessEvaluation(recipe.eval_harness)]


def objective_trainer(recipe: Recipe) -> tuple[Any, dict[str, Any]]:
    """The trainer class of ``objective.type`` (None: ``Trainer``) and its objective keyword arguments
    (the objective, and for a preference objective its reference options). The family packages register
    their trainers when imported (``objectives.registry.register_trainer``)."""
    import scaletrain.preference.trainer  # noqa: F401  (registers PreferenceTrainer)
    import scaletrain.rl.trainer  # noqa: F401  (registers GRPOTrainer)
    import scaletrain.rl.variants  # noqa: F401  (registers RLOOTrainer, ReinforcePPTrainer)
    import scaletrain.rl.distill  # noqa: F401  (registers DistillationTrainer, GKDTrainer)
    import scaletrain.rl.ppo  # noqa: F401  (registers PPOTrainer)
    from scaletrain.objectives.registry import trainer_setup

    return trainer_setup(recipe.objective.type, recipe.objective.options)


def check_recipe(recipe: Recipe, tokenizer: Any) -> None:
    """Every check that needs no data (:mod:`scaletrain.preflight`), reported together before tokenizing."""
    from scaletrain.preflight import problems_before_data, raise_problems

    problems = [_first_error(pretrained_key_problem, recipe)] if recipe.model.pretrained else []
    try:
        config, module_class = model_config(recipe, tokenizer)
    except ScaletrainError as err:
        raise_problems([*problems, str(err)])
        raise
    problems.append(_first_error(check_vocab, tokenizer, config.vocab_size, recipe))
    raise_problems([*problems, *problems_before_data(recipe, config, module_class)])


def _first_error(check: Any, *args: Any) -> str | None:
    """What ``check(*args)`` raises as a user error, as text (None when it passes)."""
    try:
        result = check(*args)
    except ScaletrainError as err:
        return str(err)
    return result


def _run_files_writer(recipe: Recipe, out: str, data_stats: dict[str, Any]) -> Any:
    from scaletrain.training.callbacks import Callback

    class WriteRunFiles(Callback):
        """``recipe.yaml`` and ``data_stats.json`` at ``pre_train``: after the data, model, trainer and
        resume checks all passed, so an invocation that fails any of them leaves the last run's files as
        they were (and a new folder empty)."""

        def pre_train(self, trainer: Any, state: Any) -> None:
            if trainer.is_main_process:
                write_atomic(os.path.join(out, "recipe.yaml"),
                                  changes_header(trainer.changes_on_resume) + recipe.to_yaml())
                write_atomic(os.path.join(out, "data_stats.json"),
                                  json.dumps(data_stats, indent=2, sort_keys=True, default=float))

    return WriteRunFiles()


def changes_header(changes: list[dict[str, Any]]) -> str:
    """YAML comments naming what resumes changed (``training.resume_allow_changes``), for ``recipe.yaml``: the
    file shows the values the run trains with now, and must not pass them off as those of its first steps."""
    return "".join(f"# changed on resume after step {c['after_step']}: {c['key']} {json.dumps(c['old'])} -> "
                   f"{json.dumps(c['new'])}\n" for c in changes)


def sample_text(model: Any, tokenizer: Any, recipe: Recipe) -> str:
    """Continue ``sample.prompt`` with the trained model, up to its end of sequence or turn."""
    import jax

    from scaletrain.generation import generate, stop_token_ids, until_stop

    s = recipe.sample
    ids = tokenizer(s.prompt)["input_ids"] or [tokenizer.eos_token_id]
    # stop at the end of the reply (eos or the chat template's end of turn), not at max_new_tokens
    stop = stop_token_ids(tokenizer, model.config.eos_token_id)
    with jax.set_mesh(jax.tree.leaves(model)[0].sharding.mesh):
        new = generate(model, [ids], max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                       top_k=s.top_k, top_p=s.top_p, seed=s.seed, eos_token_id=stop)
    return s.prompt + tokenizer.decode(until_stop(new[0], stop), skip_special_tokens=True)
