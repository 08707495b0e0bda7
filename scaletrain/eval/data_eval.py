"""Loss, perplexity, bits per byte and token accuracy of a model on a data source.

Why through the training pieces: the figures must mean what a run's ``eval_*`` figures
mean, so the rows are built by the same data pipeline (``build_datasets``: the same
kinds, templates, assistant-only loss mask and bytes-per-token count), served by the same
iterator, and scored by the Trainer's own jitted ``eval_step`` and objective. Evaluating a
run on its own eval data therefore reproduces its final evaluation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import Any

from scaletrain.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """How rows are batched and scored: the run's settings for a run, chosen ones for a folder."""

    batch_size: int = 8
    max_length: int = 256
    seed: int = 0
    truncation_mode: str = "keep_end"
    loss_chunk_size: Any = "auto"
    max_batches: int | None = None
    micro_batches: int = 1  # the run's gradient_accumulation_steps: its eval step sums in these micro-batches

    @classmethod
    def of_run(cls, arguments: dict[str, Any], **changes: Any) -> EvalSettings:
        """A run's own settings (from its checkpoint's ``arguments``), then ``changes`` that are not None."""
        keys = dict(batch_size=arguments.get("total_batch_size", 8), max_length=arguments.get("max_length", 256),
                    seed=arguments.get("seed", 0), truncation_mode=arguments.get("truncation_mode", "keep_end"),
                    loss_chunk_size=arguments.get("loss_chunk_size", "auto"),
                    max_batches=arguments.get("max_evaluation_steps"),
                    micro_batches=arguments.get("gradient_accumulation_steps", 1))
        keys.update({k: v for k, v in changes.items() if v is not None})
        if changes.get("batch_size") is not None:  # another batch: not the run's micro-batches
            keys["micro_batches"] = 1
        return cls(**keys)


def source_section(source: str, *, kind: str = "pretrain", split: str = "train", **keys: Any) -> Any:
    """A ``data`` section whose *eval* split is the whole of ``source`` (every row scored).

    ``build_datasets`` reads a source in full as evaluation rows only as ``eval_source``; the
    training side is then cut to one document (``max_documents=1``), since nothing trains on it.
    """
    from pydantic import ValidationError

    from scaletrain.data.config import DataSection

    try:
        return DataSection(source=source, eval_source=source, eval_split=split, split=split, kind=kind,
                           max_documents=1, **keys)
    except ValidationError as err:  # an unknown kind, a bad format: named as the option the user typed
        first = err.errors()[0]
        field = str(first["loc"][0]).replace("_", "-") if first["loc"] else "data"
        raise ConfigError(f"--{field}: {first['msg'].removeprefix('Value error, ')} (--data {source})") from None


def eval_rows(section: Any, tokenizer: Any, settings: EvalSettings) -> tuple[Any, float | None]:
    """``(packed eval rows, bytes per eval token or None)`` of a ``data`` section, built as a run builds them."""
    from scaletrain.data.build import build_datasets
    from scaletrain.errors import DataError

    if tokenizer is None:
        raise ConfigError("the target has no tokenizer (an HF folder without tokenizer files, or a run driven from "
                          "Python); save the tokenizer beside the model to evaluate on text")
    with _builders_quiet():  # their line counts the training side too, which nothing here scores
        splits = build_datasets(section, tokenizer, max_length=settings.max_length, seed=settings.seed,
                                truncation_mode=settings.truncation_mode)
    if len(splits.eval) == 0:
        raise DataError(f"data source {section.eval_source or section.source!r} gave no evaluation rows")
    logger.info("%s", scored_rows_line(section.eval_source or section.source, splits.stats, len(splits.eval),
                                       settings.max_length))
    bpt = splits.eval_bytes_per_token
    return splits.eval, (bpt if bpt == bpt and bpt > 0 else None)


def scored_rows_line(source: str, stats: dict[str, Any], rows: int, max_length: int) -> str:
    """What the evaluation scores, in the data's own unit (pairs, rows, tokens), from a build's ``stats``.

    Why not the builder's own line: ``--data`` builds its source as the *eval* split beside a
    one-row stand-in training split, so that line said "1 preference pairs ... 1 train rows"
    for 8 pairs scored.
    """
    cut = stats.get("eval_truncated")
    shape = f"{rows} rows of up to {max_length} tokens" + ("" if cut is None else f", {int(cut)} sequences cut")
    kind = stats.get("kind")
    if kind == "preference":
        return f"scoring {rows} preference pairs of {source} ({shape})"
    if kind == "unpaired_preference":
        return f"scoring {rows} unpaired preference rows of {source} ({shape})"
    tokens = stats.get("eval_tokens")
    return f"scoring {source} as {kind} data: {shape}" + ("" if tokens is None else f" ({int(tokens)} tokens)")


@contextlib.contextmanager
def _builders_quiet() -> Iterator[None]:
    """The data builders' INFO lines off (their warnings, e.g. bad rows, still shown) for the block."""
    data_logger = logging.getLogger("scaletrain.data")
    level = data_logger.level
    data_logger.setLevel(max(logging.WARNING, level))
    try:
        yield
    finally:
        data_logger.setLevel(level)


def evaluate_rows(model: Any, rows: Any, settings: EvalSettings, bytes_per_token: float | None = None,
                  progress: bool = False, objective: Any = None,
                  frozen_models: dict[str, Any] | None = None) -> dict[str, float]:
    """``eval_loss``, ``eval_accuracy``, ``eval_perplexity``, ``eval_tokens`` (and ``eval_bits_per_byte``).

    The rows are served in order, the last batch padded, and summed on the devices in the
    Trainer's order with its ``eval_step`` (over the model's own mesh, the batch split as a
    run splits it); ``eval_seconds`` is the wall time.
    """
    return RowsEvaluator(model, settings, objective, frozen_models)(model, rows, bytes_per_token, progress)


class RowsEvaluator:
    """The Trainer's jitted ``eval_step`` for one model's structure and mesh, built once and called on any
    state of it (in-loop evaluation scores a new state every time without compiling again).

    ``frozen_models``: what the objective reads beside the model (a preference objective's
    ``"reference"``), held in the state as a run holds them."""

    def __init__(self, model: Any, settings: EvalSettings, objective: Any = None,
                 frozen_models: dict[str, Any] | None = None):
        import optax
        from jax.sharding import NamedSharding, PartitionSpec

        from scaletrain.arguments import TrainingArguments
        from scaletrain.models.factory import place_model
        from scaletrain.objectives import LanguageModelObjective
        from scaletrain.objectives.loss import resolve_chunk_size
        from scaletrain.training.base import batch_sharding
        from scaletrain.training.state import create_train_state, state_shardings
        from scaletrain.training.steps import make_step_functions

        model, self.mesh = place_model(model)
        self.settings = settings
        args = TrainingArguments(total_batch_size=settings.batch_size, max_length=settings.max_length,
                                 gradient_accumulation_steps=settings.micro_batches)
        self.sharding = batch_sharding(args, self.mesh)
        if objective is None:
            chunk = resolve_chunk_size(settings.loss_chunk_size, model.config.vocab_size, settings.max_length)
            objective = LanguageModelObjective(chunk_size=chunk)
        self.objective = objective
        self.frozen_models = dict(frozen_models or {})
        state = create_train_state(model, optax.identity(), self.mesh).replace(frozen_models=self.frozen_models)
        _, self.step = make_step_functions(optax.identity(), state_shardings(state), self.sharding,
                                           NamedSharding(self.mesh, PartitionSpec()), objective,
                                           settings.micro_batches)

    def __call__(self, model: Any, rows: Any, bytes_per_token: float | None = None,
                 progress: bool = False) -> dict[str, float]:
        import jax
        import jax.numpy as jnp
        import optax

        import numpy as np

        from scaletrain.data.loader import make_batch_iterator, steps_per_epoch
        from scaletrain.training.state import create_train_state
        from scaletrain.training.steps import rank_sharding

        start = time.perf_counter()
        s = self.settings
        state = create_train_state(model, optax.identity(), self.mesh).replace(frozen_models=self.frozen_models)
        batches = make_batch_iterator(rows, s.batch_size, seed=s.seed, shuffle=False, num_epochs=1,
                                      drop_remainder=False, max_length=s.max_length,
                                      truncation_mode=s.truncation_mode)
        total = steps_per_epoch(rows, s.batch_size, drop_remainder=False)
        total = min(total, s.max_batches) if s.max_batches else total
        bar = _bar(total, progress)
        acc: Any = None
        with jax.set_mesh(self.mesh):
            for i, batch in enumerate(batches):
                if i >= total:
                    break
                placed = {k: jax.make_array_from_process_local_data(rank_sharding(self.sharding, np.ndim(v)), v)
                          for k, v in batch.items()}  # per-row columns (KTO's label) are rank 1
                sums = self.step(state, placed)
                acc = sums if acc is None else jax.tree.map(jnp.add, acc, sums)
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        results = self.objective.eval_metrics(jax.device_get(acc), bytes_per_token)
        results["eval_seconds"] = time.perf_counter() - start
        return results


def _bar(total: int, on: bool) -> Any:
    if not on:
        return None
    import jax
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="eval", dynamic_ncols=True) if jax.process_index() == 0 else None
