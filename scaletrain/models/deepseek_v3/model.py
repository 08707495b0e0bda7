"""DeepSeek-V3's decoder (and GLM-4.5's, which swaps the attention): pre-norm blocks whose first
``first_k_dense_replace`` layers have a dense MLP and the rest a shared-expert MoE block.

Every layer returns router statistics (a dense layer's are zero, with no rows), so the
statistics stack over all layers as the objective and the logged per-expert loads read them.
The static engine's decode cache is one key/value pair per layer, as wide as the family's attention makes
them (multi-head latent attention: per-head keys of ``nope + rope`` dims and values of ``v_head_dim``); the
continuous engine's pages hold DeepSeek-V3's compressed latent instead (keys-only caches).
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.common.decoder import Cache, CausalLM, DecoderModel
from scaletrain.models.common.dense import RMSNorm
from scaletrain.models.common.inputs import LayerInputs
from scaletrain.models.common.latent_attention import LatentAttention
from scaletrain.models.common.layers import MLP
from scaletrain.models.common.moe import RouterStats
from scaletrain.models.common.moe_decoder import ROUTER
from scaletrain.models.common.scanned_layers import StackedLayers
from scaletrain.models.common.shared_moe import SharedExpertMoe, empty_stats
from scaletrain.models.deepseek_v3.config import DeepseekV3Config, RoutedMoeConfig
from scaletrain.models.kernels.attention import KVCache
from scaletrain.models.kernels.paged_attention import PagedKVCache
from scaletrain.models.task import BASE_MODULE

Array = jax.Array


class RoutedMoeLayer(nnx.Module):
    """Pre-norm residual block: ``attention_class``, then a dense MLP (the first layers) or the MoE block."""

    attention_class: ClassVar[type[nnx.Module]] = LatentAttention

    def __init__(self, config: RoutedMoeConfig, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs,
                 dense: bool = False):
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, dtype, param_dtype)
        self.self_attn = self.attention_class(config, dtype, param_dtype, precision, rngs)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, dtype, param_dtype)
        if dense:
            self.mlp: nnx.Module = MLP(config, dtype, param_dtype, precision, rngs)
        else:
            self.mlp = SharedExpertMoe(config, config.n_routed_experts, config.moe_intermediate_size,
                                       config.n_shared_experts * config.moe_intermediate_size, dtype=dtype,
                                       param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.dense = dense
        self.num_experts = config.n_routed_experts

    @classmethod
    def aux_shapes(cls, config: RoutedMoeConfig) -> dict[str, RouterStats]:
        """One layer's router statistics (zeros for a dense layer)."""
        return {ROUTER: jax.eval_shape(lambda: empty_stats(config.n_routed_experts))}

    def __call__(self, x: Array, inputs: LayerInputs,
                 cache: KVCache | None = None) -> tuple[Array, dict[str, RouterStats], KVCache | None]:
        attn, cache = self.self_attn(self.input_layernorm(x), inputs, cache)
        x = x + attn
        h = self.post_attention_layernorm(x)
        if self.dense:
            return x + self.mlp(h), {ROUTER: empty_stats(self.num_experts)}, cache
        out, stats = self.mlp(h, inputs.valid)
        return x + out, {ROUTER: stats}, cache


class RoutedMoeModel(DecoderModel):
    """Embeddings, decoder layers (dense first, then MoE) and the final norm (HF's ``model.*`` names)."""

    _model_type: ClassVar[str | None] = None
    _model_task: ClassVar[str] = BASE_MODULE
    layer_class: ClassVar[type[nnx.Module]] = RoutedMoeLayer

    def build_layer(self, index: int, config: DecoderConfig, dtype: Any, param_dtype: Any, precision: Any,
                    rngs: nnx.Rngs) -> nnx.Module:
        return self.layer_class(config, dtype, param_dtype, precision, rngs, dense=config.is_dense(index))


class RoutedMoeForCausalLM(CausalLM):
    """The decoder with its head; the cache's key and value widths are the attention's."""

    base_model_class: ClassVar[type[DecoderModel]] = RoutedMoeModel

    def cache_shapes(self, batch_size: int, max_length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One layer's key and value cache shapes."""
        cfg = self.config
        shape = (batch_size, max_length, cfg.num_key_value_heads, cfg.head_dim)
        return shape, shape

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> Cache:
        """Empty per-layer key/value caches of ``max_length`` slots (see :meth:`CausalLM.init_cache`)."""
        dtype = self.dtype if dtype is None else dtype
        keys, values = self.cache_shapes(batch_size, max_length)
        layers = self.config.num_hidden_layers
        if isinstance(self.model.layers, StackedLayers):
            return KVCache(jnp.zeros((layers, *keys), dtype), jnp.zeros((layers, *values), dtype))
        return [KVCache(jnp.zeros(keys, dtype), jnp.zeros(values, dtype)) for _ in range(layers)]


class DeepseekV3ForCausalLM(RoutedMoeForCausalLM):
    """DeepSeek-V3 (DeepSeek-R1, Kimi K2): multi-head latent attention, shared-expert MoE, dense first layers."""

    config_class: ClassVar[type[DecoderConfig]] = DeepseekV3Config

    def cache_shapes(self, batch_size: int, max_length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return LatentAttention.cache_shapes(self.config, batch_size, max_length)

    def _latent(self, shape: tuple[int, ...], dtype: Any, wrap: type) -> Cache:
        """Keys-only latent caches (``values`` None) of ``shape + (1, latent width)`` per layer."""
        dtype = self.dtype if dtype is None else dtype
        entry = (*shape, 1, LatentAttention.latent_width(self.config))
        layers = self.config.num_hidden_layers
        if isinstance(self.model.layers, StackedLayers):
            return wrap(jnp.zeros((layers, *entry), dtype), None)
        return [wrap(jnp.zeros(entry, dtype), None) for _ in range(layers)]

    def init_prefill_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> Cache:
        """The latent cache a prompt is prefilled into: what the continuous engine's pages hold (the module
        docstring of :mod:`~scaletrain.models.common.latent_attention`)."""
        return self._latent((batch_size, max_length), dtype, KVCache)

    def init_paged_cache(self, slots: int, num_pages: int, page_size: int, dtype: Any = None) -> Cache:
        """One page pool of latent entries per layer, [num_pages, page_size, 1, kv_lora_rank + rope]."""
        return self._latent((num_pages, page_size), dtype, PagedKVCache)
