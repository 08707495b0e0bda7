"""A paged key/value cache: one pool of fixed-size pages per attention layer, a page table per decode slot.

Why pages: a contiguous cache gives every row ``prompt + max_completion_length`` slots for the
whole call, so memory follows the worst case. Here a layer's keys and values live in a pool
``[num_pages, page_size, kv_heads, head_dim]`` shared by every slot; a slot's sequence is the
list of page ids in its row of the page table (logical position ``p`` sits at page
``table[slot, p // page_size]``, offset ``p % page_size``), so a sequence holds only the pages its
tokens fill, pages return to the pool when it stops, and several sequences can point at the same
prompt pages (shared prefixes).

Layout: the pool keeps key/value heads on axis 2 (sharded over tp like today's cache) and the
page axis first, so a decode step reads a slot's pages with one gather (:func:`gather_pages`, XLA
on every platform today); a Pallas kernel that walks the page table instead takes the same pool,
table and lengths. Which pages are free is the engine's business (``generation.page_pool``): this
module only writes a token into its page and reads a slot's pages back in order.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class PagedKVCache(NamedTuple):
    """One attention layer's page pool: ``keys`` / ``values`` [num_pages, page_size, kv_heads, head_dim].

    ``values`` None: a keys-only pool, whose values are the keys' leading dims (multi-head latent
    attention keeps one compressed latent + rotated key per token, ``[.., 1, kv_lora_rank + rope]``:
    :mod:`~scaletrain.models.common.latent_attention`)."""

    keys: Array
    values: Array | None


class PageTable(NamedTuple):
    """Where each slot's tokens live, shared by every attention layer of one decode step.

    ``table`` [slots, max_pages] page ids in sequence order (entries past a slot's length are
    never read unmasked); ``lengths`` [slots] tokens already in the cache, i.e. the logical position
    the step's token is written at; ``write_page`` [slots] that position's page (``num_pages``,
    out of range, for an idle slot: its write is dropped).
    """

    table: Array
    lengths: Array
    write_page: Array


def write_token(cache: PagedKVCache, k: Array, v: Array, pages: PageTable) -> PagedKVCache:
    """``cache`` with each slot's new key and value [slots, kv_heads, head_dim] at its write position."""
    offset = pages.lengths % cache.keys.shape[1]

    def write(pool: Array | None, x: Array | None) -> Array | None:
        return None if pool is None else pool.at[pages.write_page, offset].set(x.astype(pool.dtype), mode="drop")

    return PagedKVCache(write(cache.keys, k), write(cache.values, v))


def gather_pages(cache: PagedKVCache, table: Array) -> tuple[Array, Array | None]:
    """Each slot's keys and values in sequence order, [slots, max_pages * page_size, kv_heads, head_dim]
    (values None for a keys-only pool)."""
    slots, max_pages = table.shape

    def read(pool: Array | None) -> Array | None:
        if pool is None:
            return None
        _, page_size, kv, d = pool.shape
        return jnp.take(pool, table.reshape(-1), axis=0).reshape(slots, max_pages * page_size, kv, d)

    return read(cache.keys), read(cache.values)


def paged_mask(lengths: Array, max_tokens: int, window: int | None) -> Array:
    """Boolean [slots, 1, 1, max_tokens]: the keys a query at position ``lengths`` sees (itself and the
    positions before it, within ``window`` when the layer has one)."""
    k_pos = jnp.arange(max_tokens)[None, :]
    q_pos = lengths[:, None]
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (q_pos - k_pos < window)
    return mask[:, None, None, :]
