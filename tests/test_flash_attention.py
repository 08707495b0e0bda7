"""The segment-aware Pallas flash attention against the einsum path, in Pallas interpret mode on CPU.

Every case compares values and q/k/v gradients with ``dot_product_attention`` under
``build_attention_mask(segment_ids, positions, None)``, the mask packed rows get today.
Each shape compiles the three kernels once (a few seconds in interpret mode), so the
row layouts that matter share one batch: rows are independent in both paths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flash_testing import assert_same_loss_and_grads

from scaletrain.models.kernels.attention import build_attention_mask, dot_product_attention
from scaletrain.models.kernels.flash_attention import attention_with_visits, block_schedule, segment_flash_attention

HQ, HKV = 4, 2
NAMES = ("output", "dq", "dk", "dv")
CASES = ("one document", "several documents", "padding at the end", "only padding", "interleaved")


def row(t: int, *lengths: int) -> np.ndarray:
    """Segments 1, 2, ... of these lengths, then padding (segment 0) to ``t``."""
    ids = np.zeros(t, np.int32)
    ids[: sum(lengths)] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    return ids


def rows(t: int) -> np.ndarray:
    """One row per case: boundaries inside blocks (20, 100) and on 16/32-token block edges (32, 64)."""
    interleaved = np.resize(np.repeat(np.array([1, 2, 1, 0], np.int32), 8), t)
    return np.stack([
        row(t, t),  # one document filling the row
        row(t, 20, 12, 32, 36, t - 100),  # several documents
        row(t, 50, 40),  # padding at the end
        row(t),  # only padding: every token sees only itself
        interleaved,  # not packing's layout (a document resumes, padding inside): still exact
    ])


def inputs(t: int, d: int, dtype: jnp.dtype) -> tuple[jax.Array, ...]:
    """q, k, v and an output cotangent for :func:`rows` (numpy draws: eager jax.random would compile each op)."""
    rng = np.random.default_rng(0)
    b = len(CASES)
    shapes = [(b, t, HQ, d), (b, t, HKV, d), (b, t, HKV, d), (b, t, HQ, d)]
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for shape in shapes)


def both_paths(t: int, d: int, dtype: jnp.dtype, block_q: int, block_k: int) -> tuple[list, list]:
    """(output, dq, dk, dv) of the kernel and of the einsum path for :func:`rows` (as float32 numpy)."""

    @jax.jit  # one compile for both paths
    def value_and_grads(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, seg: jax.Array) -> tuple:
        mask = build_attention_mask(seg, jnp.zeros_like(seg), None)
        out, vjp = jax.vjp(lambda *qkv: segment_flash_attention(
            *qkv, seg, block_q=block_q, block_k=block_k, interpret=True), q, k, v)
        ref, ref_vjp = jax.vjp(lambda *qkv: dot_product_attention(*qkv, mask, jnp.float32, None), q, k, v)
        return (out, *vjp(do)), (ref, *ref_vjp(do))

    got, want = value_and_grads(*inputs(t, d, dtype), jnp.asarray(rows(t)))
    return [np.asarray(x, np.float32) for x in got], [np.asarray(x, np.float32) for x in want]


@pytest.mark.parametrize(
    "t, d, block_q, block_k",
    [
        (128, 16, 32, 32),  # square tiles, T and D whole
        (100, 12, 32, 16),  # unequal tiles; T padded to 128 and D to 16 inside
    ],
)
def test_float32_matches_einsum_path(t: int, d: int, block_q: int, block_k: int) -> None:
    flash, ref = both_paths(t, d, jnp.float32, block_q, block_k)
    for name, got, want in zip(NAMES, flash, ref):
        assert np.all(np.isfinite(got)), name
        for i, case in enumerate(CASES):
            # float32 throughout: the online softmax only reorders the sums over <= 128
            # keys (measured <= 3e-6 absolute on values and gradients of size up to 7.5)
            np.testing.assert_allclose(got[i], want[i], rtol=1e-5, atol=2e-5, err_msg=f"{name}, {case}")
    # a padding token's output is its own value row (it sees only itself), as in the mask
    v = np.asarray(inputs(t, d, jnp.float32)[2])
    np.testing.assert_allclose(flash[0][3], np.repeat(v[3], HQ // HKV, axis=1), rtol=1e-6)


def test_bfloat16_matches_einsum_path_in_bfloat16() -> None:
    flash, ref = both_paths(128, 16, jnp.bfloat16, 32, 16)
    for name, got, want in zip(NAMES, flash, ref):
        assert np.all(np.isfinite(got)), name
        # bf16 keeps 8 significant bits: one step is 2**-8 of the value (0.016 at 2..4,
        # 0.03 at 4..8 for dv). Both paths round the probabilities to bf16 before the
        # value matmul (the kernel unnormalised per tile, the einsum path normalised) and
        # round their result, so entries may differ by a step or two: measured at most
        # one step (0.016) with a mean of 6e-4 over these unit-normal inputs.
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=2e-2, err_msg=name)
        assert np.mean(np.abs(got - want)) < 2e-3, name  # the typical entry agrees to the last bit


def test_cross_document_tiles_are_skipped() -> None:
    """The forward kernel's own loop counter, per query tile, against counts worked out by hand."""
    t, block = 128, 32
    q, k, v, _ = inputs(t, 16, jnp.float32)
    seg = jnp.asarray(rows(t))

    @jax.jit
    def run(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array) -> tuple:
        kw = dict(block_q=block, block_k=block, interpret=True)
        # bidirectional within each document: the same mask without its causal part
        same = (seg[:, :, None] == seg[:, None, :]) & (seg != 0)[:, None, :]
        mask = (same | jnp.eye(t, dtype=bool))[:, None]
        return (attention_with_visits(q, k, v, seg, **kw), attention_with_visits(q, k, v, seg, causal=False, **kw),
                dot_product_attention(q, k, v, mask, jnp.float32, None), block_schedule(seg, block, block))

    (out, visits), (full_out, full_visits), full_ref, sched = run(q, k, v, seg)
    expected = np.array([
        [1, 2, 3, 4],  # one document: the causal triangle, 10 of 16 tiles
        [1, 1, 1, 2],  # documents end at 20, 32, 64, 100: only tile 3 also reads tile 2 (document 4)
        [1, 2, 2, 1],  # 50 + 40 tokens: tile 2 reads tile 1 (document 2 starts at 50); tile 3 is padding
        [1, 1, 1, 1],  # only padding: the diagonal tiles alone
        [1, 2, 3, 4],  # interleaved: every block holds both documents, nothing can be skipped
    ])
    assert (np.asarray(visits) == expected[:, None, :]).all()  # the same for every query head
    np.testing.assert_array_equal(np.asarray(sched.kv_hi - sched.kv_lo), expected)
    # the dk/dv kernel's ranges, per key tile: key tile 2 of row 1 is read by query tiles 2 and 3
    np.testing.assert_array_equal(np.asarray(sched.q_hi - sched.q_lo)[1:4], [[1, 1, 2, 1], [2, 2, 1, 1], [1, 1, 1, 1]])
    # without causality a document's tiles read each other both ways, and still no other document's
    full = np.array([[4, 4, 4, 4], [1, 1, 2, 2], [2, 3, 2, 1], [1, 1, 1, 1], [4, 4, 4, 4]])
    assert (np.asarray(full_visits) == full[:, None, :]).all()
    np.testing.assert_allclose(np.asarray(full_out), np.asarray(full_ref), rtol=1e-5, atol=2e-5)  # as above
    assert np.isfinite(np.asarray(out)).all()


def test_kernels_lower_for_gpu_through_triton() -> None:
    """Lowering for CUDA runs Pallas' Triton lowering (tile shapes, ops) without a GPU; PTX is not built here."""
    b, t, d = 1, 512, 64
    q = jax.ShapeDtypeStruct((b, t, HQ, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, t, HKV, d), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def loss(q, k, v, seg):
        return segment_flash_attention(q, k, v, seg).astype(jnp.float32).sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    text = grad.trace(q, kv, kv, seg).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 3  # forward, dq, dk/dv


def test_model_with_pallas_attention_equals_the_einsum_path_on_a_mesh() -> None:
    """``attn_mechanism="pallas"``: a Llama over packed rows on fsdp 4 x tp 2 (shard_map around the kernel:
    rows over fsdp, heads over tp) gives the einsum path's loss and gradients (float32)."""
    from flax import nnx

    from scaletrain.models.llama.config import LlamaConfig
    from scaletrain.models.factory import create_sharded_model, mesh_for_config
    from scaletrain.models.llama import LlamaForCausalLM

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, sharding_axis_dims=(1, 4, 1, 2, 1))
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 64, (4, 64)), jnp.int32)
    seg = jnp.asarray(np.stack([row(64, 64), row(64, 20, 30), row(64, 40), row(64, 10, 10, 10, 34)]))
    pos = jnp.asarray(np.stack([np.concatenate([np.arange(n) for n in np.bincount(r)[1:] if n] +
                                               [np.zeros((r == 0).sum(), int)]) for r in np.asarray(seg)]))

    def loss_and_grads(mechanism: str) -> tuple[float, dict]:
        config = LlamaConfig(**kw, attn_mechanism=mechanism)
        model, mesh = create_sharded_model(LlamaForCausalLM, config, seed=0, mesh=mesh_for_config(config))

        def loss(m: LlamaForCausalLM) -> jax.Array:
            return jnp.mean(m(ids, positions=pos, segment_ids=seg).astype(jnp.float32) ** 2)

        with jax.set_mesh(mesh):
            value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
            traced = str(jax.make_jaxpr(lambda s: loss(nnx.merge(nnx.graphdef(model), s)))(nnx.state(model)))
        assert ("pallas_call" in traced) == (mechanism == "pallas") and ("shard_map" in traced) == (
            mechanism == "pallas")
        return float(value), nnx.to_pure_dict(grads)

    assert_same_loss_and_grads(loss_and_grads("pallas"), loss_and_grads("xla"))


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_sliding_window_models_with_pallas_equal_the_einsum_path(family: str) -> None:
    """A sliding window through the kernel (row distance, tiles out of reach skipped): Mistral's one
    window and Gemma 3's local/global layers over packed rows give the einsum path's loss and gradients."""
    from flax import nnx

    from scaletrain.models.mistral import MistralConfig
    from scaletrain.models.factory import create_sharded_model
    from scaletrain.models.gemma3 import Gemma3ForCausalLM
    from scaletrain.models.gemma3 import Gemma3TextConfig
    from scaletrain.models.mistral import MistralForCausalLM

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, sliding_window=20)
    module, config_class, extra = {
        "mistral": (MistralForCausalLM, MistralConfig, dict(num_hidden_layers=1)),
        "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig,
                   dict(num_hidden_layers=2, head_dim=8, layer_types=["sliding_attention", "full_attention"])),
    }[family]
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 64)), jnp.int32)
    seg = jnp.asarray(np.stack([row(64, 64), row(64, 40, 20)]))
    pos = jnp.asarray(np.stack([np.arange(64), np.concatenate([np.arange(40), np.arange(20), np.zeros(4, int)])]))

    def loss_and_grads(mechanism: str) -> tuple[float, dict]:
        model, mesh = create_sharded_model(module, config_class(**kw, **extra, attn_mechanism=mechanism), seed=0)

        def loss(m: nnx.Module) -> jax.Array:
            return jnp.mean(m(ids, positions=pos, segment_ids=seg).astype(jnp.float32) ** 2)

        with jax.set_mesh(mesh):
            value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
        return float(value), nnx.to_pure_dict(grads)

    assert_same_loss_and_grads(loss_and_grads("pallas"), loss_and_grads("xla"))


def test_sliding_window_is_exact_and_skips_tiles_out_of_reach() -> None:
    """Window 20, tiles of 16: values and gradients equal the einsum path with the window mask, and each
    query tile of a long document reads at most 3 key tiles (its own and the two the window reaches)."""
    t, block, window = 128, 16, 20
    q, k, v, do = inputs(t, 16, jnp.float32)
    seg = jnp.asarray(rows(t))
    positions = jnp.asarray(np.stack([np.concatenate([np.arange(n) for n in np.bincount(r)[1:] if n]
                                                     + [np.zeros((r == 0).sum(), int)]) if r.any() else np.zeros(t, int)
                                      for r in np.asarray(rows(t))]))

    @jax.jit
    def run(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array) -> tuple:
        kw = dict(block_q=block, block_k=block, interpret=True, window=window)
        out, vjp = jax.vjp(lambda *a: segment_flash_attention(*a, seg, **kw), q, k, v)
        mask = build_attention_mask(seg, positions, window)
        ref, ref_vjp = jax.vjp(lambda *a: dot_product_attention(*a, mask, jnp.float32, None), q, k, v)
        return (out, *vjp(do)), (ref, *ref_vjp(do)), attention_with_visits(q, k, v, seg, **kw)[1]

    got, want, visits = run(q, k, v, do)
    for i, case in enumerate(CASES[:4]):  # interleaved segments break "row distance = position distance"
        for name, a, w in zip(NAMES, got, want):
            # float32, summation order only (as test_float32_matches_einsum_path)
            np.testing.assert_allclose(np.asarray(a)[i], np.asarray(w)[i], rtol=1e-5, atol=2e-5,
                                       err_msg=f"{name}, {case}")
    assert np.asarray(visits)[0, 0].tolist() == [1, 2, 3, 3, 3, 3, 3, 3]  # one document: a band, not a triangle
