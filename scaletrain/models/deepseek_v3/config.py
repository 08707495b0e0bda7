"""DeepSeek-V3's config (also DeepSeek-R1's and Kimi K2's checkpoints), and the routed-experts keys GLM-4.5 shares.

Field names are transformers' keys. :class:`RoutedMoeConfig` holds what DeepSeek-V3 and GLM-4.5
share: ``n_routed_experts`` experts of width ``moe_intermediate_size`` chosen by sigmoid
group-limited routing with the correction bias (``n_group``, ``topk_group``, ``norm_topk_prob``,
``routed_scaling_factor``), ``n_shared_experts`` always-on experts, and the first
``first_k_dense_replace`` layers dense (an MLP of ``intermediate_size``). Neither family has an
auxiliary loss: ``router_aux_loss_coef`` (0) and ``router_z_loss_coef`` (0) are ours, kept so the
router statistics can be turned into the usual losses when asked. ``router_bias_update_rate`` (ours, 0:
off) is DeepSeek's auxiliary-loss-free balancing: after each optimizer step every layer's correction bias
moves by that rate toward balance (:mod:`scaletrain.training.router_bias`). :class:`DeepseekV3Config` adds
multi-head latent attention (:mod:`scaletrain.models.common.latent_attention`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import StrictBool, field_validator, model_validator

from scaletrain.errors import ConfigError
from scaletrain.models.common.config import DecoderConfig, at_least_one
from scaletrain.models.common.routing import routing_problem


class RoutedMoeConfig(DecoderConfig):
    """The routed + shared experts and the dense first layers of DeepSeek-V3 and GLM-4.5 (module docstring)."""

    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    norm_topk_prob: StrictBool = True
    routed_scaling_factor: float = 1.0
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    # DeepSeek-V3's bias update speed (its report's gamma, 0.001 for most of its pre-training); 0 leaves the bias
    # where the checkpoint put it. Ours, not a transformers key: not written to config.json
    router_bias_update_rate: float = 0.0
    # multi-token-prediction layers a checkpoint carries after the decoder's (transformers' num_mtp_layers):
    # not computed, their tensors left out on load, as transformers leaves them out
    num_nextn_predict_layers: int = 0

    @field_validator("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
                     mode="after")
    @classmethod
    def _moe_at_least_one(cls, value: int) -> int:
        return at_least_one(value)

    @model_validator(mode="after")
    def _routing(self) -> RoutedMoeConfig:
        if problem := routing_problem(self.n_routed_experts, self.num_experts_per_tok, self.n_group,
                                      self.topk_group):
            raise ValueError(problem)
        if not self.router_bias_update_rate >= 0:  # NaN too
            raise ValueError(f"router_bias_update_rate {self.router_bias_update_rate} must be at least 0 (0 is off)")
        if self.n_shared_experts < 0 or self.first_k_dense_replace < 0:
            raise ValueError("n_shared_experts and first_k_dense_replace must be at least 0")
        if self.mlp_bias:
            raise ValueError("mlp_bias: the experts of a mixture of experts have no biases")
        if self.scan_layers and 0 < self.first_k_dense_replace < self.num_hidden_layers:
            # raised as it is (a ValueError pydantic would wrap in lines of its own)
            raise ConfigError(f"scan_layers: true is not supported for {self.model_type} with "
                              f"first_k_dense_replace={self.first_k_dense_replace}: its dense first layers differ "
                              "from the MoE layers, so the layers do not stack; set scan_layers: false")
        return self

    def ignored_tensor(self, name: str) -> bool:
        """Whether a checkpoint tensor belongs to a multi-token-prediction layer (``model.layers.<L + i>.*``)."""
        first = self.num_hidden_layers
        return any(name.startswith(f"model.layers.{first + i}.") for i in range(self.num_nextn_predict_layers))

    # the MoE block reads these names (SharedExpertMoe, BiasRouter)
    @property
    def num_experts(self) -> int:
        return self.n_routed_experts

    def is_dense(self, index: int) -> bool:
        """Whether layer ``index`` has a dense MLP rather than experts."""
        return index < self.first_k_dense_replace

    def attention_params(self) -> int:
        """One layer's attention parameters: grouped-query attention here (GLM-4.5)."""
        h, q = self.hidden_size, self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        biases = (q + 2 * kv if self.attention_bias or self.qkv_bias else 0) + (h if self.attention_bias else 0)
        return 2 * h * q + 2 * h * kv + biases + (2 * self.head_dim if self.qk_norm else 0)

    def _mlp_params(self, experts: int) -> tuple[int, int]:
        """``(dense layer's MLP, MoE layer's block)`` parameters with ``experts`` routed experts counted."""
        h, e = self.hidden_size, self.n_routed_experts
        swiglu = 3 * h * self.moe_intermediate_size
        return 3 * h * self.intermediate_size, h * e + e + experts * swiglu + self.n_shared_experts * swiglu

    def _count(self, experts: int) -> int:
        dense, moe = self._mlp_params(experts)
        layers = self.num_hidden_layers
        dense_layers = min(self.first_k_dense_replace, layers)
        per_layer = self.attention_params() + 2 * self.hidden_size
        head = 0 if self.tie_word_embeddings else self.hidden_size * self.vocab_size
        return (self.vocab_size * self.hidden_size + head + self.hidden_size + layers * per_layer
                + dense_layers * dense + (layers - dense_layers) * moe)

    @property
    def num_params(self) -> int:
        return self._count(self.n_routed_experts)

    @property
    def num_active_params(self) -> int:
        return self._count(self.num_experts_per_tok)


class DeepseekV3Config(RoutedMoeConfig):
    """DeepSeek-V3: multi-head latent attention, sigmoid group-limited routing, shared experts, dense first layers.

    ``head_dim`` is the RoPE part of a head (``qk_rope_head_dim``), as transformers sets it: the
    RoPE tables are that wide.
    """

    model_type: ClassVar[str] = "deepseek_v3"

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    max_position_embeddings: int = 4096
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    rope_interleave: StrictBool = True
    n_group: int = 8
    topk_group: int = 4
    first_k_dense_replace: int = 3
    routed_scaling_factor: float = 2.5

    @field_validator("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank",
                     mode="after")
    @classmethod
    def _mla_at_least_one(cls, value: int | None) -> int | None:
        return at_least_one(value)

    @model_validator(mode="before")
    @classmethod
    def _rope_head(cls, data: Any) -> Any:
        # the RoPE tables cover the rotated part of each head only; every head has its own keys and values
        if isinstance(data, dict):
            data = {**data, "head_dim": data.get("qk_rope_head_dim", 64)}
            data["num_key_value_heads"] = data.get("num_attention_heads", 128)
        return data

    def attention_params(self) -> int:
        h, n = self.hidden_size, self.num_attention_heads
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = self.attention_bias
        rank = self.q_lora_rank
        q = h * n * qk if rank is None else h * rank + rank + rank * n * qk + (rank if bias else 0)
        kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim) + (self.kv_lora_rank + self.qk_rope_head_dim
                                                                   if bias else 0)
        kv = kv_a + self.kv_lora_rank + self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + n * self.v_head_dim * h + (h if bias else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """6 x active matmul parameters plus causal attention over ``nope + rope`` query/key and ``v`` value dims."""
        matmul_params = self.num_active_params - self.vocab_size * self.hidden_size
        if self.tie_word_embeddings:
            matmul_params += self.vocab_size * self.hidden_size
        dims = self.num_attention_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim) / 2
        return 6.0 * matmul_params + 6 * self.num_hidden_layers * seq_len * dims
