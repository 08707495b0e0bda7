"""Llama's config: the neutral decoder config under ``model_type`` llama (the Llama block has nothing more)."""

from __future__ import annotations

from typing import ClassVar

from scaletrain.models.common.config import DecoderConfig


class LlamaConfig(DecoderConfig):
    """Llama 2/3's ``config.json``: the shared decoder keys (GQA, RoPE with linear or llama3 scaling,
    optional biases, an optional window)."""

    model_type: ClassVar[str] = "llama"


__all__ = ["LlamaConfig"]
