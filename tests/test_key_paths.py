"""scaletrain.key_paths: the one spelling of a pytree key path, for every key entry JAX makes."""

import collections

import jax
import jax.numpy as jnp
import optax
from flax import struct

from scaletrain.key_paths import dotted, key_name, key_names


@struct.dataclass
class _State:
    step: jax.Array
    params: dict


_Pair = collections.namedtuple("_Pair", "mu nu")


def test_every_key_entry_is_its_bare_key():
    tree = {"model": {"layers": [{"kernel": jnp.ones(2)}, (jnp.ones(1),)]},
            "state": _State(jnp.zeros(()), {3: _Pair(jnp.ones(1), jnp.ones(1))}),
            "opt": optax.adamw(1e-3).init({"w": jnp.ones(2)})}
    names = sorted(dotted(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0])
    assert names == ["model.layers.0.kernel", "model.layers.1.0", "opt.0.count", "opt.0.mu.w", "opt.0.nu.w",
                     "state.params.3.mu", "state.params.3.nu", "state.step"]
    kinds = {type(k).__name__ for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0] for k in path}
    assert kinds == {"DictKey", "SequenceKey", "GetAttrKey"}  # each spelling above was exercised


def test_separator_and_plain_entries():
    path = (jax.tree_util.DictKey("model"), jax.tree_util.SequenceKey(2), jax.tree_util.FlattenedIndexKey(5))
    assert dotted(path, sep="/") == "model/2/5"
    assert key_names(path) == ["model", "2", "5"]
    assert key_name("q_proj") == "q_proj" and key_name(7) == "7"  # already bare
    assert dotted(()) == ""
