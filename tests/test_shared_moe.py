"""Sigmoid group-limited routing with the correction bias, and the shared-expert MoE block, against
transformers' own torch modules (DeepSeek-V3's router and MoE block, Qwen3-Next's gated shared expert).

The blocks are checked alone, on random weights copied from the torch module, so a failure names
the component; the families built on them (deepseek_v3, glm4_moe) are checked whole in the
conformance suite. Tolerance: float32 outputs within 1e-5 of the largest (measured below 1e-6),
the same sums in another order.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scaletrain.models.common.routing import group_limited_top_k, routing_problem
from scaletrain.models.common.shared_moe import SharedExpertMoe

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HIDDEN, EXPERTS, WIDTH = 32, 8, 16


def _randomise(module: object, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.3 * torch.randn_like(p))


def _ours(hf_config: object, router: str, **kw: object) -> SharedExpertMoe:
    """Our block for the torch block's config (the fields the block reads)."""
    c = hf_config
    config = SimpleNamespace(hidden_size=HIDDEN, initializer_range=0.02, mlp_bias=False, intermediate_size=0,
                             num_experts_per_tok=c.num_experts_per_tok, n_group=getattr(c, "n_group", 1),
                             topk_group=getattr(c, "topk_group", 1), norm_topk_prob=c.norm_topk_prob,
                             routed_scaling_factor=getattr(c, "routed_scaling_factor", 1.0))
    return SharedExpertMoe(config, EXPERTS, WIDTH, kw.pop("shared", WIDTH), router=router, dtype=jnp.float32,
                           param_dtype=jnp.float32, precision=None, rngs=nnx.Rngs(0), **kw)


def _copy(hf_block: object, ours: SharedExpertMoe, shared: str) -> None:
    """The torch block's weights into ours: [out, in] linears transposed, fused gate_up split."""
    t = lambda x: jnp.asarray(x.detach().numpy())  # noqa: E731
    ours.gate.kernel[...] = t(hf_block.gate.weight).T
    if hasattr(hf_block.gate, "e_score_correction_bias"):
        ours.gate.e_score_correction_bias[...] = t(hf_block.gate.e_score_correction_bias)
    gate_up, down = t(hf_block.experts.gate_up_proj), t(hf_block.experts.down_proj)
    ours.experts.gate_proj[...] = gate_up[:, :WIDTH].transpose(0, 2, 1)
    ours.experts.up_proj[...] = gate_up[:, WIDTH:].transpose(0, 2, 1)
    ours.experts.down_proj[...] = down.transpose(0, 2, 1)
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(getattr(ours, shared), name).kernel[...] = t(getattr(getattr(hf_block, shared), name).weight).T
    if getattr(hf_block, "shared_expert_gate", None) is not None:
        ours.shared_expert_gate.kernel[...] = t(hf_block.shared_expert_gate.weight).T


def _x(seed: int = 1) -> np.ndarray:
    return np.random.RandomState(seed).randn(2, 9, HIDDEN).astype(np.float32)


def test_sigmoid_grouped_routing_with_bias_equals_deepseek_v3_moe() -> None:
    """DeepSeek-V3's block (4 groups of 2 experts, best 2 groups, top-2, renormalised, scaled by 2.5, two
    shared experts) with a correction bias that changes the choice: the same experts, weights and output."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = transformers.DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=2,
                                           n_group=4, topk_group=2, moe_intermediate_size=WIDTH, n_shared_experts=2,
                                           routed_scaling_factor=2.5, norm_topk_prob=True)
    hf = DeepseekV3MoE(config).eval()
    _randomise(hf, 0)
    hf.gate.e_score_correction_bias.copy_(0.5 * torch.randn(EXPERTS))
    ours = _ours(config, "sigmoid", shared=2 * WIDTH)
    _copy(hf, ours, "shared_experts")
    x = _x()
    with torch.no_grad():
        _, hf_weights, hf_experts = hf.gate(torch.tensor(x))
        want = hf(torch.tensor(x)).numpy()
    logits, weights, experts, _ = ours.gate(jnp.asarray(x))
    order = np.argsort(np.asarray(experts).reshape(-1, 2), axis=-1)
    hf_order = np.argsort(hf_experts.numpy(), axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts).reshape(-1, 2), order, -1),
                                  np.take_along_axis(hf_experts.numpy(), hf_order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights).reshape(-1, 2), order, -1),
                               np.take_along_axis(hf_weights.numpy(), hf_order, -1), rtol=1e-5)
    # the bias took part: without it some token picks other experts
    unbiased = group_limited_top_k(jnp.asarray(1 / (1 + np.exp(-np.asarray(logits)))), 2, 4, 2)
    assert not np.array_equal(np.sort(np.asarray(unbiased), -1), np.sort(np.asarray(experts), -1))
    got, stats = ours(jnp.asarray(x), jnp.ones(x.shape[:2]))
    assert np.abs(np.asarray(got) - want).max() / np.abs(want).max() < 1e-5
    assert float(stats.counts.sum()) == 2 * x.shape[0] * x.shape[1] and float(stats.rows) == 18


def test_gated_shared_expert_with_softmax_routing_equals_qwen3_next_block() -> None:
    """Qwen3-Next's sparse block: softmax top-2 renormalised, one shared expert scaled by sigmoid(gate(x))."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    config = transformers.Qwen3NextConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=2,
                                          moe_intermediate_size=WIDTH, shared_expert_intermediate_size=WIDTH,
                                          norm_topk_prob=True)
    hf = Qwen3NextSparseMoeBlock(config).eval()
    _randomise(hf, 1)
    ours = _ours(config, "softmax", shared_name="shared_expert", gated=True)
    _copy(hf, ours, "shared_expert")
    x = _x(2)
    with torch.no_grad():
        want = hf(torch.tensor(x)).numpy()
    got, _ = ours(jnp.asarray(x), jnp.ones(x.shape[:2]))
    assert np.abs(np.asarray(got) - want).max() / np.abs(want).max() < 1e-5


def test_routing_problems_name_the_key() -> None:
    """Group-limited routing options that cannot route, each refused naming transformers' key."""
    assert "not divisible by n_group" in routing_problem(8, 2, 3, 1)
    assert "at least 2" in routing_problem(8, 2, 8, 2)
    assert "topk_group 3" in routing_problem(8, 2, 2, 3)
    assert "num_experts_per_tok 5" in routing_problem(8, 5, 4, 2)
    assert routing_problem(8, 2, 4, 2) is None
