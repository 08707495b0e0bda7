"""What the mixture-of-experts configs (Mixtral, Qwen3-MoE) share, and their config.json helpers.

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

from typing import Any

from pydantic import model_validator

from scaletrain.errors import ConfigError
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.hf_family import check_silu

#: keys of other MoE families' configs that would add shared experts we do not compute
_SHARED_EXPERT_KEYS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")


def _moe_params(config: Any, experts: int) -> int:
    """``num_params`` with each layer's dense MLP replaced by a router and ``experts`` SwiGLU experts."""
    h, n = config.hidden_size, config.num_hidden_layers
    dense_mlp = 3 * h * config.intermediate_size
    moe = experts * 3 * h * config.expert_intermediate_size + h * config.num_experts
    return DecoderConfig.num_params.fget(config) + n * (moe - dense_mlp)  # type: ignore[attr-defined]


class MoeConfigMixin:
    """What both MoE configs add to their dense base (listed first among the bases, so these
    override the dense ``num_params``): the total and active parameter counts (the FLOPs per
    token follow the active count) and the one validator of the MoE options (:func:`check_moe`)."""

    @model_validator(mode="after")
    def _moe(self) -> Any:
        check_moe(self)
        return self

    @property
    def num_params(self) -> int:
        return _moe_params(self, self.num_experts)  # type: ignore[attr-defined]

    @property
    def num_active_params(self) -> int:
        return _moe_params(self, self.num_experts_per_tok)  # type: ignore[attr-defined]


def unsupported_moe_option(source: Any) -> str | None:
    """What of a mixture-of-experts config (ours or transformers') we do not compute, said by key, or None.

    One list for both doors: our configs' validators raise it as a ValueError, the
    config.json reader (:func:`_check_moe_hf`) as a ConfigError naming the file.
    """
    for key in _SHARED_EXPERT_KEYS:
        if getattr(source, key, None):
            return f"{key}={getattr(source, key)}: shared experts are not supported (Mixtral and Qwen3-MoE have none)"
    if getattr(source, "router_jitter_noise", 0.0):
        return (f"router_jitter_noise={source.router_jitter_noise} is not supported (only 0): "
                "scaletrain does not add noise to the router's input")
    if getattr(source, "decoder_sparse_step", 1) != 1:
        return (f"decoder_sparse_step={source.decoder_sparse_step} is not supported (only 1): "
                "layers with a dense MLP between the MoE layers are not implemented")
    if getattr(source, "mlp_only_layers", None):
        return (f"mlp_only_layers={source.mlp_only_layers} is not supported (only []): "
                "layers with a dense MLP are not implemented")
    return None


def check_moe(config: Any) -> None:
    if not 1 <= config.num_experts_per_tok <= config.num_experts:
        raise ValueError(f"num_experts_per_tok {config.num_experts_per_tok} must be between 1 and the "
                         f"number of experts ({config.num_experts})")
    if config.mlp_bias:
        raise ValueError("mlp_bias: the experts of a mixture of experts have no biases")
    if problem := unsupported_moe_option(config):
        raise ValueError(problem)


# ---------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------
def check_moe_hf(hf: Any, where: str) -> None:
    """Refuse what neither MoE family computes: a non-SiLU activation, :func:`unsupported_moe_option`."""
    check_silu(hf, where)
    if problem := unsupported_moe_option(hf):
        raise ConfigError(f"{where}: {problem}")


def moe_fields(source: Any, expert_keys: tuple[str, ...]) -> dict[str, Any]:
    """What both MoE families read from config.json and write to it alike: SiLU experts, how many a
    token takes, the balancing loss's coefficient, and the family's own expert-size ``expert_keys``
    (the same names in config.json and in our config)."""
    keys = (*expert_keys, "num_experts_per_tok", "router_aux_loss_coef")
    return {"hidden_act": "silu", **{key: getattr(source, key) for key in keys}}
