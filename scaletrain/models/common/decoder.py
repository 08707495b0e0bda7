"""The one causal decoder every family runs: embedding, input preparation, the layer loop, the final
norm, the head and its soft-cap, with **one forward** that takes an optional KV cache.

A family supplies a config class, a block (its decoder layer) and a norm, and sets hooks
where it differs: :meth:`CausalLM.layer_kinds` (each layer's window and RoPE),
:meth:`CausalLM.embedding_scale`, :meth:`CausalLM.logit_softcap`. A block's call is
``block(x, inputs, cache) -> (x, aux, cache)``: ``aux`` is a dict of its auxiliary outputs
(``{}`` for a dense block, ``{"router": RouterStats}`` for a mixture of experts), stacked
over the layers by the forward. Training, evaluation and generation all run
:meth:`CausalLM.forward`; parameter paths are Hugging Face's (``model.embed_tokens``,
``model.layers.<i>...``, ``model.norm``, ``lm_head``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec

from scaletrain.errors import ConfigError
from scaletrain.models.kernels.attention import KVCache
from scaletrain.models.kernels.paged_attention import PagedKVCache, PageTable
from scaletrain.models.common.inputs import LayerKind, PreparedInputs, cache_inputs, paged_inputs, training_inputs
from scaletrain.models.common.layer_loop import by_kind, loop_layers
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.common.layer_types import layer_kinds
from scaletrain.models.kernels.cpu_dots import matmul
from scaletrain.models.common.dense import Dense, RMSNorm, _init
from scaletrain.models.common.placement import active_placement, use_placement
from scaletrain.models.common.unrolled_layers import build_layers
from scaletrain.models.common.remat import run_layer
from scaletrain.models.common.scanned_layers import StackedLayers
from scaletrain.models.task import BASE_MODULE, CAUSAL_LM
from scaletrain.parallel.partition import active_sharding_axes

Array = jax.Array
Cache = list[KVCache] | KVCache


def constrain(x: Array, spec: tuple[Any, ...]) -> Array:
    """Shard an activation when a mesh is active (a no-op outside ``jax.set_mesh``).

    Mesh axes that are absent, of size 1, or that do not divide the dimension are
    dropped, so a batch of 1 (generation) still runs on an 8-way mesh.
    """
    if jax.sharding.get_abstract_mesh().empty:
        return x
    parts = [active_sharding_axes(axes, dim) or None for dim, axes in zip(x.shape, spec)]
    return lax.with_sharding_constraint(x, PartitionSpec(*parts))


class DecoderModel(nnx.Module):
    """Embeddings, decoder layers and the final norm (``model.*``); a family sets ``layer_class`` and
    ``norm_class``."""

    _model_type: ClassVar[str | None] = None
    _model_task: ClassVar[str] = BASE_MODULE
    config_class: ClassVar[type[DecoderConfig]] = DecoderConfig
    layer_class: ClassVar[type[nnx.Module]]
    norm_class: ClassVar[type[nnx.Module]] = RMSNorm

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # EasyDeL reads `_model_type` from the class: the config class's, so a family spells it once
        super().__init_subclass__(**kwargs)
        if "_model_type" not in cls.__dict__:
            cls._model_type = cls.config_class.model_type

    def __init__(self, config: DecoderConfig, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Param(
            _init(config)(rngs.params(), (config.vocab_size, config.hidden_size), param_dtype),
            logical_axes=("vocab", "embed"),
        )
        # each layer from its own key: identical layers share one compiled initialiser (unrolled_layers)
        build = lambda i, r: self.build_layer(i, config, dtype, param_dtype, precision, r)  # noqa: E731
        self.layers = (StackedLayers(build, config.num_hidden_layers, rngs.params()) if config.scan_layers
                       else build_layers(build, config.num_hidden_layers, rngs))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps, dtype, param_dtype)
        self.dtype = dtype

    def build_layer(self, index: int, config: DecoderConfig, dtype: Any, param_dtype: Any, precision: Any,
                    rngs: nnx.Rngs) -> nnx.Module:
        """Decoder layer ``index``: ``layer_class`` for every index here; a hybrid family (Qwen3.5's linear
        and full-attention layers) builds each index as its kind."""
        return self.layer_class(config, dtype, param_dtype, precision, rngs)


class CausalLM(nnx.Module):
    """A decoder with its language-model head; ``__call__`` returns logits in the compute ``dtype``."""

    _model_type: ClassVar[str | None] = None
    _model_task: ClassVar[str] = CAUSAL_LM
    config_class: ClassVar[type[DecoderConfig]] = DecoderConfig
    #: the embeddings, layers and final norm (``model.*``): what a family changes
    base_model_class: ClassVar[type[DecoderModel]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # EasyDeL reads `_model_type` from the class: the config class's, so a family spells it once
        super().__init_subclass__(**kwargs)
        if "_model_type" not in cls.__dict__:
            cls._model_type = cls.config_class.model_type

    def __init__(self, config: DecoderConfig, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
                 precision: Any = None, *, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        self.precision = precision
        self.model = self.base_model_class(config, self.dtype, self.param_dtype, precision, rngs)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Dense(config.hidden_size, config.vocab_size, ("embed", "vocab"), use_bias=False, config=config,
                       dtype=self.dtype, param_dtype=self.param_dtype, precision=precision, rngs=rngs)
        )

    # -- family hooks -----------------------------------------------------------------
    def layer_kinds(self) -> tuple[tuple[LayerKind, ...], list[int]]:
        """The distinct kinds of layer (window, RoPE) and each layer's index into them: one kind, or one per
        distinct (type, window, RoPE) of a config with ``layer_types`` (:mod:`~scaletrain.models.common.layer_types`)."""
        return layer_kinds(self.config)

    def embedding_scale(self) -> float | None:
        """A factor the embeddings are multiplied by (cast to the compute dtype first), or None."""
        return None

    def logit_softcap(self) -> float | None:
        """``c`` if logits are soft-capped to ``c * tanh(logits / c)`` (Gemma): the chunked loss caps them too."""
        return None

    def aux_shapes(self) -> dict[str, Any]:
        """The shapes and dtypes of :meth:`hidden_states_and_aux`' auxiliary outputs (leading axis: the
        layer), known without tracing the forward (the train step sizes its accumulation sums from them)."""
        layers = self.config.num_hidden_layers
        per_layer = self.base_model_class.layer_class.aux_shapes(self.config)
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct((layers, *s.shape), s.dtype), per_layer)

    # -- the forward --------------------------------------------------------------
    def forward(self, prepared: PreparedInputs, cache: Cache | None = None) -> tuple[Array, dict[str, Any],
                                                                                      Cache | None]:
        """Final-norm hidden states [B, T, hidden] (in row order), the blocks' auxiliary outputs stacked
        over the layers, and the updated cache (None without one).

        Without a cache the layers are rematerialised as ``config.gradient_checkpointing`` says and
        the activations constrained to the mesh's batch and sequence axes; with one (decoding) neither.
        The config's :attr:`~scaletrain.models.common.config.DecoderConfig.placement` is the active one while it
        runs: the layers read it there (:func:`~scaletrain.models.common.placement.active_placement`).
        """
        with use_placement(self.config.placement):  # what every layer reads as it runs
            return self._forward(prepared, cache)

    def _forward(self, prepared: PreparedInputs, cache: Cache | None) -> tuple[Array, dict[str, Any], Cache | None]:
        """:meth:`forward` under its placement."""
        training = cache is None
        _, kind_of_layer = self.layer_kinds()
        count = len(prepared.by_kind)
        x = self._embed(prepared.input_ids)
        x = self._shard_activations(x) if training else x

        def step(layer: nnx.Module, h: Array, kind: int | Array, layer_cache: KVCache | None) -> tuple[Any, ...]:
            static = kind if isinstance(kind, int) else None

            def call(m: nnx.Module, h: Array, by_kind_inputs: tuple[Any, ...], *traced: Array) -> tuple[Any, ...]:
                return by_kind(m, static if static is not None else traced[0], count,
                               lambda mm, k: mm(h, by_kind_inputs[k], layer_cache))

            args = (h, prepared.by_kind) + (() if static is not None else (kind,))
            if not training:
                return call(layer, *args)
            h, aux, _ = run_layer(layer, active_placement().gradient_checkpointing, *args, call=call)
            return self._shard_activations(h), aux, None

        x, aux, cache = loop_layers(self.model.layers, kind_of_layer, step, x, cache)
        if prepared.restore is not None:
            x = self._shard_activations(jnp.take(x, prepared.restore, axis=1))
        return self.model.norm(x), aux, cache

    def hidden_states_and_aux(self, input_ids: Array, positions: Array | None = None,
                              segment_ids: Array | None = None,
                              attention_mask: Array | None = None) -> tuple[Array, dict[str, Any]]:
        """Final-norm hidden states [B, T, hidden] and the blocks' auxiliary outputs (``{}`` for a dense
        model, ``{"router": RouterStats}`` with [L, ...] leaves for a mixture of experts).

        ``segment_ids`` [B, T] mark packed documents (0: padding; default ``attention_mask``, else one
        document per row); ``positions`` default to each row's count of real tokens.
        """
        kinds, _ = self.layer_kinds()
        prepared = training_inputs(self.config, kinds, input_ids, positions, segment_ids, attention_mask)
        hidden, aux, _ = self.forward(prepared)
        return hidden, aux

    def hidden_states(self, input_ids: Array, positions: Array | None = None, segment_ids: Array | None = None,
                      attention_mask: Array | None = None) -> Array:
        """Final-norm hidden states [B, T, hidden] (the auxiliary outputs dropped)."""
        return self.hidden_states_and_aux(input_ids, positions, segment_ids, attention_mask)[0]

    def _embed(self, input_ids: Array) -> Array:
        """Token embeddings [B, T, hidden] in the compute dtype, times :meth:`embedding_scale`."""
        x = jnp.take(self.model.embed_tokens[...], input_ids, axis=0).astype(self.dtype)
        scale = self.embedding_scale()
        # transformers multiplies by the scale cast to the compute dtype (55.5, not 55.4256, in bf16)
        return x if scale is None else x * jnp.asarray(scale, jnp.float32).astype(self.dtype)

    def _shard_activations(self, x: Array) -> Array:
        """``x`` [B, T, hidden] constrained to the batch and sequence axes of the active mesh."""
        pa = active_placement().partition_axis
        return constrain(x, (pa.batch_axis, pa.sequence_axis, None))

    # -- the head -------------------------------------------------------------------
    def lm_head_weight(self) -> tuple[Array, bool]:
        """The output projection and whether it is transposed.

        ``([hidden, vocab], False)`` for a separate head; ``([vocab, hidden], True)``,
        the embedding itself, when tied: a transposed rhs costs the matmul nothing,
        while materialising the embedding's transpose would copy it every step.
        """
        if self.lm_head is None:
            return self.model.embed_tokens[...], True
        return self.lm_head.kernel[...], False

    def compute_logits(self, hidden: Array) -> Array:
        """Logits in the compute dtype from hidden states [..., hidden]."""
        w, transposed = self.lm_head_weight()
        logits = matmul(hidden.astype(self.dtype), w.astype(self.dtype), rhs_transposed=transposed,
                        precision=self.precision)
        cap = self.logit_softcap()
        return logits if cap is None else jnp.tanh(logits / cap) * cap

    def __call__(self, input_ids: Array, positions: Array | None = None, segment_ids: Array | None = None,
                 attention_mask: Array | None = None) -> Array:
        return self.compute_logits(self.hidden_states(input_ids, positions, segment_ids, attention_mask))

    # -- incremental decoding ---------------------------------------------------------
    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> Cache:
        """Empty per-layer decode caches (compute dtype by default): a list, or with stacked layers one
        cache with a leading layer axis, which the decoding scan reads.

        Each layer is asked for its own kind of state (``layer.init_cache(config, batch, max_length,
        dtype)`` where it defines one: a linear-attention layer's fixed-size recurrent and convolution
        state); a layer without one gets ``max_length`` key/value slots."""
        cfg = self.config
        shape = (batch_size, max_length, cfg.num_key_value_heads, cfg.head_dim)
        dtype = self.dtype if dtype is None else dtype
        if isinstance(self.model.layers, StackedLayers):
            stacked = (cfg.num_hidden_layers, *shape)
            return KVCache(jnp.zeros(stacked, dtype), jnp.zeros(stacked, dtype))
        return [layer.init_cache(cfg, batch_size, max_length, dtype) if hasattr(layer, "init_cache")
                else KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for layer in self.model.layers]

    def forward_with_cache(self, input_ids: Array, positions: Array, cache: Cache, start: Array,
                           kv_valid: Array) -> tuple[Array, Cache]:
        """Final-norm hidden states [B, T, hidden] of tokens written at cache slots ``[start, start+T)``.

        :meth:`forward` with a cache, as :func:`scaletrain.generation.generate` runs it for the
        prefill (T = prompt length) and each decode step (T = 1). ``kv_valid`` [B, S] must
        already mark the new tokens' slots.
        """
        kinds, _ = self.layer_kinds()
        hidden, _, cache = self.forward(cache_inputs(kinds, input_ids, positions, start, kv_valid), cache)
        return hidden, cache

    def init_prefill_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> Cache:
        """The contiguous cache a prompt is prefilled into before the continuous engine copies it into pages
        (:meth:`init_paged_cache`): :meth:`init_cache`, unless a family pages a compressed form of its keys
        (multi-head latent attention's latent), which its prefill must then write."""
        return self.init_cache(batch_size, max_length, dtype)

    def init_paged_cache(self, slots: int, num_pages: int, page_size: int, dtype: Any = None) -> Cache:
        """Empty per-layer state for decoding ``slots`` sequences over a paged cache: a page pool
        (:class:`PagedKVCache` [num_pages, page_size, kv_heads, head_dim]) for every layer whose
        :meth:`init_cache` state is keys and values, and that state itself, one row per slot, for a layer
        whose state has a fixed size (a linear-attention layer's recurrent and convolution state).

        A layer whose state grows with the sequence but is not keys and values has no paged form: refused
        with a :class:`ConfigError` (a family whose keys page in another form overrides this, as
        DeepSeek-V3's latent pages do)."""
        cfg = self.config
        dtype = self.dtype if dtype is None else dtype
        pool = (num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
        if isinstance(self.model.layers, StackedLayers):
            stacked = (cfg.num_hidden_layers, *pool)
            return PagedKVCache(jnp.zeros(stacked, dtype), jnp.zeros(stacked, dtype))
        one, two = (jax.eval_shape(lambda n=n: self.init_cache(1, n, dtype)) for n in (1, 2))
        out: list[Any] = []
        for i, (short, long) in enumerate(zip(one, two)):
            if isinstance(short, KVCache):
                out.append(PagedKVCache(jnp.zeros(pool, dtype), jnp.zeros(pool, dtype)))
            elif any(jax.tree.leaves(jax.tree.map(lambda a, b: a.shape != b.shape, short, long))):
                raise ConfigError(f"rollout_engine: layer {i} of {cfg.model_type} keeps a {type(short).__name__} "
                                  "that grows with the sequence and has no paged form; use the static engine")
            else:
                out.append(jax.tree.map(lambda a: jnp.zeros((slots, *a.shape[1:]), a.dtype), short))
        return out

    def forward_paged(self, input_ids: Array, cache: Cache, pages: PageTable) -> tuple[Array, Cache]:
        """Final-norm hidden states [slots, 1, hidden] of one token per slot decoded over a paged cache
        (:meth:`init_paged_cache`), written at position ``pages.lengths``, and the updated cache."""
        kinds, _ = self.layer_kinds()
        pools = jax.tree.leaves(cache, is_leaf=lambda c: isinstance(c, PagedKVCache))
        size = next(c.keys.shape[-3] for c in pools if isinstance(c, PagedKVCache))
        hidden, _, cache = self.forward(paged_inputs(kinds, input_ids, pages, size), cache)
        return hidden, cache

    # -- Hugging Face format ------------------------------------------------------------
    def save_pretrained(self, save_directory: str, tokenizer: Any = None, max_shard_size: int | str = "2GB") -> str:
        """Write a transformers-loadable folder (config.json, safetensors, tokenizer); returns its path."""
        from scaletrain.models.hf import save_hf_checkpoint

        return save_hf_checkpoint(self, save_directory, tokenizer=tokenizer, max_shard_size=max_shard_size)

    @classmethod
    def from_pretrained(cls, local_dir: str, **kwargs: Any) -> CausalLM:
        """Load a local Hugging Face folder of this class's ``model_type`` (see ``load_hf_checkpoint``).

        ``hf`` is imported here so that building a model does not load the checkpoint code.
        """
        from scaletrain.models.hf import load_hf_checkpoint

        return load_hf_checkpoint(local_dir, cls, **kwargs)
