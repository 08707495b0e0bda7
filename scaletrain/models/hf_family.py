"""What one Hugging Face ``model_type`` means to us: an :class:`HFFamily`, plus the helpers families share.

Why: each family (Llama, Qwen3, Gemma 3, the mixtures of experts...) maps its own
config.json keys, and what it refuses, next to its own code; :mod:`scaletrain.models.hf_config`
only runs the steps common to all of them. Adding a family is writing one ``HFFamily``
and passing it to the family's ``register(...)`` call
(:func:`scaletrain.models.common.family.register`), not a new branch in a shared function.
The transformers config class (named, imported lazily) resolves the defaults and legacy
keys, so a config.json means here what it means to transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scaletrain.errors import ConfigError
from scaletrain.models.common.config import DecoderConfig

#: RoPE types :func:`scaletrain.models.kernels.attention.rope_inv_freq` computes.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")

#: ``refuse(what)``: the ConfigError for an export that transformers cannot express.
Refuse = Callable[[str], ConfigError]


@dataclass(frozen=True)
class HFFamily:
    """One ``model_type``: its classes on both sides and its config.json mapping.

    ``from_hf(hf, where)`` returns our config's fields from the transformers config
    object (ConfigError naming ``where`` and the key for an option we do not
    implement); ``to_hf(config, refuse)`` returns the transformers config's keyword
    arguments (``raise refuse(what)`` where HF cannot express ``config``).
    """

    architecture: str  # the transformers model class, written into config.json's "architectures"
    hf_config_class: str  # the transformers config class, by name: transformers loads lazily
    config_class: type[DecoderConfig]
    from_hf: Callable[[Any, str], dict[str, Any]]
    to_hf: Callable[[DecoderConfig, Refuse], dict[str, Any]]
    #: ``quantization_config.quant_method`` values whose folders load, dequantised (GPT-OSS: ``mxfp4``)
    quantizations: tuple[str, ...] = ()

    @property
    def model_type(self) -> str:
        """The HF ``model_type``: the config class's, the one place a family spells it."""
        return self.config_class.model_type

    def transformers_config(self) -> type:
        import transformers

        return getattr(transformers, self.hf_config_class)


def rope_from_hf(rope: Any, where: str, key: str = "rope_parameters") -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from one transformers standardized ``rope_parameters`` dict."""
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        raise ConfigError(f"{where}: {key} {rope!r} (per-layer RoPE) is not supported")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(
            f"{where}: {key}: rope type {kind!r} is not supported; supported rope types: {list(ROPE_TYPES)}"
        )
    factor = rope.get("partial_rotary_factor", 1.0)
    if factor not in (None, 1, 1.0):
        raise ConfigError(f"{where}: {key}: partial_rotary_factor {factor} is not supported (only 1.0)")
    theta = float(rope["rope_theta"])
    if kind == "default":
        return theta, None
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    scaling["rope_type"] = kind
    return theta, scaling


def rope_to_hf(theta: float, scaling: dict[str, Any] | None) -> dict[str, Any]:
    """transformers' ``rope_parameters`` dict for ``rope_theta`` and our ``rope_scaling``."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(theta)}
    if scaling:
        scaling = dict(scaling)
        scaling["rope_type"] = scaling.pop("type", None) or scaling.get("rope_type", "default")
        rope.update(scaling)
    return rope


def base_fields(hf: Any, where: str, *, rope: bool = True) -> dict[str, Any]:
    """The fields every decoder family shares (sizes, norm eps, ids, tied head; RoPE unless ``rope=False``)."""
    fields: dict[str, Any] = dict(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        # None where a family has no dense MLP (Qwen3.5-MoE's config lacks the key): that family sets it
        intermediate_size=getattr(hf, "intermediate_size", None),
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads or hf.num_attention_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        max_position_embeddings=hf.max_position_embeddings,
        initializer_range=hf.initializer_range,
        rms_norm_eps=hf.rms_norm_eps,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        bos_token_id=hf.bos_token_id,
        eos_token_id=hf.eos_token_id,
        pad_token_id=hf.pad_token_id,
    )
    if rope:
        fields["rope_theta"], fields["rope_scaling"] = rope_from_hf(hf.rope_parameters, where)
    return fields


def base_hf_kwargs(config: DecoderConfig, *, rope: bool = True) -> dict[str, Any]:
    """The transformers config keywords every decoder family shares (see :func:`base_fields`)."""
    kwargs: dict[str, Any] = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    if rope:
        kwargs["rope_parameters"] = rope_to_hf(config.rope_theta, config.rope_scaling)
    return kwargs


def check_silu(hf: Any, where: str, key: str = "hidden_act") -> None:
    """ConfigError naming ``key`` unless the MLP activation is SiLU (the SwiGLU families)."""
    act = getattr(hf, key)
    if act not in ("silu", "swish"):
        raise ConfigError(f"{where}: {key} {act!r} is not supported (only silu)")


def uniform_window(hf: Any, where: str) -> int | None:
    """The one sliding window of all layers (Qwen2/Qwen3 ``layer_types``), None when all are full.

    ConfigError for a mix of full and sliding layers (``max_window_layers`` below the
    layer count), which their decoder would compute per layer and ours does not.
    """
    kinds = set(hf.layer_types or ["full_attention"])
    if not kinds <= {"full_attention", "sliding_attention"} or len(kinds) > 1:
        raise ConfigError(
            f"{where}: per-layer attention types {sorted(kinds)} (use_sliding_window with "
            f"max_window_layers={getattr(hf, 'max_window_layers', None)}) are not supported; "
            "only all-full or all-sliding layers"
        )
    return hf.sliding_window if kinds == {"sliding_attention"} and hf.sliding_window is not None else None


def uniform_window_to_hf(config: DecoderConfig) -> dict[str, Any]:
    """transformers' Qwen2/Qwen3 window keys for our ``use_sliding_window`` / ``sliding_window``."""
    sliding = bool(getattr(config, "use_sliding_window", False)) and config.sliding_window is not None
    n = config.num_hidden_layers
    return dict(
        use_sliding_window=sliding,
        sliding_window=config.sliding_window if sliding else None,
        max_window_layers=0 if sliding else n,
        layer_types=["sliding_attention" if sliding else "full_attention"] * n,
    )
