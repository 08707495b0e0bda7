"""EasyDeL RayDistributedTrainer-style processing: one text or one conversation -> fixed-length padded arrays.

Why here, in the compatibility layer: EasyDeL's ``RayDistributedTrainer`` exposes
``process_sample_data``, ``process_messages_data`` and ``extract_column_names`` as methods
and users map them over their datasets (``dataset.map(...)``) to get one padded row per
example. The conversation encoder has no loss mask (every token is trained): the trainer's
own chat data goes through :mod:`scaletrain.data.chat` (assistant-only loss) instead. They
are plain functions so the façade's methods delegate to them; ``scaletrain.data`` still
exports them, lazily. Unlike the seed they return NumPy
arrays (``return_tensors="np"``): JAX arrays would be placed on a device per example
and then copied back by the loader.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from scaletrain.errors import ConfigError, DataError

PaddingSide = Literal["left", "right"]


def _flatten(out: Any) -> dict[str, Any]:
    return {k: (v.reshape(-1) if hasattr(v, "reshape") else v) for k, v in out.items()}


def _check(max_length: int, padding_side: str) -> None:
    if max_length < 1:
        raise ConfigError(f"max_length must be >= 1, got {max_length}")
    if padding_side not in ("left", "right"):
        raise ConfigError(f"padding_side must be 'left' or 'right', got {padding_side!r}")


def process_sample_data(
    tokenizer: Any, sample: Any, max_length: int, padding_side: PaddingSide = "left"
) -> dict[str, np.ndarray]:
    """Tokenize one text into ``input_ids`` and ``attention_mask`` of exactly ``max_length``.

    Longer texts are truncated, shorter ones padded on ``padding_side`` with the
    tokenizer's pad token (attention_mask 0 there). Arrays are flattened to 1-D.
    """
    _check(max_length, padding_side)
    out = tokenizer(
        sample,
        padding="max_length",
        max_length=max_length,
        return_tensors="np",
        padding_side=padding_side,
        return_attention_mask=True,
        truncation=True,
    )
    return _flatten(out)


def process_messages_data(
    tokenizer: Any, messages: Any, max_length: int, padding_side: PaddingSide = "left"
) -> dict[str, np.ndarray]:
    """One conversation through the chat template, padded/truncated to exactly ``max_length``.

    This is the seed's behaviour (no loss mask: every token is a target); for
    assistant-only SFT use :func:`scaletrain.data.encode_chat` or ``data.kind: chat``.
    """
    _check(max_length, padding_side)
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError("the tokenizer has no chat template; set tokenizer.chat_template first")
    out = tokenizer.apply_chat_template(
        messages,
        padding="max_length",
        max_length=max_length,
        return_tensors="np",
        return_dict=True,
        truncation=True,
        # apply_chat_template hands unknown keywords to the template, not the tokenizer
        tokenizer_kwargs={"padding_side": padding_side},
    )
    return _flatten(out)


def extract_column_names(dataset: Any) -> list[str] | None:
    """Column names of a dataset: ``column_names`` if it has them, else the keys of its first row."""
    names = getattr(dataset, "column_names", None)
    if names:
        if isinstance(names, dict):  # a DatasetDict: {split: [columns]}
            names = next(iter(names.values()))
        return list(names)
    for sample in dataset:
        return list(sample.keys()) if hasattr(sample, "keys") else None
    return None
