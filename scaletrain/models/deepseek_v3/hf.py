"""config.json <-> our configs for DeepSeek-V3 and GLM-4.5: the routed-experts keys both write alike.

The keys are transformers' own, so most travel unchanged; what we refuse is said by key in one
line naming the file (an activation other than SiLU, routing that cannot route, such as
``n_routed_experts`` not divisible by ``n_group``).
"""

from __future__ import annotations

from typing import Any

from scaletrain.errors import ConfigError
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.common.routing import routing_problem
from scaletrain.models.hf_family import base_fields, base_hf_kwargs, check_silu

#: the routed-experts keys, the same names in config.json and in our configs
MOE_KEYS = ("moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
            "topk_group", "first_k_dense_replace", "norm_topk_prob", "routed_scaling_factor")


def routed_moe_fields(hf: Any, where: str, *, rope: bool = True) -> dict[str, Any]:
    """Our fields for a DeepSeek-V3 or GLM-4.5 transformers config: the shared decoder keys and the MoE keys."""
    check_silu(hf, where)
    fields = {**base_fields(hf, where, rope=rope), **{key: getattr(hf, key) for key in MOE_KEYS}}
    fields["n_group"], fields["topk_group"] = fields["n_group"] or 1, fields["topk_group"] or 1
    fields["norm_topk_prob"] = bool(fields["norm_topk_prob"])
    fields["num_nextn_predict_layers"] = int(getattr(hf, "num_mtp_layers", 0) or 0)
    if problem := routing_problem(fields["n_routed_experts"], fields["num_experts_per_tok"], fields["n_group"],
                                  fields["topk_group"]):
        raise ConfigError(f"{where}: {problem}")
    return fields


def routed_moe_kwargs(config: DecoderConfig, *, rope: bool = True) -> dict[str, Any]:
    """The transformers config keywords of :func:`routed_moe_fields`."""
    # the multi-token-prediction layers are not exported (never loaded): the folder declares none
    return {**base_hf_kwargs(config, rope=rope), "hidden_act": "silu", "num_mtp_layers": 0,
            **{key: getattr(config, key) for key in MOE_KEYS}}
