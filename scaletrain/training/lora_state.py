"""What the trainer does differently for a LoRA run: adapters on, and the frozen base checked on resume.

A LoRA checkpoint holds the adapters and their optimizer state only
(``TrainState.frozen`` is not saved), so it is worth something only on top of the
exact base it was trained on. The checkpoint's metadata records that base's path and
the SHA-256 of its frozen arrays; a resume onto any other base is refused, naming it.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from scaletrain.errors import CheckpointError, ConfigError
from scaletrain.peft.adapter_base import check_adapter_base
from scaletrain.peft.lora import LoRAConfig, apply_lora, lora_config_of
from scaletrain.peft.adapter import check_adapter_matches, load_adapter_weights
from scaletrain.training.state import params_sha256


def with_lora(model: nnx.Module, config: LoRAConfig | None) -> nnx.Module:
    """``model`` with ``training.lora``'s adapters applied (from ``init_from``'s PEFT adapter if set, once it
    is shown to fit and to have been trained on this base), unless it already carries that config."""
    have = lora_config_of(model)
    if config is None or have == config:
        return model
    if have is not None:
        raise ConfigError("training.lora differs from the LoRA config the model already has (an imported adapter?); "
                          "set training.lora to null to keep the model's adapters, or pass the plain base model")
    model = apply_lora(model, config)
    if config.init_from is not None:
        check_adapter_matches(config, config.init_from)
        check_adapter_base(config.init_from, config.base_model, model.config)
        load_adapter_weights(model, config.init_from)
    return model


def base_record(model: nnx.Module, frozen: Any) -> dict[str, Any] | None:
    """``{"base_model", "base_sha256"}`` of a LoRA model's frozen base; None for a plain model.

    With several processes every one must call it (the digest gathers the base)."""
    config = lora_config_of(model)
    if config is None:
        return None
    return {"base_model": config.base_model, "base_sha256": params_sha256(frozen)}


def check_lora_base(saved: dict[str, Any] | None, current: dict[str, Any] | None, checkpoint: str) -> None:
    """CheckpointError unless the checkpoint was trained on the base this run holds (or neither is LoRA)."""
    if saved is None and current is None:
        return
    if saved is None or current is None:
        kind = "a LoRA adapter" if saved is not None else "a full model"
        raise CheckpointError(f"checkpoint {checkpoint} holds {kind}, but this run "
                              f"{'is not' if saved is not None else 'is'} a LoRA run; set training.lora as "
                              "the checkpoint's run did, or resume into another output_dir")
    if saved["base_sha256"] != current["base_sha256"]:
        raise CheckpointError(
            f"checkpoint {checkpoint} holds LoRA adapters trained on the base {saved.get('base_model') or '(unnamed)'} "
            f"(sha256 {saved['base_sha256'][:12]}…), but this run's base {current.get('base_model') or '(unnamed)'} "
            f"differs (sha256 {current['base_sha256'][:12]}…); resume with the same base model and lora settings"
        )
