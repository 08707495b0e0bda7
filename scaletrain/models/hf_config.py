"""Hugging Face ``config.json`` <-> our model configs (``LlamaConfig`` and family).

Why a module of its own: what a config.json *means* (defaults, legacy keys, the
options we refuse) is a separate question from how the weights are read and written
(:mod:`scaletrain.models.hf`). The transformers config classes (a runtime dependency
anyway) resolve defaults and legacy keys (``rope_scaling``/``rope_theta`` vs
``rope_parameters``), so a config.json means here exactly what it means to
transformers. Anything we would compute differently raises ``ConfigError`` naming it.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from scaletrain.errors import ConfigError
from scaletrain.models.config import LlamaConfig, MistralConfig, Qwen2Config
from scaletrain.parallel.partition import PartitionAxis

logger = logging.getLogger("scaletrain")

#: HF ``model_type`` -> HF architecture class name, for the families we implement.
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
ROPE_TYPES = ("default", "linear", "llama3")
CONFIG_FILE = "config.json"


def read_hf_config(local_dir: str | os.PathLike) -> dict[str, Any]:
    """The raw ``config.json`` of a local HF folder (ConfigError naming the path if unusable)."""
    path = os.path.join(os.fspath(local_dir), CONFIG_FILE)
    if not os.path.isdir(local_dir):
        raise ConfigError(f"{os.fspath(local_dir)}: not a directory; pass a local Hugging Face model folder")
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: missing; a Hugging Face model folder needs config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return raw


def supported_model_type(raw: dict[str, Any], where: str = CONFIG_FILE) -> str:
    """The ``model_type`` of an HF config dict; ConfigError naming it unless we implement it."""
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConfigError(
            f"{where}: model_type {model_type!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    return model_type


def load_hf_config(
    local_dir: str | os.PathLike,
    sharding_axis_dims: tuple[int, ...] | None = None,
    partition_axis: PartitionAxis | dict[str, Any] | None = None,
) -> LlamaConfig:
    """Our config for a local HF folder, with the mesh placement fields set when given."""
    raw = read_hf_config(local_dir)
    runtime: dict[str, Any] = {}
    if sharding_axis_dims is not None:
        runtime["sharding_axis_dims"] = tuple(sharding_axis_dims)
    if partition_axis is not None:
        runtime["partition_axis"] = partition_axis
    return config_from_hf(raw, os.path.join(os.fspath(local_dir), CONFIG_FILE), **runtime)


def _hf_config_class(model_type: str) -> type:
    import transformers

    return {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
    }[model_type]


def _rope_from_hf(rope: Any, where: str) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from transformers' standardized ``rope_parameters``."""
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        raise ConfigError(f"{where}: rope_parameters {rope!r} (per-layer RoPE) is not supported")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(
            f"{where}: rope type {kind!r} is not supported; supported rope types: {list(ROPE_TYPES)}"
        )
    factor = rope.get("partial_rotary_factor", 1.0)
    if factor not in (None, 1, 1.0):
        raise ConfigError(f"{where}: partial_rotary_factor {factor} is not supported (only 1.0)")
    theta = float(rope["rope_theta"])
    if kind == "default":
        return theta, None
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    scaling["rope_type"] = kind
    return theta, scaling


def config_from_hf(raw: dict[str, Any], where: str = CONFIG_FILE, **runtime: Any) -> LlamaConfig:
    """Our config for an HF ``config.json`` dict; ``runtime`` sets placement fields.

    Raises ConfigError naming the model_type or option we do not implement, rather
    than building a model that would silently compute something else.
    """
    model_type = supported_model_type(raw, where)
    if raw.get("quantization_config"):
        raise ConfigError(f"{where}: quantized checkpoints (quantization_config) are not supported; dequantize first")
    hf = _hf_config_class(model_type).from_dict(dict(raw))
    if hf.hidden_act not in ("silu", "swish"):
        raise ConfigError(f"{where}: hidden_act {hf.hidden_act!r} is not supported (only silu)")
    if getattr(hf, "attention_dropout", 0.0):
        logger.warning("%s: attention_dropout=%s is ignored (scaletrain has no dropout)", where, hf.attention_dropout)
    rope_theta, rope_scaling = _rope_from_hf(hf.rope_parameters, where)
    fields: dict[str, Any] = dict(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads or hf.num_attention_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        hidden_act="silu",
        max_position_embeddings=hf.max_position_embeddings,
        initializer_range=hf.initializer_range,
        rms_norm_eps=hf.rms_norm_eps,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        bos_token_id=hf.bos_token_id,
        eos_token_id=hf.eos_token_id,
        pad_token_id=hf.pad_token_id,
    )
    if model_type == "llama":
        fields.update(
            attention_bias=bool(hf.attention_bias), qkv_bias=False, mlp_bias=bool(hf.mlp_bias), sliding_window=None
        )
        config_class: type[LlamaConfig] = LlamaConfig
    elif model_type == "mistral":
        fields.update(attention_bias=False, qkv_bias=False, mlp_bias=False, sliding_window=hf.sliding_window)
        config_class = MistralConfig
    else:
        kinds = set(hf.layer_types or ["full_attention"])
        if not kinds <= {"full_attention", "sliding_attention"} or len(kinds) > 1:
            raise ConfigError(
                f"{where}: per-layer attention types {sorted(kinds)} (use_sliding_window with "
                f"max_window_layers={getattr(hf, 'max_window_layers', None)}) are not supported; "
                "only all-full or all-sliding layers"
            )
        sliding = kinds == {"sliding_attention"} and hf.sliding_window is not None
        fields.update(
            attention_bias=False,
            qkv_bias=True,
            mlp_bias=False,
            use_sliding_window=sliding,
            sliding_window=hf.sliding_window if sliding else None,
        )
        config_class = Qwen2Config
    fields.update({k: v for k, v in runtime.items() if v is not None})
    try:
        return config_class(**fields)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise ConfigError(f"{where}: {exc}") from None


def config_to_hf(config: LlamaConfig, dtype: str) -> Any:
    """A transformers config object for ``config``; ConfigError if HF cannot express it.

    Only architecture keys travel; placement fields (mesh, partition axes, remat,
    attention implementation) are runtime choices of this library.
    """
    model_type = config.model_type
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"model_type {model_type!r} cannot be exported; supported: {sorted(ARCHITECTURES)}")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(config.rope_theta)}
    if config.rope_scaling:
        scaling = dict(config.rope_scaling)
        scaling["rope_type"] = scaling.pop("type", None) or scaling.get("rope_type", "default")
        rope.update(scaling)
    kwargs: dict[str, Any] = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )

    def refuse(what: str) -> ConfigError:
        return ConfigError(f"model_type {model_type!r} with {what} has no Hugging Face equivalent; cannot export")

    if model_type == "llama":
        if config.qkv_bias and not config.attention_bias:
            raise refuse("qkv_bias=True but attention_bias=False")
        if config.sliding_window is not None:
            raise refuse(f"sliding_window={config.sliding_window} (use model_type mistral)")
        kwargs.update(attention_bias=config.attention_bias, mlp_bias=config.mlp_bias)
    elif model_type == "mistral":
        if config.attention_bias or config.qkv_bias or config.mlp_bias:
            raise refuse("attention/qkv/mlp biases")
        kwargs.update(sliding_window=config.sliding_window)
    else:
        if not config.qkv_bias or config.attention_bias or config.mlp_bias:
            raise refuse("biases other than q/k/v")
        sliding = bool(getattr(config, "use_sliding_window", False)) and config.sliding_window is not None
        n = config.num_hidden_layers
        kwargs.update(
            use_sliding_window=sliding,
            sliding_window=config.sliding_window if sliding else None,
            max_window_layers=0 if sliding else n,
            layer_types=["sliding_attention" if sliding else "full_attention"] * n,
        )
    hf = _hf_config_class(model_type)(**kwargs)
    hf.architectures = [ARCHITECTURES[model_type]]
    hf.dtype = dtype
    return hf
