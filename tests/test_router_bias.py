"""DeepSeek's auxiliary-loss-free balancing (``router_bias_update_rate``) on a real tiny DeepSeek-V3.

One dense layer, then one MoE layer of 8 experts in 2 groups (top-2 from the best group). The
router is skewed by a correction bias of +1 on experts 0 and 1, which every token's choice then
takes. The steps run as the trainer runs them (``make_optimizer`` with what ``outside_optimizer``
leaves out, ``make_step_functions``), on one device; one compile per configuration.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from scaletrain.arguments import TrainingArguments
from scaletrain.errors import ConfigError
from scaletrain.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from scaletrain.models.factory import place_model
from scaletrain.objectives import LanguageModelObjective
from scaletrain.parallel import create_mesh
from scaletrain.peft.lora_config import LoRAConfig
from scaletrain.training.checkpoint import Checkpointer
from scaletrain.training.optim import make_optimizer, make_schedule
from scaletrain.training.router_bias import BIAS, outside_optimizer
from scaletrain.training.state import create_train_state, state_shardings
from scaletrain.training.steps import make_step_functions

MODEL = dict(vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2, first_k_dense_replace=1,
             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, n_routed_experts=8,
             num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=16, n_shared_experts=1,
             kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
SKEW = np.array([1, 1, 0, 0, 0, 0, 0, 0], np.float32)  # above any sigmoid score: experts 0 and 1 always win
RATE = 0.02
STEPS = 40


def _batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    seg = np.ones((8, 16), np.int32)
    seg[::3, 12:] = 0  # padding: not counted as load
    return {"input_ids": rng.integers(0, 128, (8, 16)).astype(np.int32), "segment_ids": seg}


def _initial(rate: float, skew: np.ndarray) -> tuple[object, dict]:
    """The abstract model of ``rate`` and its parameters drawn with numpy (an initialiser would compile)."""
    graphdef, shapes = nnx.split(nnx.eval_shape(
        lambda: DeepseekV3ForCausalLM(DeepseekV3Config(**MODEL, router_bias_update_rate=rate), rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(3)
    params = jax.tree.map(lambda s: (0.2 * rng.standard_normal(s.shape)).astype(s.dtype), nnx.to_pure_dict(shapes))
    params["model"]["layers"][1]["mlp"]["gate"][BIAS] = skew.copy()
    return graphdef, params


def _trainer(rate: float, skew: np.ndarray = SKEW, accumulation: int = 1):
    """``(state, train step)`` as the trainer builds them, Adam at a constant learning rate."""
    graphdef, params = _initial(rate, skew)
    mesh = create_mesh((1, 1, 1, 1, 1), devices=jax.devices()[:1])
    model, mesh = place_model(nnx.merge(graphdef, params), mesh)
    args = TrainingArguments(total_batch_size=8, max_length=16, max_training_steps=10, warmup_steps=0,
                             learning_rate=1e-2, scheduler="constant")
    tx = make_optimizer(args, make_schedule(args, 10), outside_optimizer(model.config, None))
    state = create_train_state(model, tx, mesh)
    sharding = NamedSharding(mesh, PartitionSpec(("dp", "fsdp"), "sp"))
    train, _ = make_step_functions(tx, state_shardings(state), sharding, NamedSharding(mesh, PartitionSpec()),
                                   LanguageModelObjective(), gradient_accumulation_steps=accumulation)
    return mesh, state, lambda s: train(s, jax.device_put(_batch(), sharding))


def _bias(params: dict) -> np.ndarray:
    return np.asarray(params["model"]["layers"][1]["mlp"]["gate"][BIAS])


_COUNTS: dict[int, object] = {}


def _counts(graphdef):
    """The router's counts [L, E] of the model ``graphdef`` on given parameters and rows, jitted once."""
    def counts(params: dict, ids: jax.Array, segments: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, params).hidden_states_and_aux(ids, segment_ids=segments)[1]["router"].counts
    return _COUNTS.setdefault(id(graphdef), jax.jit(counts))


def _layer_loads(graphdef, params: dict, rows: slice = slice(None)) -> np.ndarray:
    """The MoE layer's tokens per expert on ``rows`` of the batch, from the model's own forward."""
    batch = _batch()
    return np.asarray(_counts(graphdef)(params, batch["input_ids"][rows], batch["segment_ids"][rows]))[1]


@pytest.fixture(scope="module")
def balancing():
    """``STEPS`` steps with the update on: the parameters (on the host) before and after each step, their
    metrics, and a copy of the state after step 3 (the step donates the one it is given)."""
    mesh, state, step = _trainer(RATE)
    params, metrics = [jax.device_get(state.params)], []
    with jax.set_mesh(mesh):
        for k in range(STEPS):
            if k == 3:
                third = jax.tree.map(jnp.copy, state)
            state, m = step(state)
            params.append(jax.device_get(state.params))
            metrics.append(jax.device_get(m))
    return mesh, step, state.graphdef, params, metrics, third


def test_router_bias_moves_toward_balance_on_a_skewed_router(balancing) -> None:
    """Each step moves the MoE layer's bias by ``rate * sign(mean load - load)`` from that step's loads (the
    dense layer has none), logged per expert; the busiest expert's load falls from 4x the mean (every token
    on experts 0 and 1) toward 1. The bias has no optimizer moments."""
    mesh, _, graphdef, params, metrics, third = balancing
    for before, after in zip(params, params[1:]):
        loads = _layer_loads(graphdef, before)
        expected = _bias(before) + np.float32(RATE) * np.sign(loads.mean() - loads).astype(np.float32)
        np.testing.assert_array_equal(_bias(after), expected)
    assert metrics[0]["moe/max_expert_load"] == 4.0
    busiest = [float(m["moe/max_expert_load"]) for m in metrics]
    assert np.mean(busiest[-10:]) <= 2.0, busiest
    np.testing.assert_array_equal([metrics[-1][f"moe/expert_{e}_bias"] for e in range(8)], _bias(params[-1]))
    # Adam's moments: none for the bias, one mu and one nu for every other parameter
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(third.opt_state)[0]]
    assert not [p for p in paths if BIAS in p]
    assert len([p for p in paths if ".mu" in p]) == len(jax.tree.leaves(params[0])) - 1, paths[:4]


def test_router_bias_is_in_the_checkpoint_and_equal_after_resume(balancing, tmp_path) -> None:
    """A checkpoint of step 3 holds the moved bias; restored into a fresh state (the skewed bias of the
    folder it started from) it is bitwise the saved one, and the next steps equal the uninterrupted run's."""
    mesh, step, _, params, _, third = balancing
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"))
    checkpointer.save(3, third, {}, {})
    checkpointer.wait()
    _, template, _ = _trainer(RATE)
    with jax.set_mesh(mesh):
        restored, _, _ = checkpointer.restore(3, template)
        np.testing.assert_array_equal(_bias(restored.params), _bias(params[3]))
        assert not np.array_equal(_bias(restored.params), SKEW)
        for k in (4, 5):
            restored, _ = step(restored)
            for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(params[k]), strict=True):
                np.testing.assert_array_equal(np.asarray(a), b)
    checkpointer.close()


def test_router_bias_update_sums_loads_over_micro_batches() -> None:
    """With 2 micro-batches the bias moves by the loads of the whole batch (their sum), not by either
    micro-batch's: on an unskewed random router the two give a different direction, and the step takes
    the whole batch's."""
    mesh, state, step = _trainer(RATE, skew=np.zeros(8, np.float32), accumulation=2)
    initial = jax.device_get(state.params)
    first, second = (_layer_loads(state.graphdef, initial, slice(k, None, 2)) for k in (0, 1))
    with jax.set_mesh(mesh):
        new, _ = step(state)
    total = first + second
    direction = np.sign(total.mean() - total)
    assert not np.array_equal(direction, np.sign(first.mean() - first))  # the sum is what tells them apart
    np.testing.assert_array_equal(_bias(new.params), np.float32(RATE) * direction.astype(np.float32))


def test_router_bias_update_off_by_default_changes_nothing(balancing) -> None:
    """The default rate is 0: the optimizer is the plain one (the bias keeps its zero moments), the step
    reports no bias and no per-layer loads, the bias stays bitwise where the checkpoint put it, and every
    other parameter after a step is the one the run with the update got (which moves the bias after the
    optimizer, on this step's loads, and nothing else), within a rounding's share of the learning rate."""
    assert DeepseekV3Config().router_bias_update_rate == 0.0
    mesh, state, step = _trainer(0.0)
    assert outside_optimizer(state.model.config, None) is None
    with jax.set_mesh(mesh):
        new, metrics = step(state)
    assert not [k for k in metrics if k.endswith("_bias")]
    np.testing.assert_array_equal(_bias(new.params), SKEW)
    on = balancing[3][1]
    off_rest, on_rest = (jax.tree_util.tree_flatten_with_path(p)[0] for p in (new.params, on))
    for (path, a), (_, b) in zip(off_rest, on_rest, strict=True):
        if BIAS not in jax.tree_util.keystr(path):
            # two programs (with and without the bias update), fused apart by XLA's CPU loop emitters (the
            # suite's cheap compile): one AdamW step at lr 1e-2 moves an element whose gradient is near eps by a
            # rounding's share of lr (measured 5.2e-6 at most), so 1e-3 * lr; a leak moves elements by O(lr)
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5,
                                       err_msg=jax.tree_util.keystr(path))


def test_router_bias_update_bad_settings_are_one_line() -> None:
    """A negative rate names the key; asking for the update with LoRA (whose frozen base holds the bias)
    says what to do."""
    with pytest.raises(ValueError, match="router_bias_update_rate -0.1 must be at least 0"):
        DeepseekV3Config(**MODEL, router_bias_update_rate=-0.1)
    with pytest.raises(ConfigError) as err:
        outside_optimizer(DeepseekV3Config(**MODEL, router_bias_update_rate=0.001), LoRAConfig())
    assert str(err.value).startswith("model.router_bias_update_rate: ") and "\n" not in str(err.value)
