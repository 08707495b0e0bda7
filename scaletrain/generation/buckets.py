"""Prompt batches laid out for the rollout engine: left-padded, repeated, rounded up to a shape bucket.

What is padded, and why:

- **Prompt length**: every prompt is left-padded to the batch's longest, rounded up to a
  power of two (at least :data:`MIN_PROMPT_BUCKET` tokens), so prompts of nearby lengths share
  one compiled program. Left padding puts every row's next token in the same cache slot;
  the padding slots are masked out of attention and RoPE positions count real tokens only,
  so a row's tokens and log-probabilities do not depend on its padding.
- **Batch**: the rows (prompts x ``num_generations``) are rounded up to a power of two
  (at least the number of devices the batch axis splits over, so each shard holds rows).
  The extra rows are a one-token dummy prompt that starts *finished*: they never keep the
  decode loop running, and they are cut off before anything is returned.
- **Completions**: the output has ``max_completion_length`` columns; a row that stops
  early is filled with the pad id (mask 0) while the others go on, and the loop ends
  as soon as every row has stopped. The cache holds prompt bucket + ``max_completion_length``
  slots, allocated once per call inside the compiled program.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

#: the shortest prompt bucket: shorter prompts are padded to this many tokens
MIN_PROMPT_BUCKET = 16


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0, length: int | None = None) -> tuple[np.ndarray,
                                                                                                    np.ndarray]:
    """Left-pad token lists to one length (the longest, or ``length``): ``(input_ids, attention_mask)``,
    both [B, T] int32."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    t = max(len(p) for p in prompts) if length is None else length
    ids = np.full((len(prompts), t), pad_id, np.int32)
    mask = np.zeros((len(prompts), t), np.int32)
    for i, p in enumerate(prompts):
        ids[i, t - len(p):] = p
        mask[i, t - len(p):] = 1
    return ids, mask


def round_up_pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= max(n, least)."""
    return 1 << (max(n, least, 1) - 1).bit_length()


def prompt_bucket(n: int, page_size: int, chunk: int) -> int:
    """The width the continuous engine left-pads an ``n``-token prompt to: a power of two (at least
    :data:`MIN_PROMPT_BUCKET` and one page), or three quarters of one where that holds ``n`` in whole pages and
    fits in one prefill ``chunk`` (48, 96, 192 between 32, 64, 128, 256 with 16-token pages).

    Why the three-quarter steps: a prompt's prefill is compute-bound and padded to its width, so with powers of
    two alone a prompt just over one pads up to 2x its length (40 tokens to 64); the extra steps bound that at 1.5x
    for at most twice the widths a run compiles. Above a chunk, widths stay powers of two: a chunked prefill walks
    the width in whole chunks."""
    least = max(MIN_PROMPT_BUCKET, page_size)
    p = round_up_pow2(n, least)
    q = p * 3 // 4
    if least < p <= chunk and n <= q and q % page_size == 0 and q >= least:
        return q
    return p


class PaddedBatch(NamedTuple):
    """Host arrays of one bucket: ``input_ids``/``attention_mask`` [Bb, Pb] left-padded, ``live`` [Bb]
    (False on the batch's padding rows) and ``rows``, the number of real rows (the first ones)."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    live: np.ndarray
    rows: int


def as_rows(prompts: Any, attention_mask: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """``prompts`` as left-padded (ids, mask): token lists of any lengths, or [B, T] / [T] ids with an
    optional ``attention_mask`` (1 on real tokens, which must be at the right end)."""
    ragged = (attention_mask is None and isinstance(prompts, (list, tuple)) and len(prompts) > 0
              and isinstance(prompts[0], (list, tuple, np.ndarray)))
    if ragged:
        return left_pad(prompts)
    ids = np.atleast_2d(np.asarray(prompts, np.int32))
    mask = np.ones_like(ids) if attention_mask is None else np.atleast_2d(np.asarray(attention_mask, np.int32))
    if ids.shape != mask.shape:
        raise ValueError(f"input_ids {ids.shape} and attention_mask {mask.shape} differ in shape")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError("every prompt needs at least one token")
    return ids, mask


def bucket(ids: np.ndarray, mask: np.ndarray, num_generations: int = 1, pad_id: int = 0,
           batch_multiple: int = 1) -> PaddedBatch:
    """Each prompt repeated ``num_generations`` times (adjacent, as TRL groups them), left-padded to the
    prompt bucket and padded with finished dummy rows to the batch bucket (see the module docstring)."""
    if num_generations < 1:
        raise ValueError(f"num_generations must be at least 1, got {num_generations}")
    ids = np.repeat(ids, num_generations, axis=0)
    mask = np.repeat(mask, num_generations, axis=0)
    rows, t = ids.shape
    length = round_up_pow2(t, MIN_PROMPT_BUCKET)
    batch = round_up_pow2(rows, batch_multiple)
    out_ids = np.full((batch, length), pad_id, np.int32)
    out_mask = np.zeros((batch, length), np.int32)
    out_ids[:rows, length - t:], out_mask[:rows, length - t:] = ids, mask
    out_mask[rows:, -1] = 1  # a dummy row: one real (pad) token, so its attention has a key
    live = np.arange(batch) < rows
    return PaddedBatch(out_ids, out_mask, live, rows)


def rollout_rows(prompt_ids: jax.Array, prompt_mask: jax.Array, completion_ids: jax.Array,
                 completion_mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(input_ids, segment_ids, positions)`` [B, P + N] of prompts followed by their completions, the rows
    the trainer's forward scores (``objectives.token_logps``): segment 1 on real tokens, 0 on padding (left of
    the prompt, right of the completion), positions counting real tokens, as the decode loop numbered them."""
    ids = jnp.concatenate([prompt_ids, completion_ids], axis=1).astype(jnp.int32)
    seg = jnp.concatenate([prompt_mask, completion_mask], axis=1).astype(jnp.int32)
    positions = jnp.maximum(jnp.cumsum(seg, axis=1) - 1, 0).astype(jnp.int32)
    return ids, seg, positions
