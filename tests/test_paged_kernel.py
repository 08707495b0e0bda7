"""The Pallas paged decode kernel (models/kernels/paged_kernel.py) in Pallas' interpreter equals the XLA path it
replaces on GPU: the pages gathered through the page table and the einsum attention under the paged mask.

Cases: GQA (2 query heads per key/value head), a slot at position 0 (one partial page), a slot on a page
boundary, a slot over several pages with its last one partial, pages out of order in the pool; a sliding window
that starts inside a page and skips whole pages; GPT-OSS's sinks; a keys-only pool (multi-head latent
attention's latent pages, values the keys' first dims); and one decode step of the layers through the kernel.

Tolerance: 2e-6 of the largest output (float32). The kernel folds pages into an online softmax (running max,
rescaled sums) where the XLA path takes one softmax over all keys, so only the order and count of float32
roundings differ: measured at most 1.0e-7 on one call, 1.2e-7 over three decode steps of a model.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaletrain.models.kernels.attention import dot_product_attention
from scaletrain.models.kernels.paged_attention import PagedKVCache, PageTable, gather_pages, paged_mask
from scaletrain.models.kernels.paged_kernel import paged_decode_attention

TOL = 2e-6
PAGE = 4
MAX_PAGES = 5  # not a power of two: the kernel pads the table
LENGTHS = (0, 8, 17)  # one partial page; a slot that starts its third page; five pages, the last partial


def _case(keys_width: int, values_width: int | None, kv_heads: int, heads: int, seed: int = 0):
    rs = np.random.RandomState(seed)
    num_pages = 16
    keys = jnp.asarray(rs.standard_normal((num_pages, PAGE, kv_heads, keys_width)), jnp.float32)
    values = (None if values_width is None
              else jnp.asarray(rs.standard_normal((num_pages, PAGE, kv_heads, values_width)), jnp.float32))
    table = jnp.asarray(rs.permutation(num_pages)[:3 * MAX_PAGES].reshape(3, MAX_PAGES), jnp.int32)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    pages = PageTable(table, lengths, table[jnp.arange(3), lengths // PAGE])
    q = jnp.asarray(rs.standard_normal((3, 1, heads, keys_width)), jnp.float32)
    return q, PagedKVCache(keys, values), pages


def _xla(q, cache, pages, mask, scale, sinks=None, value_dim=None):
    keys, values = gather_pages(cache, pages.table)
    values = keys[..., :value_dim] if values is None else values
    return dot_product_attention(q, keys, values, mask, jnp.float32, None, scale=scale, sinks=sinks)


def _assert_close(ours, ref):
    ours, ref = np.asarray(ours), np.asarray(ref)
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, rtol=0, atol=TOL * np.abs(ref).max())


@pytest.mark.parametrize("window, sinks", [(None, False), (6, False), (None, True)], ids=["causal", "window", "sinks"])
def test_paged_kernel_in_interpret_mode_equals_the_gathered_xla_path(window, sinks) -> None:
    """GQA over pages in table order, partial last pages and several pages per row, with a sliding window that
    skips whole pages, or GPT-OSS's sinks in the denominator: the kernel equals gather + einsum attention."""
    q, cache, pages = _case(8, 8, kv_heads=2, heads=4)
    mask = paged_mask(pages.lengths, MAX_PAGES * PAGE, window)
    sink = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32) if sinks else None
    ours = paged_decode_attention(q, cache, pages, mask, scale=0.3, sinks=sink, interpret=True)
    _assert_close(ours, _xla(q, cache, pages, mask, 0.3, sink))


def test_paged_kernel_reads_a_keys_only_latent_pool_as_mla_absorbed_attention() -> None:
    """Multi-head latent attention's pages (one latent + rotated key per token, one "head"): scores over both
    parts, values the latent's dims, the heads in one program or in blocks; equal to the XLA path that slices
    the gathered keys."""
    q, cache, pages = _case(12, None, kv_heads=1, heads=4)
    mask = paged_mask(pages.lengths, MAX_PAGES * PAGE, None)
    ref = _xla(q, cache, pages, mask, 0.25, value_dim=8)
    for block_rows in (None, 2):  # the 4 heads in one program, and split over two (as 128 heads are on GPU)
        _assert_close(paged_decode_attention(q, cache, pages, mask, scale=0.25, value_dim=8, interpret=True,
                                             block_rows=block_rows), ref)


@pytest.mark.parametrize("family", ["llama", "mla"])
def test_decode_steps_through_the_kernel_equal_the_gathered_path(family, request) -> None:
    """Three decode steps of a whole one-layer model over pages (a tiny Llama: GQA; a tiny DeepSeek-V3: absorbed
    MLA over latent pages), jitted, with the layers' attention through the interpreted kernel and through XLA's
    gather: the same hidden states and pools at every step."""
    from scaletrain.models.kernels.paged_kernel import interpreted_paged_kernel

    model = request.getfixturevalue(family)
    slots, page = 2, 4
    table = jnp.asarray([[3, 1, 0], [2, 4, 5]], jnp.int32)
    lengths = jnp.asarray([2, 5], jnp.int32)  # slot 1 crosses into its second page
    caches = {}
    for path in ("gather", "kernel"):
        # a jitted step per path: the attention's choice is read when the step is traced
        step_fn = jax.jit(lambda ids, cache, pages: model.forward_paged(ids, cache, pages))
        cache = model.init_paged_cache(slots, 6, page)
        ids = jnp.asarray([[7], [11]], jnp.int32)
        hidden = []
        for step in range(3):
            at = lengths + step
            pages = PageTable(table, at, table[jnp.arange(slots), at // page])
            with interpreted_paged_kernel() if path == "kernel" else contextlib.nullcontext():
                h, cache = step_fn(ids + step, cache, pages)
            hidden.append(np.asarray(h))
        caches[path] = (hidden, cache)
    for a, b in zip(caches["kernel"][0], caches["gather"][0]):
        _assert_close(a, b)
    for a, b in zip(jax.tree.leaves(caches["kernel"][1]), jax.tree.leaves(caches["gather"][1])):
        _assert_close(a, b)  # the first layer's writes are equal; later layers' inputs carry the rounding


@pytest.fixture(scope="module")
def llama():
    from preference_testing import tiny_llama

    return tiny_llama(0, layers=1)


@pytest.fixture(scope="module")
def mla():
    from engine_testing import tiny_mla

    return tiny_mla(layers=1)


@pytest.mark.parametrize("shape", ["smollm2", "mla"])
def test_paged_kernel_lowers_to_one_triton_call_for_a_gpu_on_this_cpu(shape) -> None:
    """What runs on a GPU, checked without one: the decode attention lowers (Pallas' Triton backend, for
    ``cuda``) to one Triton kernel call over the pools as they are, never a gather of the pages, at 256 slots:
    SmolLM2-135M's heads (9 query heads over 3 key/value heads of 64, bfloat16; the group padded to Triton's 16
    rows) with a sliding window and sinks, and DeepSeek-V3's latent pages (576 = 512 + 64, 128 heads on one)."""
    slots, pages_per_slot, num_pages = 256, 8, 2048
    if shape == "smollm2":
        heads, kv, d, value_dim, sinks, window = 9, 3, 64, None, jax.ShapeDtypeStruct((9,), jnp.float32), 100
    else:
        heads, kv, d, value_dim, sinks, window = 128, 1, 576, 512, None, None
    pool = jax.ShapeDtypeStruct((num_pages, 16, kv, d), jnp.bfloat16)

    def step(q, keys, values, table, lengths, sinks):
        pages = PageTable(table, lengths, lengths)
        mask = paged_mask(lengths, pages_per_slot * 16, window)
        return paged_decode_attention(q, PagedKVCache(keys, values), pages, mask, scale=0.125, sinks=sinks,
                                      value_dim=value_dim, interpret=False)

    args = (jax.ShapeDtypeStruct((slots, 1, heads, d), jnp.bfloat16), pool, None if value_dim else pool,
            jax.ShapeDtypeStruct((slots, pages_per_slot), jnp.int32), jax.ShapeDtypeStruct((slots,), jnp.int32), sinks)
    text = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call" in line]
    assert len(calls) == 1 and "triton" in calls[0] and 'name = "paged_decode_attention"' in calls[0]
    assert "gather" not in text
