"""create_sharded_model makes identical layers with one compiled initialiser, with the values
of a whole-model initialiser (models/common/unrolled_layers.py, factory.Initialiser)."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax import monitoring

from scaletrain.models import factory
from scaletrain.models.llama.config import LlamaConfig
from scaletrain.models.llama import LlamaForCausalLM

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64)


def _arrays(model: nnx.Module) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model)))}


def test_sharded_model_equals_one_whole_model_program():
    """Bit for bit: the per-layer programs draw exactly what the old single jit(init) drew.

    Mixtral's (router, stacked experts) and Gemma 3's layers are built by the same
    LlamaModel constructor (``layer_class``), so one family stands for all."""
    module_class, config = LlamaForCausalLM, LlamaConfig(**SMALL, num_hidden_layers=3, tie_word_embeddings=False)
    model, mesh = factory.create_sharded_model(module_class, config, seed=7)
    with jax.set_mesh(mesh):
        whole = jax.jit(lambda: nnx.to_pure_dict(nnx.state(module_class(config, rngs=nnx.Rngs(7)))))()
    got, want = _arrays(model), {jax.tree_util.keystr(p): np.asarray(x)
                                 for p, x in jax.tree_util.tree_leaves_with_path(whole)}
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # layers differ from each other (each has its own key) and every array keeps its sharding
    layers = nnx.to_pure_dict(nnx.state(model))["model"]["layers"]
    q0, q1 = (layers[i]["self_attn"]["q_proj"]["kernel"] for i in (0, 1))
    assert not np.array_equal(np.asarray(q0), np.asarray(q1))
    abstract = factory.abstract_sharded_model(module_class, config, mesh=mesh)[1]
    assert q1.sharding == abstract["model"]["layers"][1]["self_attn"]["q_proj"]["kernel"].sharding


def test_depth_does_not_add_initialiser_compiles():
    """1 and 4 layers lower the same number of programs: the rest of the model and one layer."""
    lowered: list[str] = []

    def listen(event: str, duration: float, **_: object) -> None:
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(event)

    monitoring.register_event_duration_secs_listener(listen)
    try:
        counts = []
        for layers in (1, 4):
            config = LlamaConfig(**dict(SMALL, hidden_size=24), num_hidden_layers=layers)
            lowered.clear()
            factory.create_sharded_model(LlamaForCausalLM, config, seed=0)
            counts.append(len(lowered))
    finally:
        monitoring.unregister_event_duration_listener(listen)
    assert counts[0] == counts[1] == 2, counts


def test_layers_of_different_shapes_get_their_own_program():
    """_groups keys layers by structure, shapes and shardings: a differing layer is its own group."""
    same = {"w": jax.ShapeDtypeStruct((4, 8), np.float32)}
    other = {"w": jax.ShapeDtypeStruct((4, 16), np.float32)}
    shard = {"w": None}
    groups = factory._groups({0: same, 1: other, 2: same, 3: same}, {i: shard for i in range(4)})
    assert groups == {0: [0, 2, 3], 1: [1]}
