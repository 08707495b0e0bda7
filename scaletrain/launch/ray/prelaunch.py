"""Checks of a recipe that need no worker, run on the Ray driver before any worker starts.

Why: a worker takes seconds to start (Ray, then JAX, then the model) and, before the
launcher stopped retrying user errors, a bad batch size or a missing data file was
found ``max_failures + 1`` times over. What can be checked from the recipe alone is
checked here, with the message the worker would have given; everything else (the
tokenized data being large enough, the model fitting the mesh) still fails on the
workers, once.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from scaletrain.errors import ConfigError, DataError, ScaletrainError
from scaletrain.launch.batch_split import check_batch_split

if TYPE_CHECKING:  # pragma: no cover
    from scaletrain.data.config import DataSection
    from scaletrain.recipe import Recipe


def check_recipe_before_launch(recipe: Recipe) -> None:
    """Raise the ConfigError / DataError a worker would raise for the batch split, model type, tokenizer or data."""
    n, t = recipe.ray.num_workers or 1, recipe.training
    check_batch_split(t.total_batch_size, n, "ray.num_workers")
    if not recipe.model.pretrained:
        from scaletrain.models import get_modules_by_type

        get_modules_by_type(recipe.model.type)
    elif not os.path.isdir(os.path.expanduser(recipe.model.pretrained)):
        raise ConfigError(f"model.pretrained={recipe.model.pretrained!r} is not a folder")
    tokenizer = recipe.tokenizer.path or recipe.model.pretrained
    if tokenizer and tokenizer != "bundled" and not tokenizer.startswith("prepared:"):
        if not os.path.isdir(os.path.expanduser(tokenizer)):
            raise ConfigError(f"tokenizer.path={tokenizer!r} is not a folder")
    d = recipe.data
    entries = [(f"data.mixture[{i}]", e) for i, e in enumerate(d.mixture)] if d.mixture else [("data", d)]
    for where, entry in entries:  # a mixture: each of its sources, named in the message
        try:
            _check_readable(entry.source, entry.split, f"{where}.source", entry)
            if entry.eval_source:
                _check_readable(entry.eval_source, entry.eval_split, f"{where}.eval_source", entry)
        except ScaletrainError as err:
            if not d.mixture:
                raise
            raise type(err)(f"{where} ({entry.name!r}): {err}") from None


def _check_readable(source: str, split: str, field: str, d: DataSection) -> None:
    """Open ``source`` and read its first row: the files exist, the format and the column are right."""
    from scaletrain.data.kinds import data_kind
    from scaletrain.data.sources import iter_source

    column = data_kind(d.kind).column(d)
    rows = iter_source(source, column, format=d.format, per_line=d.per_line, split=split)
    try:
        next(rows)
    except StopIteration:
        raise DataError(f"{field} {source!r} has no rows") from None
    finally:
        rows.close()
