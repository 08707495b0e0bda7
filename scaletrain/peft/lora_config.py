"""``LoRAConfig``: the recipe's ``lora`` section and ``TrainingArguments.lora``.

Kept apart from :mod:`scaletrain.peft.lora` (the modules) so that arguments and
recipes validate a LoRA setup without importing flax. Field meanings follow PEFT's
``LoraConfig`` (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``,
``use_rslora``), which is what an exported ``adapter_config.json`` says.
"""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import ConfigDict, field_validator, model_validator

from scaletrain.config_keys import ConfigModel
from scaletrain.models.common.config import dtype_name

#: PEFT's default targets for Llama-like models are q_proj and v_proj; we adapt every attention projection.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class LoRAConfig(ConfigModel):
    """Low-rank adapters on the linear layers named by ``target_modules``; everything else frozen.

    ``target_modules``: a list of module names matched against the end of each linear
    layer's dotted path (``q_proj`` matches ``model.layers.3.self_attn.q_proj``), or one
    string: ``"all-linear"`` (every linear layer but the LM head) or a regular expression
    that must match a whole path — PEFT's rules, so the exported adapter targets the
    same layers in transformers. ``quantize`` stores the frozen linear weights as int8 or
    NF4 blocks (QLoRA), ``base_dtype`` casts the frozen parameters (e.g. ``bfloat16``).
    ``init_from`` starts from an existing PEFT adapter instead of A random, B zero.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = DEFAULT_TARGETS
    rslora: bool = False
    train_embeddings: bool = False
    train_norms: bool = False
    quantize: Literal["int8", "nf4"] | None = None
    block_size: int = 64
    base_dtype: str | None = None
    # the base model's folder (or hub name), recorded in checkpoints and adapter_config.json
    base_model: str | None = None
    # a PEFT adapter folder to start from (continue training it); its r/alpha/targets must equal these
    init_from: str | None = None
    seed: int = 0

    @property
    def scaling(self) -> float:
        """``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA (PEFT's ``use_rslora``)."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @field_validator("rank", "block_size")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("must be > 0")
        return value

    @field_validator("dropout")
    @classmethod
    def _dropout(cls, value: float) -> float:
        if value != 0.0:
            # the pure train step has no per-layer dropout key yet: refuse rather than train without it
            raise ValueError("LoRA dropout is not supported yet; set it to 0")
        return value

    @field_validator("target_modules", mode="before")
    @classmethod
    def _targets(cls, value: object) -> object:
        if isinstance(value, list):
            value = tuple(value)
        if isinstance(value, str) and value != "all-linear":
            try:
                re.compile(value)
            except re.error as err:
                raise ValueError(f"not a valid regular expression: {err}") from None
        if isinstance(value, tuple) and not value:
            raise ValueError("name at least one module (e.g. [q_proj, v_proj]) or 'all-linear'")
        return value

    @field_validator("base_dtype", mode="before")
    @classmethod
    def _dtype(cls, value: object) -> object:
        return None if value is None else dtype_name(value)

    @model_validator(mode="after")
    def _block(self) -> LoRAConfig:
        if self.quantize == "nf4" and self.block_size % 2:
            raise ValueError("lora.block_size must be even for NF4 (two codes per byte)")
        return self
