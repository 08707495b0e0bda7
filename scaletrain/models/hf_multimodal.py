"""The language model of a vision-language folder (Qwen3.5's released checkpoints), read as a text model.

Why: the released Qwen3.5 models are vision-language folders (``model_type: qwen3_5``, the text
config under ``text_config``, the text weights under ``model.language_model.``, the vision tower under
``model.visual.``). People post-train their language model on text, so such a folder loads as its
text family (the family registers the vision-language ``model_type`` as ``multimodal``), the tensors
it leaves out named in one log line; training the vision tower is not supported yet and asking for
the vision-language type itself is refused in one line (:func:`scaletrain.models.common.family.get_modules_by_type`).
"""

from __future__ import annotations

import logging
from typing import Any

from scaletrain.errors import ConfigError
from scaletrain.models.common.family import MULTIMODAL

logger = logging.getLogger("scaletrain")

#: where a vision-language checkpoint keeps its language model's weights (transformers' layout)
LANGUAGE_MODEL = "model.language_model."


def language_model_config(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """``raw`` itself, or for a registered vision-language ``model_type`` its text config as the text family's."""
    vl_type = raw.get("model_type")
    text_type = MULTIMODAL.get(vl_type) if isinstance(vl_type, str) else None
    if text_type is None:
        return raw
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: model_type {vl_type!r} without a text_config object; it is not a "
                          f"{vl_type} folder transformers wrote")
    out = {**text, "model_type": text_type}
    out.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    return out


class StoredAs:
    """An open safetensors file that serves ``get_slice(our_name)`` from the tensor stored as ``stored``."""

    def __init__(self, handle: Any, stored: str):
        self.handle, self.stored = handle, stored

    def get_slice(self, _name: str) -> Any:
        return self.handle.get_slice(self.stored)


def language_model_tensors(files: dict[str, str], local_dir: str) -> tuple[dict[str, str], dict[str, str]]:
    """``(files, stored)``: a vision-language checkpoint's language-model tensors under a text model's names
    (``model.language_model.x`` -> ``model.x``; the head stays ``lm_head.weight``) with the name each is
    stored under, the rest (vision tower, multi-token-prediction heads) left out and named in one log line.
    Any other checkpoint is returned as it is."""
    if not any(name.startswith(LANGUAGE_MODEL) for name in files):
        return files, {}
    stored = {"model." + name[len(LANGUAGE_MODEL):]: name for name in files if name.startswith(LANGUAGE_MODEL)}
    if "lm_head.weight" in files:
        stored["lm_head.weight"] = "lm_head.weight"
    left = sorted(set(files) - set(stored.values()))
    if left:
        parts = sorted({".".join(name.split(".")[:2]) for name in left})
        logger.warning("%s: a vision-language checkpoint: loaded its language model; left out %d tensors (%s): "
                       "training the vision tower is not supported yet", local_dir, len(left), ", ".join(parts))
    return {ours: files[name] for ours, name in stored.items()}, stored
