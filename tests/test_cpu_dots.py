"""The CPU matmul's custom VJP gives jax.grad of the plain dot_general, and only YNNPACK dots."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from scaletrain.models.kernels.cpu_dots import _cpu_matmul, _dims

# (a shape, b shape, batch dims, rhs transposed): the weight gradient of each case goes
# through both branches of _contract_m (transpose the input vs. the output gradient)
CASES = [
    ((2, 8, 16), (16, 64), 0, False),  # Dense, x^T copied: [B, T, in] @ [in, out]
    ((2, 8, 64), (64, 16), 0, False),  # Dense, dy^T copied (down_proj-like)
    ((2, 8, 16), (64, 16), 0, True),  # tied LM head: h @ embed^T
    ((2, 3, 2, 8, 4), (2, 3, 8, 4), 2, True),  # attention scores [b, kv, g, t, d] x [b, kv, s, d]
    ((2, 3, 2, 8, 8), (2, 3, 8, 4), 2, False),  # attention probs @ values
]


@pytest.mark.parametrize("a_shape,b_shape,batch,rhs_t", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grads_match_plain_dot(a_shape, b_shape, batch, rhs_t, dtype):
    ka, kb, kc = jax.random.split(jax.random.key(0), 3)
    a = jax.random.normal(ka, a_shape, dtype)
    b = jax.random.normal(kb, b_shape, dtype)

    def plain(a, b):
        return lax.dot_general(a, b, _dims(a, b, batch, rhs_t))

    out = plain(a, b)
    ct = jax.random.normal(kc, out.shape, dtype)
    custom_out, custom_vjp = jax.vjp(lambda a, b: _cpu_matmul(a, b, batch, rhs_t, None), a, b)
    plain_out, plain_vjp = jax.vjp(plain, a, b)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_array_equal(np.asarray(custom_out, np.float32), np.asarray(plain_out, np.float32))
    for got, want in zip(custom_vjp(ct), plain_vjp(ct), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


def test_backward_has_no_eigen_dot():
    """A Dense layer's forward, input-gradient and weight-gradient dots all run on YNNPACK (no Eigen ``dot``)."""
    x = jnp.ones((4, 64, 32))
    w = jnp.ones((32, 128))
    f = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.tanh(_cpu_matmul(x, w, 0, False, None))), argnums=(0, 1)))
    hlo = f.lower(x, w).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    assert not re.search(r"= \S+ dot\(", entry)
    assert len(re.findall(r"ynn_fusion[.\d]* = ", entry)) == 3


@pytest.mark.parametrize("tied", [False, True])
def test_model_grads_match_plain_dots(tiny_config_kwargs, monkeypatch, tied):
    """The whole Llama's loss gradient is the same with the CPU matmul and with plain dot_generals."""
    from flax import nnx

    from scaletrain.models import LlamaConfig, LlamaForCausalLM
    from scaletrain.models.kernels import cpu_dots

    model = LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs, tie_word_embeddings=tied), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    ids = jax.random.randint(jax.random.key(1), (2, 16), 0, 128)

    def loss(p):
        logits = nnx.merge(graphdef, p)(ids)
        return jnp.mean(jax.nn.log_softmax(logits[:, :-1]) * jax.nn.one_hot(ids[:, 1:], 128))

    custom = jax.grad(loss)(params)
    monkeypatch.setattr(cpu_dots, "_cpu_matmul",
                        lambda a, b, batch, rhs_t, precision: lax.dot_general(a, b, _dims(a, b, batch, rhs_t)))
    plain = jax.grad(loss)(params)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7),
                 custom, plain)


@pytest.mark.parametrize("policy,extra", [("dots", 0), ("dots_with_no_batch_dims", 4)])
def test_remat_dot_policies_still_save_matmuls(tiny_config_kwargs, policy, extra):
    """The custom VJP hides dot_general from checkpoint_dots; the named outputs keep the policies' meaning.

    ``dots`` recomputes no matmul in the backward, ``dots_with_no_batch_dims`` only the
    two attention matmuls per layer (2 layers).
    """
    from flax import nnx

    from scaletrain.models import LlamaConfig, LlamaForCausalLM

    ids = jnp.ones((2, 16), jnp.int32)

    def count_dots(remat):
        model = LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs, gradient_checkpointing=remat), rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(model)
        f = jax.jit(jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(ids) ** 2)))
        return f.lower(params).as_text().count("stablehlo.dot_general")

    assert count_dots(policy) == count_dots("none") + extra


def test_forward_only_traces_the_plain_dot_with_the_same_bits_and_ends_with_its_block():
    """Inside ``forward_only`` (the rollout engines' programs) matmul is traced without its custom VJP, to the same
    ``dot_general`` and so the same bits; outside it, and after it, the custom VJP is back (a gradient still works)."""
    from scaletrain.models.kernels.cpu_dots import forward_only, matmul, traced_forward_only

    a = jax.random.normal(jax.random.key(1), (4, 16))
    w = jax.random.normal(jax.random.key(2), (16, 8))
    def f(a, w):
        return matmul(a, w)

    with forward_only():  # a function of its own per trace: JAX caches a trace by function, not by context
        plain = jax.make_jaxpr(lambda a, w: f(a, w))(a, w)
    custom = jax.make_jaxpr(lambda a, w: f(a, w))(a, w)
    assert "custom_vjp_call" not in str(plain) and "custom_vjp_call" in str(custom)
    np.testing.assert_array_equal(jax.jit(traced_forward_only(f))(a, w), jax.jit(f)(a, w))
    grad = jax.grad(lambda w: jnp.sum(matmul(a, w) ** 2))(w)
    np.testing.assert_allclose(grad, 2 * a.T @ (a @ w), rtol=1e-5, atol=1e-5)
