"""The shared decoder's contract: the blocks' auxiliary outputs and their shapes, and one forward
whose cached (decoding) and uncached (training) runs agree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scaletrain.models import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM
from scaletrain.models.mixtral import MixtralConfig, MixtralForCausalLM

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def test_a_dense_model_has_no_auxiliary_outputs() -> None:
    model = LlamaForCausalLM(LlamaConfig(**SMALL), rngs=nnx.Rngs(0))
    hidden, aux = model.hidden_states_and_aux(jnp.ones((2, 8), jnp.int32))
    assert hidden.shape == (2, 8, 32) and aux == {} and model.aux_shapes() == {}


@pytest.mark.parametrize("scan_layers", [False, True])
def test_moe_aux_shapes_are_what_the_forward_returns(scan_layers: bool) -> None:
    """``aux_shapes()`` (known without tracing) equals the traced forward's ``aux``: router statistics per layer."""
    model = nnx.eval_shape(lambda: MixtralForCausalLM(
        MixtralConfig(**SMALL, num_local_experts=4, scan_layers=scan_layers), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    traced = jax.eval_shape(lambda s, ids: nnx.merge(graphdef, s).hidden_states_and_aux(ids)[1], state,
                            jax.ShapeDtypeStruct((2, 8), jnp.int32))
    assert jax.tree.map(lambda s: (s.shape, s.dtype), traced) == jax.tree.map(
        lambda s: (s.shape, s.dtype), model.aux_shapes())
    assert model.aux_shapes()["router"].counts.shape == (2, 4)
    assert model.router_stats_shape() == model.aux_shapes()["router"]


@pytest.mark.parametrize("scan_layers", [False, True])
def test_the_cached_forward_is_the_training_forward(scan_layers: bool) -> None:
    """Gemma 3 (a local and a global layer: both kinds, a window shorter than the row): the prefill through
    the cache gives the training forward's hidden states, and so does decoding the last token alone."""
    config = Gemma3TextConfig(**{**SMALL, "num_attention_heads": 2, "num_key_value_heads": 1}, head_dim=16,
                              sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                              scan_layers=scan_layers)
    model = Gemma3ForCausalLM(config, rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 10)), jnp.int32)
    want = model.hidden_states(ids)
    positions = jnp.broadcast_to(jnp.arange(10, dtype=jnp.int32), (2, 10))
    kv_valid = jnp.ones((2, 10), bool)
    prefill, _ = model.forward_with_cache(ids, positions, model.init_cache(2, 10), jnp.int32(0), kv_valid)
    np.testing.assert_allclose(np.asarray(prefill), np.asarray(want), rtol=1e-5, atol=1e-5)
    _, cache = model.forward_with_cache(ids[:, :9], positions[:, :9], model.init_cache(2, 10), jnp.int32(0),
                                        kv_valid.at[:, 9].set(False))
    last, _ = model.forward_with_cache(ids[:, 9:], positions[:, 9:], cache, jnp.int32(9), kv_valid)
    np.testing.assert_allclose(np.asarray(last[:, 0]), np.asarray(want[:, 9]), rtol=1e-5, atol=1e-5)


def test_placement_set_after_building_reaches_the_layers() -> None:
    """The layers keep no copy of the placement: a runtime key set on a built model's config (what loading
    a pretrained model with ``model.attn_softmax_dtype`` does) is what its attention runs with, as if the
    model had been built with it."""
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 8)), jnp.int32)
    built_with = LlamaForCausalLM(LlamaConfig(**SMALL, attn_softmax_dtype="bfloat16"), rngs=nnx.Rngs(0))
    model = LlamaForCausalLM(LlamaConfig(**SMALL), rngs=nnx.Rngs(0))
    float32 = model.hidden_states(ids)
    model.config.attn_softmax_dtype = "bfloat16"
    assert model.config.placement.attn_softmax_dtype == "bfloat16"
    bf16 = model.hidden_states(ids)
    assert not np.allclose(np.asarray(bf16), np.asarray(float32), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(bf16), np.asarray(built_with.hidden_states(ids)))
