"""Mixture-of-experts configs (Mixtral, Qwen3-MoE) and their config.json mappings.

Field names are transformers' keys. What the two add to the dense configs: the
number of experts and of experts per token, the experts' hidden size, whether the
chosen router probabilities are renormalised, and the coefficients of the router
losses. ``router_aux_loss_coef`` is transformers'; ``router_z_loss_coef`` (ST-MoE's
router z-loss, 0 by default since no transformers config has one) is ours and is
not written to config.json. Both losses are always computed and logged; unlike
transformers, which adds the balancing loss only when ``output_router_logits`` is
set, the training objective always includes ``router_aux_loss_coef * aux_loss``
(set the coefficient to 0 to train without it).

Options we do not implement are refused by key: router jitter noise (training
noise on the router input), Qwen3-MoE layers with a dense MLP
(``decoder_sparse_step`` other than 1, ``mlp_only_layers``), shared experts.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import field_validator, model_validator

from scaletrain.errors import ConfigError
from scaletrain.models.config import LlamaConfig, Qwen3Config, at_least_one
from scaletrain.models.hf_family import HFFamily, Refuse, base_fields, base_hf_kwargs, check_silu

#: keys of other MoE families' configs that would add shared experts we do not compute
_SHARED_EXPERT_KEYS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")


def _moe_params(config: Any, experts: int) -> int:
    """``num_params`` with each layer's dense MLP replaced by a router and ``experts`` SwiGLU experts."""
    h, n = config.hidden_size, config.num_hidden_layers
    dense_mlp = 3 * h * config.intermediate_size
    moe = experts * 3 * h * config.expert_intermediate_size + h * config.num_experts
    return LlamaConfig.num_params.fget(config) + n * (moe - dense_mlp)  # type: ignore[attr-defined]


class _MoeParamCounts:
    """The total and active parameter counts of both MoE configs (listed first among the bases, so
    these override the dense ``num_params``); the FLOPs per token follow the active count."""

    @property
    def num_params(self) -> int:
        return _moe_params(self, self.num_experts)  # type: ignore[attr-defined]

    @property
    def num_active_params(self) -> int:
        return _moe_params(self, self.num_experts_per_tok)  # type: ignore[attr-defined]


def _check_moe(config: Any) -> None:
    if not 1 <= config.num_experts_per_tok <= config.num_experts:
        raise ValueError(f"num_experts_per_tok {config.num_experts_per_tok} must be between 1 and the "
                         f"number of experts ({config.num_experts})")
    if config.mlp_bias:
        raise ValueError("mlp_bias: the experts of a mixture of experts have no biases")
    for key in _SHARED_EXPERT_KEYS:
        if getattr(config, key, None):
            raise ValueError(f"{key}: shared experts are not supported (Mixtral and Qwen3-MoE have none)")


class MixtralConfig(_MoeParamCounts, LlamaConfig):
    """Mixtral: Mistral attention, every MLP a top-``num_experts_per_tok`` of ``num_local_experts`` SwiGLUs."""

    model_type: ClassVar[str] = "mixtral"
    #: the decoder layer's attribute for its MoE block and the experts' (gate, up, down) tensor
    #: names: transformers' on-disk names (``block_sparse_moe.experts.<e>.w1.weight``, ...)
    moe_block_name: ClassVar[str] = "block_sparse_moe"
    expert_names: ClassVar[tuple[str, str, str]] = ("w1", "w3", "w2")

    intermediate_size: int = 14336
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1000000.0
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0
    router_jitter_noise: float = 0.0

    @model_validator(mode="after")
    def _moe(self) -> MixtralConfig:
        _check_moe(self)
        if self.router_jitter_noise:
            raise ValueError(f"router_jitter_noise={self.router_jitter_noise} is not supported (only 0): "
                             "scaletrain does not add noise to the router's input")
        return self

    @property
    def num_experts(self) -> int:
        return self.num_local_experts

    @property
    def expert_intermediate_size(self) -> int:
        return self.intermediate_size

    @property
    def normalize_top_k(self) -> bool:
        """Mixtral always renormalises the chosen experts' probabilities."""
        return True


class Qwen3MoeConfig(_MoeParamCounts, Qwen3Config):
    """Qwen3-MoE: Qwen3 attention (per-head q/k norms), every MLP a top-k of many small SwiGLU experts."""

    model_type: ClassVar[str] = "qwen3_moe"
    moe_block_name: ClassVar[str] = "mlp"
    expert_names: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 24
    num_key_value_heads: int | None = 4
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = []
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0

    @field_validator("moe_intermediate_size", mode="after")
    @classmethod
    def _expert_width(cls, value: int) -> int:
        return at_least_one(value)

    @model_validator(mode="after")
    def _moe(self) -> Qwen3MoeConfig:
        _check_moe(self)
        if self.decoder_sparse_step != 1:
            raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step} is not supported (only 1): "
                             "layers with a dense MLP between the MoE layers are not implemented")
        if self.mlp_only_layers:
            raise ValueError(f"mlp_only_layers={self.mlp_only_layers} is not supported (only []): "
                             "layers with a dense MLP are not implemented")
        return self

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size

    @property
    def normalize_top_k(self) -> bool:
        return self.norm_topk_prob


# ---------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------
def _check_moe_hf(hf: Any, where: str) -> None:
    """Refuse what neither MoE family computes: a non-SiLU activation, shared experts."""
    check_silu(hf, where)
    for key in _SHARED_EXPERT_KEYS:
        if getattr(hf, key, None):
            raise ConfigError(f"{where}: {key}={getattr(hf, key)}: shared experts are not supported")


def _moe_fields(source: Any, expert_keys: tuple[str, ...]) -> dict[str, Any]:
    """What both MoE families read from config.json and write to it alike: SiLU experts, how many a
    token takes, the balancing loss's coefficient, and the family's own expert-size ``expert_keys``
    (the same names in config.json and in our config)."""
    keys = (*expert_keys, "num_experts_per_tok", "router_aux_loss_coef")
    return {"hidden_act": "silu", **{key: getattr(source, key) for key in keys}}


def _mixtral_from_hf(hf: Any, where: str) -> dict[str, Any]:
    _check_moe_hf(hf, where)
    if hf.router_jitter_noise:
        raise ConfigError(f"{where}: router_jitter_noise={hf.router_jitter_noise} is not supported (only 0)")
    return {**base_fields(hf, where), **_moe_fields(hf, ("num_local_experts",)), "attention_bias": False,
            "qkv_bias": False, "mlp_bias": False, "sliding_window": hf.sliding_window}


def _mixtral_to_hf(config: LlamaConfig, refuse: Refuse) -> dict[str, Any]:
    if config.attention_bias or config.qkv_bias or config.qk_norm:
        raise refuse("attention biases or q/k norms")
    return {**base_hf_kwargs(config), **_moe_fields(config, ("num_local_experts",)),
            "sliding_window": config.sliding_window, "router_jitter_noise": 0.0}


def _qwen3_moe_from_hf(hf: Any, where: str) -> dict[str, Any]:
    _check_moe_hf(hf, where)
    for key, ok in (("decoder_sparse_step", hf.decoder_sparse_step == 1), ("mlp_only_layers", not hf.mlp_only_layers)):
        if not ok:
            raise ConfigError(f"{where}: {key}={getattr(hf, key)!r} is not supported (layers with a dense MLP "
                              "are not implemented; only decoder_sparse_step 1 and mlp_only_layers [])")
    window = hf.sliding_window if hf.use_sliding_window else None
    return {**base_fields(hf, where), **_moe_fields(hf, ("num_experts", "moe_intermediate_size")),
            "qkv_bias": False, "mlp_bias": False, "attention_bias": bool(hf.attention_bias), "qk_norm": True,
            "use_sliding_window": window is not None, "sliding_window": window,
            "norm_topk_prob": bool(hf.norm_topk_prob)}


def _qwen3_moe_to_hf(config: LlamaConfig, refuse: Refuse) -> dict[str, Any]:
    if not config.qk_norm or config.qkv_bias:
        raise refuse("qk_norm=False or q/k/v-only biases")
    sliding = bool(config.use_sliding_window) and config.sliding_window is not None
    return {**base_hf_kwargs(config), **_moe_fields(config, ("num_experts", "moe_intermediate_size")),
            "attention_bias": config.attention_bias, "use_sliding_window": sliding,
            "sliding_window": config.sliding_window if sliding else None, "norm_topk_prob": config.norm_topk_prob,
            "decoder_sparse_step": 1, "mlp_only_layers": []}


MOE_FAMILIES: tuple[HFFamily, ...] = (
    HFFamily("mixtral", "MixtralForCausalLM", "MixtralConfig", MixtralConfig, _mixtral_from_hf, _mixtral_to_hf),
    HFFamily("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", Qwen3MoeConfig, _qwen3_moe_from_hf,
             _qwen3_moe_to_hf),
)
