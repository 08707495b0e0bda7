"""The neutral decoder config every family builds on: architecture keys apart from placement keys.

Why two classes: the architecture (:class:`DecoderConfig`'s own fields: the keys of a transformers
``config.json`` that every decoder family shares) fixes the weights, while placement
(:class:`PlacementConfig`: the mesh axes, the ``PartitionAxis``, gradient checkpointing, the
attention kernel and its dtypes, FP8, the layers' layout) says how the same weights run and may
change on a loaded model (``RUNTIME_KEYS``). They stay flat keys of one config, because recipes,
saved configs and EasyDeL RayDistributedTrainer's ``CONFIG_VARIABLES`` name them that way; the
layers read placement through one value, :attr:`PlacementConfig.placement`
(:mod:`scaletrain.models.common.placement`), never from the config itself. A family subclasses
:class:`DecoderConfig` and adds what it alone has (Llama's config is
:class:`scaletrain.models.llama.config.LlamaConfig`). Unknown keys are kept (as transformers does) so
configs written by other tools still load; the recipe layer is the strict one.
"""

from __future__ import annotations

import json
import os
from typing import Any, ClassVar

import jax.numpy as jnp
from pydantic import ConfigDict, StrictBool, field_validator, model_validator

from scaletrain.config_keys import ConfigModel
from scaletrain.errors import ConfigError
from scaletrain.models.options import attention_implementation, remat_policy
from scaletrain.models.common.placement import Placement
from scaletrain.parallel.partition import PartitionAxis

DTYPES: dict[str, Any] = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "float64": jnp.float64,
}

# Config fields that change how a model runs (remat, attention kernel and its dtypes), not
# its architecture or weights: the only ones a user may set on top of a pretrained model or
# a loaded checkpoint. The mesh fields (sharding_*, partition_axis) are placement, set apart.
RUNTIME_KEYS = ("gradient_checkpointing", "attn_mechanism", "attn_dtype", "attn_softmax_dtype", "fp8")
# Config fields that lay the same weights out differently (stacked layers): a pretrained model
# takes them when it is loaded; a checkpoint of our own restores only into the layout it was saved in.
LAYOUT_KEYS = ("scan_layers",)


def dtype_name(value: Any) -> str:
    """Canonical string for a dtype given as a string, numpy or jax dtype."""
    if isinstance(value, str):
        name = value.removeprefix("jnp.").removeprefix("jax.numpy.")
        name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "f32": "float32"}.get(name, name)
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {value!r}; use one of {sorted(DTYPES)}")
        return name
    try:
        return jnp.dtype(value).name
    except TypeError as exc:
        raise ValueError(f"not a dtype: {value!r}") from exc


def to_dtype(value: Any) -> Any:
    """The jnp dtype for a name or dtype."""
    return DTYPES[dtype_name(value)]


def at_least_one(value: int | None) -> int | None:
    """A size, count or window of at least 1 (None passes: derived or absent). For validators."""
    if value is not None and value < 1:
        raise ValueError("must be at least 1")
    return value


def positive(value: float | None) -> float | None:
    """A scale or epsilon above 0 (None passes: absent; NaN fails). For validators."""
    if value is not None and not value > 0:
        raise ValueError("must be > 0")
    return value


class PlacementConfig(ConfigModel):
    """How a model runs and where its arrays sit (not what its weights are): EasyDeL RayDistributedTrainer's
    ``CONFIG_VARIABLES`` names. Read by the layers only through :attr:`placement`."""

    model_config = ConfigDict(extra="allow", validate_assignment=True, arbitrary_types_allowed=True)

    gradient_checkpointing: str = "none"
    attn_mechanism: str = "auto"
    attn_dtype: str | None = None
    attn_softmax_dtype: str | None = "float32"
    # FP8 (e4m3/e5m2, current scaling) q/k/v/o and MLP projections: scaletrain.models.kernels.fp8; strict,
    # so a YAML string ("yes") is an error, not True
    fp8: StrictBool = False
    # the decoder layers as one stack with a leading layer axis, run by lax.scan
    # (scaletrain.models.common.scanned_layers): one layer body to compile. EasyDeL's name. It changes the
    # parameters' layout, so a checkpoint restores only into the layout it was saved in
    scan_layers: StrictBool = False
    sharding_axis_names: tuple[str, ...] = ("dp", "fsdp", "ep", "tp", "sp")
    sharding_axis_dims: tuple[int, ...] = (1, -1, 1, 1, 1)
    sharding_dcn_axis_dims: tuple[int, ...] | None = None
    partition_axis: PartitionAxis = PartitionAxis()


    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _remat_name(cls, value: Any) -> str:
        # any accepted name (or str enum member) is stored as the policy it runs here (models/options.py)
        return remat_policy(value)

    @field_validator("attn_mechanism", mode="before")
    @classmethod
    def _attention_name(cls, value: Any) -> str:
        # any accepted name (or str enum member) is stored as the kernel choice it runs here
        return attention_implementation(value)

    @field_validator("attn_dtype", "attn_softmax_dtype", mode="before")
    @classmethod
    def _dtype_str(cls, value: Any) -> Any:
        return None if value is None else dtype_name(value)

    @property
    def placement(self) -> Placement:
        """The placement fields as one frozen value: what the forward makes active for its layers."""
        return Placement.of(self)


class DecoderConfig(PlacementConfig):
    """The architecture keys every decoder family shares (a transformers ``config.json``'s names), on top of
    :class:`PlacementConfig`'s placement keys. ``model_type`` is the family's (each family sets its own)."""

    model_type: ClassVar[str] = "decoder"
    #: MLP activations (``hidden_act``) the family's modules compute; Gemma 3's is gelu-tanh.
    activations: ClassVar[tuple[str, ...]] = ("silu", "swish")

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    # per-head RMSNorm on queries and keys before RoPE (Qwen3; HF names self_attn.q_norm / k_norm)
    qk_norm: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    @model_validator(mode="after")
    def _fill_defaults(self) -> DecoderConfig:
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.hidden_act not in self.activations:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (only {' or '.join(self.activations)})")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("linear", "llama3", "yarn", "default"):
                raise ValueError(f"rope_scaling type {kind!r} is not supported (linear, llama3, yarn)")
        return self

    @field_validator("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", mode="after")
    @classmethod
    def _at_least_one(cls, value: int | None) -> int | None:
        # None: derived (head_dim, num_key_value_heads) or no window. A window of 0 would let each
        # token see only itself, and a size of 0 fails far from its cause (or not at all)
        return at_least_one(value)

    @field_validator("rms_norm_eps", "rope_theta", mode="after")
    @classmethod
    def _positive(cls, value: float) -> float:
        return positive(value)

    # ---- derived quantities -------------------------------------------------
    def attention_window(self) -> int | None:
        """The attention window the model applies (None: none); Qwen2's family windows only when asked."""
        return self.sliding_window

    @property
    def num_params(self) -> int:
        """Parameter count, including embeddings (and the LM head unless tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias or self.qkv_bias:
            attn += q + 2 * kv + (h if self.attention_bias else 0)  # o_proj's bias is [hidden]
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        layer = attn + mlp + 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        head = 0 if self.tie_word_embeddings else h * v
        return v * h + self.num_hidden_layers * layer + h + head

    @property
    def num_active_params(self) -> int:
        """Parameters each token computes with: all of them in a dense model (MoE configs override)."""
        return self.num_params

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x matmul parameters plus causal attention.

        The matmul parameters exclude the input embedding lookup but include the
        LM head. Attention scores and the weighted sum cost ``2 * 2 * seq * q_dim``
        forward per layer, halved for the causal mask, tripled for the backward.
        Only the parameters a token passes through count (a mixture of experts' active ones).
        """
        matmul_params = self.num_active_params - self.vocab_size * self.hidden_size
        if self.tie_word_embeddings:
            matmul_params += self.vocab_size * self.hidden_size
        q_dim = self.num_attention_heads * self.head_dim
        attn = 6 * self.num_hidden_layers * seq_len * q_dim
        return 6.0 * matmul_params + attn

    # ---- persistence --------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict, with ``model_type`` (a transformers config.json superset)."""
        out = self.model_dump(mode="json")
        out["model_type"] = self.model_type
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DecoderConfig:
        data = {k: v for k, v in data.items() if k != "model_type"}
        return cls(**data)

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)


def check_config_keys(config_class: type[DecoderConfig], keys: set[str], where: str) -> None:
    """Raise ConfigError naming any key that ``config_class`` does not define."""
    unknown = sorted(k for k in keys if k not in config_class.model_fields and k != "model_type")
    if unknown:
        raise ConfigError(
            f"{where}: unknown model config key(s) {unknown}; known keys are "
            f"{sorted(config_class.model_fields)}"
        )
