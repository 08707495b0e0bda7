"""A multi-turn row's pages kept between its turns: what the host records, and the device code that reads them back.

Why: in a multi-turn rollout (``rl/overlap.py``) a row whose turn ends with a tool call leaves its slot, and its
next turn's context is the previous one plus its completion, the tool output and a generation prompt, token in and
token out. Prefilling that context again from scratch recomputes every token the row's pages already hold. A
request submitted with ``keep`` (its row will continue) does not give its pages back when it stops; the host
records them here (the slot's table row, as many pages as its cache length) with the tokens they hold: the
request's prompt and its completion less the last token, which was sampled but never fed. When the row's next turn
starts with exactly those tokens, :func:`gather_prefix` copies them from the pages into the contiguous prefill cache
and only chunks that cover the new tokens are prefilled over them (the chunked-prefill program,
:meth:`~scaletrain.generation.paged_programs.PagedPrograms.prefill_chunk`).

Kept pages are held in the pool's counts like a live row's, so a row waiting on its tools holds pages. They are
the first thing the pool gives up: when an insertion cannot fit or a decode step needs a page, the oldest row's
kept pages go back (:meth:`KeptPages.oldest`) and that row falls back to a full prefill, before any live row is
preempted.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from scaletrain.models.kernels.attention import KVCache
from scaletrain.models.kernels.paged_attention import PagedKVCache

Array = jax.Array


@dataclasses.dataclass
class Kept:
    """One row's kept pages, in sequence order, and the tokens their first ``len(tokens)`` positions hold."""

    pages: np.ndarray
    tokens: list[int]

    def prefix_of(self, context: list[int]) -> bool:
        """Whether ``context`` starts with the kept tokens and has at least one new token after them."""
        n = len(self.tokens)
        return 0 < n < len(context) and context[:n] == self.tokens


class KeptPages:
    """The kept pages of every row that has some, oldest first (the order rows stopped in)."""

    def __init__(self) -> None:
        self.rows: dict[int, Kept] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def record(self, row: int, pages: np.ndarray, tokens: list[int]) -> None:
        """Row ``row`` stopped holding ``pages`` over ``tokens`` (it holds no other kept pages: it was in a slot)."""
        self.rows[row] = Kept(np.asarray(pages, np.int32), tokens)

    def pop(self, row: int) -> Kept | None:
        """Row ``row``'s kept pages, forgotten here (the caller gives them back to the pool); None if it has none."""
        return self.rows.pop(row, None)

    def oldest(self, spare: frozenset[int] = frozenset()) -> int | None:
        """The row whose pages were kept longest ago, not one of ``spare``; None if there is none."""
        return next((row for row in self.rows if row not in spare), None)


def padded_pages(pages: np.ndarray, max_pages: int, num_pages: int) -> jax.Array:
    """``pages`` padded to a slot's table length with ``num_pages`` (out of range: dropped, never read)."""
    out = np.full((max_pages,), num_pages, np.int32)
    out[:len(pages)] = pages
    return jnp.asarray(out)


def gather_prefix(pool: PagedKVCache, prefill: KVCache, pages: Array, pad: Array, length: Array) -> KVCache:
    """``prefill`` (batch 1, ``W`` slots, empty) holding the first ``length`` tokens that ``pages`` [max_pages]
    hold in ``pool``, left-padded: token ``i`` at slot ``pad + i``, every other slot zero (the inverse of the
    insertion's page fill). Stacked layers: a leading layer axis on both."""
    if pool.keys.ndim == 5:  # stacked layers
        return jax.vmap(gather_prefix, in_axes=(0, 0, None, None, None))(pool, prefill, pages, pad, length)
    num_pages, page_size = pool.keys.shape[:2]
    token = jnp.arange(prefill.keys.shape[1]) - pad
    ok = (token >= 0) & (token < length)
    token = jnp.clip(token, 0, None)
    page = jnp.clip(pages[jnp.minimum(token // page_size, pages.shape[0] - 1)], 0, num_pages - 1)

    def take(dst: Array | None, src: Array | None) -> Array | None:
        if dst is None:  # a keys-only pool (multi-head latent attention's)
            return None
        data = src[page, token % page_size]  # [W, heads, dim]
        return jnp.where(ok[:, None, None], data, 0).astype(dst.dtype)[None]

    return KVCache(take(prefill.keys, pool.keys), take(prefill.values, pool.values))


def resume_chunks(width: int, prompt: int, kept: int, chunk: int) -> tuple[int, int]:
    """Where a resumed prefill starts and how many ``chunk``-token chunks it runs, for a ``prompt``-token context
    left-padded to ``width`` whose first ``kept`` tokens sit in kept pages: the chunks end at the last slot and
    cover every new token (a few kept ones may be recomputed inside the first chunk). ``chunk`` divides
    ``width`` (a power of two that divides it), so the first one never starts before slot 0."""
    chunks = -(-(prompt - kept) // chunk)
    return width - chunks * chunk, chunks
