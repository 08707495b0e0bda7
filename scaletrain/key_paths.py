"""Pytree key paths as plain strings: one spelling for every module that names a parameter.

Why one helper: optimizer masks (``frozen_parameters``), per-layer norms, stacked-layer
detection, checkpoint shape checks and the Hugging Face name mapping all turn a JAX key
path (from ``jax.tree_util.tree_flatten_with_path``) into names, and they must agree.
Each entry's bare key is used, not ``jax.tree_util.keystr``'s ``['model']``/``.name``
spelling, so ``model.layers.0.self_attn.q_proj.kernel`` reads as the parameter is called.

This module imports nothing from scaletrain or JAX, so ``parallel/``, ``models/`` and
``training/`` can all use it without an import cycle.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# the attribute holding the bare key of each JAX key entry, in the order tried:
# DictKey / FlattenedIndexKey .key, SequenceKey .idx, GetAttrKey .name (dataclass and
# namedtuple fields, e.g. a TrainState's or an optax state's)
_KEY_ATTRIBUTES = ("key", "idx", "name")


def key_name(entry: Any) -> str:
    """The bare key of one key-path entry: ``DictKey('q_proj')`` -> ``"q_proj"``, ``SequenceKey(0)`` -> ``"0"``.

    An entry with none of the known attributes (a plain string or int) is its own ``str``.
    """
    for attribute in _KEY_ATTRIBUTES:
        if hasattr(entry, attribute):
            return str(getattr(entry, attribute))
    return str(entry)


def key_names(path: Iterable[Any]) -> list[str]:
    """Every entry of ``path`` as :func:`key_name` spells it."""
    return [key_name(entry) for entry in path]


def dotted(path: Iterable[Any], sep: str = ".") -> str:
    """``path`` joined with ``sep``: ``model.layers.0.self_attn.q_proj.kernel``."""
    return sep.join(key_names(path))
