"""What each decoder layer reads besides the hidden states, prepared once per forward and layer kind.

Why one module: training, evaluation and decoding read the same inputs (positions, segment
ids, the mask or :class:`~scaletrain.models.kernels.attention.CausalWindow`, RoPE tables), and a
family whose layers differ in window or RoPE (Gemma 3's local and global layers) needs
them once per *kind*, all laid out alike. The training inputs go through
:func:`~scaletrain.models.kernels.flash_sharding.training_mechanism` and, where the flash kernel
splits rows over ``sp``, :func:`~scaletrain.models.kernels.flash_sharding.zigzag_inputs` for every
kind, so no family can skip the context-parallel path.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from scaletrain.models.kernels.attention import (
    CausalWindow,
    PackedSegments,
    build_cache_mask,
    prepare_inputs,
    rope_tables,
)
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.kernels.paged_attention import PageTable, paged_mask
from scaletrain.models.kernels.flash_sharding import training_mechanism, zigzag_inputs

Array = jax.Array


class LayerKind(NamedTuple):
    """What sets one kind of layer apart: its attention ``window`` (None: none) and RoPE ``inv_freq``.

    ``rope_scale`` multiplies the kind's RoPE tables (cos and sin), as transformers applies YaRN's
    attention factor: where the factor differs by layer type (OLMo 3's YaRN on its full layers only,
    ``rope_factor_per_layer_type``) it travels with the kind, not with the shared attention module.
    """

    window: int | None
    inv_freq: Array
    rope_scale: float = 1.0


def _scaled(tables: tuple[Array, Array], scale: float) -> tuple[Array, Array]:
    return tables if scale == 1.0 else (tables[0] * scale, tables[1] * scale)


class LayerInputs(NamedTuple):
    """One kind of layer's inputs for one forward (a pytree: it passes through remat and ``lax.cond``)."""

    # [B, 1, T, S] boolean, the segment ids (flash kernel), a window over unpacked rows, or None (plain causal)
    mask: Array | PackedSegments | CausalWindow | None
    rope: tuple[Array, Array]  # rope_tables(positions, inv_freq)
    valid: Array  # [B, T] float32: 1 on real tokens (what router statistics count)
    start: Array | None = None  # the cache slot of the first token when decoding, else None
    # [B, T] the documents (0: padding) in the layer's row order: where linear-attention layers restart
    segment_ids: Array | None = None
    pages: PageTable | None = None  # where each slot's keys live, decoding over a paged cache


class PreparedInputs(NamedTuple):
    """The forward's token ids (permuted with the inputs), each kind's :class:`LayerInputs`, and the
    permutation that puts the final hidden states back in row order (None: nothing permuted)."""

    input_ids: Array
    by_kind: tuple[LayerInputs, ...]
    restore: np.ndarray | None


def training_inputs(config: DecoderConfig, kinds: tuple[LayerKind, ...], input_ids: Array, positions: Array | None,
                    segment_ids: Array | None, attention_mask: Array | None) -> PreparedInputs:
    """Each kind's inputs for a forward over whole rows, in the zigzag layout when the flash kernel
    attends over rows split across ``sp`` (every kind permuted alike: the permutation depends on the
    row length and the mesh only)."""
    mechanism = training_mechanism(config, input_ids.shape[1])
    ids, restore, by_kind = input_ids, None, []
    for kind in kinds:
        inputs = prepare_inputs(input_ids, positions, segment_ids, attention_mask, kind.window, kind.inv_freq,
                                mechanism)
        ids, inputs, restore = zigzag_inputs(config.partition_axis.sequence_axis, input_ids, inputs)
        by_kind.append(LayerInputs(inputs.mask, _scaled(inputs.rope, kind.rope_scale),
                                   (inputs.segment_ids != 0).astype(jnp.float32),
                                   segment_ids=inputs.segment_ids))
    return PreparedInputs(ids, tuple(by_kind), restore)


def cache_inputs(kinds: tuple[LayerKind, ...], input_ids: Array, positions: Array, start: Array,
                 kv_valid: Array) -> PreparedInputs:
    """Each kind's inputs for tokens written at cache slots ``[start, start + T)``: a mask over the
    whole cache (:func:`build_cache_mask`, the same attention pattern as the training mask for
    left-padded rows) and RoPE at ``positions``.

    ``start`` the Python int 0 is a prefill into an empty cache: the mask then covers the new tokens
    only ([B, 1, T, T]) and attention runs over their own keys by the training path, with no empty
    slots in its sums (measured on SmolLM2-135M: the prompt's hidden states equal the training
    forward's bit for bit, where attending over the whole cache differed by ~4e-5)."""
    valid = jnp.ones(input_ids.shape, jnp.float32)
    t = input_ids.shape[1]
    if isinstance(start, int) and start == 0:
        kv_valid = kv_valid[:, :t]
    # the new tokens' documents: a prompt's left padding (0) apart from its text (1)
    documents = jax.lax.dynamic_slice_in_dim(kv_valid, start, t, axis=1).astype(jnp.int32)
    by_kind = tuple(LayerInputs(build_cache_mask(start, t, kv_valid, kind.window),
                                _scaled(rope_tables(positions, kind.inv_freq), kind.rope_scale), valid, start,
                                documents) for kind in kinds)
    return PreparedInputs(input_ids, by_kind, None)


def paged_inputs(kinds: tuple[LayerKind, ...], input_ids: Array, pages: PageTable, page_size: int) -> PreparedInputs:
    """Each kind's inputs for one decode step over a paged cache: ``input_ids`` [slots, 1], each slot's
    token at position ``pages.lengths`` (sequences start at position 0 in their first page: no padding),
    a mask over the slot's pages (:func:`paged_mask`, with the kind's window) and RoPE at that position."""
    positions = pages.lengths[:, None].astype(jnp.int32)
    valid = jnp.ones(input_ids.shape, jnp.float32)
    documents = jnp.ones(input_ids.shape, jnp.int32)
    max_tokens = pages.table.shape[1] * page_size
    by_kind = tuple(LayerInputs(paged_mask(pages.lengths, max_tokens, kind.window),
                                rope_tables(positions, kind.inv_freq), valid, None, documents, pages)
                    for kind in kinds)
    return PreparedInputs(input_ids, by_kind, None)
