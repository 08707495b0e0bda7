"""The Llama-family module: shapes, parameter count, masking of packed rows, remat."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scaletrain import TaskType
from scaletrain.errors import ConfigError
from scaletrain.models import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    Qwen2Config,
    get_modules_by_type,
)
from scaletrain.models.options import REMAT_POLICIES


def _model(**kw):
    return LlamaForCausalLM(LlamaConfig(**kw), rngs=nnx.Rngs(0))


def test_param_count_matches_config(tiny_config_kwargs):
    for extra in ({}, {"tie_word_embeddings": True}, {"qkv_bias": True}, {"attention_bias": True}):
        cfg = LlamaConfig(**tiny_config_kwargs, **extra)
        model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
        actual = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert actual == cfg.num_params, extra


def test_logits_shape_and_dtype(tiny_config_kwargs):
    model = _model(**tiny_config_kwargs)
    logits = model(jnp.ones((2, 10), jnp.int32))
    assert logits.shape == (2, 10, 128)
    assert logits.dtype == jnp.float32


def test_packed_documents_do_not_attend_across(tiny_config_kwargs):
    """Doc B packed after doc A gives the same logits as doc B alone."""
    model = _model(**tiny_config_kwargs)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 128, 7), rng.integers(0, 128, 5)
    packed = np.concatenate([a, b, [0, 0, 0, 0]])[None]
    seg = np.array([[1] * 7 + [2] * 5 + [0] * 4])
    pos = np.array([list(range(7)) + list(range(5)) + [0] * 4])
    out = model(jnp.asarray(packed), jnp.asarray(pos), jnp.asarray(seg))
    alone_b = model(jnp.asarray(b[None]))
    alone_a = model(jnp.asarray(a[None]))
    np.testing.assert_allclose(out[0, 7:12], alone_b[0], atol=1e-5)
    np.testing.assert_allclose(out[0, :7], alone_a[0], atol=1e-5)
    assert np.isfinite(np.asarray(out)).all()  # padding rows stay finite


def test_causal(tiny_config_kwargs):
    """Changing a later token never changes earlier logits."""
    model = _model(**tiny_config_kwargs)
    x = jnp.arange(12)[None] % 128
    y = x.at[0, 8].set(99)
    np.testing.assert_allclose(model(x)[0, :8], model(y)[0, :8], atol=1e-6)
    assert not np.allclose(model(x)[0, 8:], model(y)[0, 8:])


def test_sliding_window_limits_attention(tiny_config_kwargs):
    cfg = MistralConfig(**tiny_config_kwargs, sliding_window=3)
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    x = jnp.arange(10)[None]
    y = x.at[0, 0].set(77)
    # token 5 sees positions 3..5 only, so changing token 0 cannot reach it (1 layer deep per hop)
    cfg1 = MistralConfig(**{**tiny_config_kwargs, "num_hidden_layers": 1}, sliding_window=3)
    m1 = LlamaForCausalLM(cfg1, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(m1(x)[0, 5:], m1(y)[0, 5:], atol=1e-6)
    assert model(x).shape == (1, 10, 128)


def test_remat_policy_names_have_one_source():
    """options.REMAT_POLICIES (read by config validation, no JAX) names what remat.POLICIES builds."""
    from scaletrain.models import options
    from scaletrain.models.common import remat

    assert set(remat.POLICIES) == set(options.REMAT_POLICIES) - {"none"}
    assert set(options.REMAT.values()) == set(options.REMAT_POLICIES)  # every accepted name runs a built policy
    for name in options.REMAT_POLICIES:
        assert options.remat_policy(name) == name


@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "none"])
def test_remat_gives_same_gradients(tiny_config_kwargs, policy):
    x = jnp.arange(16).reshape(2, 8) % 128

    def grads(remat):
        model = _model(**tiny_config_kwargs, gradient_checkpointing=remat)
        g, p = nnx.split(model)

        def loss(p):
            return jnp.mean(nnx.merge(g, p)(x) ** 2)

        return jax.grad(loss)(nnx.to_pure_dict(p))

    a, b = grads("none"), grads(policy)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-7), a, b)


def test_registry():
    for name, cfg_cls in (("llama", LlamaConfig), ("mistral", MistralConfig), ("qwen2", Qwen2Config)):
        config_class, module_class = get_modules_by_type(name, TaskType.CAUSAL_LM)
        assert config_class is cfg_cls
        assert module_class._model_type == name
        assert module_class._model_task == TaskType.CAUSAL_LM
    with pytest.raises(ConfigError, match="gpt9"):
        get_modules_by_type("gpt9", TaskType.CAUSAL_LM)


def test_qwen2_has_qkv_bias(tiny_config_kwargs):
    model = LlamaForCausalLM(Qwen2Config(**tiny_config_kwargs), rngs=nnx.Rngs(0))
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None


def test_config_validation_names_the_field(tiny_config_kwargs):
    with pytest.raises(ValueError, match="num_key_value_heads"):
        LlamaConfig(**{**tiny_config_kwargs, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="rope_scaling"):
        LlamaConfig(**tiny_config_kwargs, rope_scaling={"type": "dynamic", "factor": 2})


def test_bf16_compute_keeps_fp32_params(tiny_config_kwargs):
    model = LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs), dtype=jnp.bfloat16, param_dtype=jnp.float32,
                             rngs=nnx.Rngs(0))
    assert model.model.embed_tokens[...].dtype == jnp.float32
    assert model(jnp.ones((1, 4), jnp.int32)).dtype == jnp.bfloat16


@pytest.mark.parametrize("window", [None, 3])
def test_fused_attention_arguments_match_the_einsum_path(window):
    """The mask/causal/GQA arguments given to jax.nn.dot_product_attention (cuDNN on GPU)
    mean exactly what our einsum attention computes; checked here with its XLA implementation."""
    from scaletrain.models.kernels.attention import build_attention_mask, dot_product_attention, fused_attention

    rng = np.random.default_rng(0)
    b, t, nq, nkv, d = 2, 9, 4, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32) for n in (nq, nkv, nkv))
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1]])
    pos = jnp.asarray([[0, 1, 2, 0, 1, 2, 3, 0, 0], list(range(9))])
    mask = build_attention_mask(seg, pos, window)
    want = dot_product_attention(q, k, v, mask, jnp.float32, None)
    got = fused_attention(q, k, v, mask, implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 5, 64, 300])
def test_a_window_over_unpacked_rows_needs_no_mask_array(window):
    """Rows that are one unpadded sequence each with a sliding window give attention a
    ``CausalWindow`` instead of a [B, 1, T, S] mask: cuDNN gets it as ``local_window_size``
    (checked through JAX's XLA implementation of the same arguments) and the einsum path
    builds it from iotas. Both equal
    the einsum path with the mask ``build_attention_mask`` makes, in values and gradients;
    windows of one token, inside one query block, across blocks, and longer than the rows."""
    from scaletrain.models.kernels.attention import (
        CausalWindow,
        build_attention_mask,
        causal_blocks,
        dot_product_attention,
        fused_attention,
        prepare_inputs,
    )

    rng = np.random.default_rng(1)
    b, t, nq, nkv, d = 2, 256, 4, 2, 8
    ids = jnp.ones((b, t), jnp.int32)
    inputs = prepare_inputs(ids, None, None, None, window, jnp.ones((d // 2,)))
    assert inputs.mask == CausalWindow(window)
    assert prepare_inputs(ids, None, None, None, None, jnp.ones((d // 2,))).mask is None
    # a window over explicit positions: the array, which reads them; no window: plain causal, as before
    given = jnp.arange(t)[None].repeat(b, 0)
    assert prepare_inputs(ids, given, None, None, window, jnp.ones((d // 2,))).mask.shape == (b, 1, t, t)
    assert prepare_inputs(ids, given, None, None, None, jnp.ones((d // 2,))).mask is None
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32) for n in (nq, nkv, nkv))
    dense = build_attention_mask(jnp.ones((b, t), jnp.int32), jnp.arange(t)[None].repeat(b, 0), window)
    blocks = causal_blocks(t, t)
    assert blocks > 1

    cotangent = jnp.asarray(rng.normal(size=(b, t, nq, d)), jnp.float32)

    def out_and_grads(f):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(cotangent)

    want = out_and_grads(lambda q, k, v: dot_product_attention(q, k, v, dense, jnp.float32, None))
    for name, f in {
        "fused": lambda q, k, v: fused_attention(q, k, v, CausalWindow(window), implementation="xla"),
        "einsum": lambda q, k, v: dot_product_attention(q, k, v, CausalWindow(window), jnp.float32, None),
        "einsum blocks": lambda q, k, v: dot_product_attention(q, k, v, CausalWindow(window), jnp.float32, None,
                                                               blocks=blocks),
    }.items():
        got = out_and_grads(f)
        # float32, the same terms summed in another order (at most 256 keys or queries per entry)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5, err_msg=name)


def test_cudnn_attention_only_where_its_partitioner_takes_the_shards(tiny_config_kwargs):
    """JAX's cuDNN attention refuses a sequence sharded over devices and heads that do not
    divide over tp (both seen compiling for 8 H100s, bench/aot.py --dims 1,2,1,2,2 and
    1,2,1,4,1): ``auto`` falls back to the einsum path, a forced ``cudnn`` names the field."""
    from scaletrain.models.kernels.attention import use_fused_attention
    from scaletrain.parallel.mesh import create_mesh

    bf16 = jnp.dtype(jnp.bfloat16)
    assert use_fused_attention("cudnn", bf16, 64)
    assert not use_fused_attention("auto", bf16, 64, "a problem")
    assert not use_fused_attention("xla", bf16, 64)
    with pytest.raises(ConfigError, match="model.attn_mechanism: 'cudnn' a problem"):
        use_fused_attention("cudnn", bf16, 64, "a problem")

    attn = _model(**tiny_config_kwargs).model.layers[0].self_attn  # 4 query heads, 2 key/value heads
    assert attn._cudnn_sharding_problem(False) is None
    assert "sp > 1" in attn._cudnn_sharding_problem(True)
    for dims, ok in (((1, 4, 1, 2, 1), True), ((1, 2, 1, 4, 1), False)):
        with jax.set_mesh(create_mesh(dims)):
            assert (attn._cudnn_sharding_problem(False) is None) == ok, dims


@pytest.mark.parametrize("blocks", [1, 3])
def test_attention_without_a_mask_is_causal_attention(blocks):
    """``mask=None`` (rows that are one unpadded sequence) equals the causal mask of one
    segment, in the einsum path (whole and in query blocks) and in the arguments given to
    cuDNN, checked through JAX's XLA implementation."""
    from scaletrain.models.kernels.attention import build_attention_mask, dot_product_attention, fused_attention

    rng = np.random.default_rng(2)
    b, t, nq, nkv, d = 2, 12, 4, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32) for n in (nq, nkv, nkv))
    seg = jnp.ones((b, t), jnp.int32)
    mask = build_attention_mask(seg, jnp.broadcast_to(jnp.arange(t), (b, t)), None)
    cot = jnp.asarray(rng.normal(size=(b, t, nq, d)), jnp.float32)

    def f(m):
        return lambda q, k, v: jnp.sum(dot_product_attention(q, k, v, m, jnp.float32, None, blocks=blocks) * cot)

    want, want_grads = jax.value_and_grad(f(mask), argnums=(0, 1, 2))(q, k, v)
    got, got_grads = jax.value_and_grad(f(None), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    fused = fused_attention(q, k, v, None, implementation="xla")
    np.testing.assert_allclose(np.asarray(fused), np.asarray(dot_product_attention(q, k, v, mask, jnp.float32, None)),
                               rtol=1e-5, atol=1e-5)


def test_model_without_segments_equals_one_segment(tiny_config_kwargs):
    """No segment ids, positions or attention mask: the same logits as one segment per row."""
    model = _model(**tiny_config_kwargs)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 16)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(16), ids.shape)
    np.testing.assert_allclose(np.asarray(model(ids)), np.asarray(model(ids, pos, jnp.ones_like(ids))),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("blocks", [2, 3, 4])
@pytest.mark.parametrize("window", [None, 5])
def test_causal_query_blocks_equal_full_attention(blocks, window):
    """Skipping the score blocks above the diagonal changes nothing but the work done,
    for packed rows, padding and sliding windows, in values and gradients."""
    from scaletrain.models.kernels.attention import build_attention_mask, dot_product_attention

    rng = np.random.default_rng(1)
    b, t, nq, nkv, d = 2, 12, 4, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32) for n in (nq, nkv, nkv))
    seg = jnp.asarray([[1] * 5 + [2] * 5 + [0] * 2, [1] * 12])
    pos = jnp.asarray([list(range(5)) * 2 + [0, 0], list(range(12))])
    mask = build_attention_mask(seg, pos, window)
    cot = jnp.asarray(rng.normal(size=(b, t, nq, d)), jnp.float32)

    def f(n):
        return lambda q, k, v: jnp.sum(dot_product_attention(q, k, v, mask, jnp.float32, None, blocks=n) * cot)

    want, want_grads = jax.value_and_grad(f(1), argnums=(0, 1, 2))(q, k, v)
    got, got_grads = jax.value_and_grad(f(blocks), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_model_uses_causal_blocks_without_changing_results(tiny_config_kwargs, monkeypatch):
    """The whole model with the blocked attention (forced on for a short sequence) agrees
    with full attention in logits and parameter gradients."""
    import scaletrain.models.kernels.attention as attention

    model = _model(**tiny_config_kwargs)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 16)), jnp.int32)

    def loss(m):
        return jnp.mean(m(ids) ** 2)

    monkeypatch.setattr(attention, "MAX_CAUSAL_BLOCKS", 1)
    want = nnx.grad(loss)(model)
    assert attention.causal_blocks(16, 16) == 1
    monkeypatch.setattr(attention, "MAX_CAUSAL_BLOCKS", 4)
    monkeypatch.setattr(attention, "MIN_CAUSAL_BLOCK", 4)
    assert attention.causal_blocks(16, 16) == 4
    got = nnx.grad(loss)(model)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)


def test_causal_blocks_only_for_self_attention_that_divides():
    from scaletrain.models.kernels.attention import causal_blocks

    assert causal_blocks(256, 256) == 2
    assert causal_blocks(2048, 2048) == 4
    assert causal_blocks(100, 100) == 1  # shorter than two blocks
    assert causal_blocks(384, 384) == 3  # 4 does not divide 384
    assert causal_blocks(256, 512) == 1  # queries against a longer cache: not causal self-attention


@pytest.mark.parametrize("dims,expected", [((1, 1, 1, 1, 1), 2), ((1, 1, 1, 1, 2), 1)])
def test_no_query_blocks_when_the_sequence_is_split_over_devices(tiny_config_kwargs, monkeypatch, dims, expected):
    """Query blocks slice the sequence axis; under sequence parallelism that would move data."""
    import scaletrain.models.common.layers as layers
    from scaletrain.parallel import create_mesh

    seen = []
    original = layers.dot_product_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("blocks", 1))
        return original(*args, **kwargs)

    monkeypatch.setattr(layers, "dot_product_attention", spy)
    model = _model(**tiny_config_kwargs)
    mesh = create_mesh(dims, devices=jax.devices()[: int(np.prod(dims))])
    with jax.set_mesh(mesh):
        jax.eval_shape(lambda ids: model(ids), jax.ShapeDtypeStruct((2, 256), jnp.int32))
    assert seen and set(seen) == {expected}
