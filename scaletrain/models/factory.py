"""Create a model whose parameters are born sharded on a mesh.

``nnx.eval_shape`` gives the abstract parameters with their ``logical_axes``; the
real initialiser then runs under ``jax.jit`` with ``out_shardings``, so no device
ever holds an unsharded copy of a large tensor. It runs as several small programs
(:class:`Initialiser`): the model without its layers, and one per distinct layer shape,
because one whole-model program takes XLA a time that grows faster than depth to
compile (74 s of a 1B model's first step on an H100; ``bench/init_compile.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from scaletrain.models.common import unrolled_layers
from scaletrain.models.common.config import DecoderConfig, to_dtype
from scaletrain.parallel.mesh import create_mesh
from scaletrain.parallel.partition import shardings_for_state


def mesh_for_config(config: DecoderConfig, devices: list[jax.Device] | None = None) -> Mesh:
    """The mesh described by ``config.sharding_axis_dims`` / ``sharding_axis_names``."""
    return create_mesh(config.sharding_axis_dims, config.sharding_axis_names, devices)


def abstract_model(
    module_class: type,
    config: DecoderConfig,
    *,
    dtype: Any = "float32",
    param_dtype: Any = "float32",
    precision: Any = None,
    seed: int = 0,
    mesh: Mesh | None = None,
) -> nnx.Module:
    """``module_class(config, ...)`` with a ``jax.ShapeDtypeStruct`` for every array (``nnx.eval_shape``).

    The one abstract build: the sharded factory below, the HF loader and the Ray
    trainer's ``lazy`` models all start from it. With ``mesh`` it is traced under
    ``jax.set_mesh(mesh)``, exactly as the real initialiser runs.
    """
    make = _maker(module_class, config, dtype, param_dtype, precision, seed)
    if mesh is None:
        return nnx.eval_shape(make)
    with jax.set_mesh(mesh):
        return nnx.eval_shape(make)


def abstract_sharded_model(
    module_class: type,
    config: DecoderConfig,
    *,
    dtype: Any = "float32",
    param_dtype: Any = "float32",
    precision: Any = None,
    mesh: Mesh,
) -> tuple[Any, Any]:
    """``(graphdef, params)``: the model's static graph and its parameters as
    ``jax.ShapeDtypeStruct`` leaves that carry their shardings on ``mesh``.

    Nothing is allocated or computed, so it serves any mesh, including one of devices
    this host does not have: a step compiled from it ahead of time reports the memory a
    real run needs (``bench/aot.py``); the HF loader reads each tensor into its leaf's sharding.
    """
    model = abstract_model(module_class, config, dtype=dtype, param_dtype=param_dtype, precision=precision, mesh=mesh)
    graphdef, abstract_state, shardings = _split_sharded(model, config, mesh)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          nnx.to_pure_dict(abstract_state), shardings)
    return graphdef, params


def _maker(module_class: type, config: DecoderConfig, dtype: Any, param_dtype: Any, precision: Any,
           seed: int) -> Callable[[], nnx.Module]:
    dtype, param_dtype = to_dtype(dtype), to_dtype(param_dtype)
    return lambda: module_class(config, dtype=dtype, param_dtype=param_dtype, precision=precision,
                                rngs=nnx.Rngs(seed))


def _split_sharded(abstract: nnx.Module, config: DecoderConfig, mesh: Mesh) -> tuple[Any, Any, Any]:
    """The graph, abstract state and parameter shardings of an abstract model on ``mesh``."""
    graphdef, abstract_state = nnx.split(abstract)
    with jax.set_mesh(mesh):
        return graphdef, abstract_state, shardings_for_state(abstract_state, config.partition_axis, mesh)


def create_sharded_model(
    module_class: type,
    config: DecoderConfig,
    *,
    dtype: Any = "float32",
    param_dtype: Any = "float32",
    precision: Any = None,
    seed: int = 0,
    mesh: Mesh | None = None,
) -> tuple[nnx.Module, Mesh]:
    """Build ``module_class(config, ...)`` with sharded parameters; returns (model, mesh)."""
    mesh = mesh if mesh is not None else mesh_for_config(config)
    abstract = abstract_model(module_class, config, dtype=dtype, param_dtype=param_dtype, precision=precision,
                              seed=seed, mesh=mesh)
    graphdef, abstract_state, shardings = _split_sharded(abstract, config, mesh)
    make = _maker(module_class, config, dtype, param_dtype, precision, seed)
    with jax.set_mesh(mesh):
        state = Initialiser(make, nnx.to_pure_dict(abstract_state), shardings, mesh)()
    return nnx.merge(graphdef, state), mesh


class Initialiser:
    """The programs that make a model's parameters, each array born with its sharding.

    The model is first made without its decoder layers (:func:`unrolled_layers.defer_layers`):
    ``rest``, one small program for the embeddings, norms and head, which also returns the
    key the layers draw from. Then each group of layers with the same parameter shapes and
    shardings is made by one jitted ``init(key, i)`` (``layers``): compiled once, run once
    per layer. A model that does not build its layers with :func:`unrolled_layers.build_layers`
    is made by ``rest`` alone, as a whole; so are stacked layers (``scan_layers``), whose one
    vmapped layer constructor compiles like one layer. Build it under ``jax.set_mesh(mesh)``.
    """

    def __init__(self, make: Callable[[], nnx.Module], abstract: dict, shardings: dict, mesh: Mesh):
        found: dict[str, Any] = {}

        def init_rest() -> tuple[dict, Any]:
            with unrolled_layers.defer_layers() as deferred:
                model = make()
            found.update(deferred=deferred, path=None)
            if deferred.build is not None:
                found["path"] = unrolled_layers.path_of(model, deferred.placeholder)
            return nnx.to_pure_dict(nnx.state(model)), deferred.key

        self.key_shape = jax.eval_shape(init_rest)[1]  # traces only: finds the layer stack and its path
        self.path: tuple[Any, ...] | None = found["path"]
        #: first layer index of a group -> (its jitted initialiser, the layer indices it makes)
        self.layers: dict[int, tuple[Any, list[int]]] = {}
        if self.path is None:
            self.rest = jax.jit(init_rest, out_shardings=(shardings, None))
            return
        replicated = NamedSharding(mesh, PartitionSpec())
        self.rest = jax.jit(init_rest, out_shardings=(_without(shardings, self.path), replicated))
        build, layer_shardings = found["deferred"].build, _get(shardings, self.path)
        for first, members in _groups(_get(abstract, self.path), layer_shardings).items():

            def init_layer(key: jax.Array, index: jax.Array, first: int = first) -> dict:
                # ``first`` fixes the layer's structure (all members share it); ``index`` only picks its key
                return nnx.to_pure_dict(nnx.state(build(first, unrolled_layers.layer_rngs(key, index))))

            self.layers[first] = (jax.jit(init_layer, out_shardings=layer_shardings[first]), members)

    def lower(self) -> dict[str, Any]:
        """Each program lowered against shapes only (``bench/init_compile.py`` compiles them for other devices)."""
        lowered = {"rest": self.rest.lower()}
        index = jax.ShapeDtypeStruct((), jnp.int32)
        for first, (fn, members) in self.layers.items():
            lowered[f"layers{members}"] = fn.lower(self.key_shape, index)
        return lowered

    def __call__(self) -> dict:
        """The parameters as a pure dict."""
        rest, key = self.rest()
        if self.path is None:
            return rest
        made = {i: fn(key, jnp.int32(i)) for fn, members in self.layers.values() for i in members}
        return _with(rest, self.path, dict(sorted(made.items())))


def _groups(abstract_layers: dict, shardings: dict) -> dict[int, list[int]]:
    """Layer indices grouped by parameter structure, shapes, dtypes and shardings, keyed by the first."""
    groups: dict[Any, list[int]] = {}
    for i in sorted(abstract_layers):
        leaves, treedef = jax.tree.flatten(abstract_layers[i])
        signature = (treedef, tuple((x.shape, x.dtype) for x in leaves), tuple(jax.tree.leaves(shardings[i])))
        groups.setdefault(signature, []).append(i)
    return {members[0]: members for members in groups.values()}


def _get(tree: dict, path: tuple[Any, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _without(tree: dict, path: tuple[Any, ...]) -> dict:
    """``tree`` with the subtree at ``path`` removed (copies only the dicts along the path)."""
    head, *rest = path
    out = dict(tree)
    if rest:
        out[head] = _without(tree[head], tuple(rest))
    else:
        out.pop(head)
    return out


def _with(tree: dict, path: tuple[Any, ...], value: Any) -> dict:
    """``tree`` with ``value`` placed at ``path`` (copies only the dicts along the path)."""
    head, *rest = path
    out = dict(tree)
    out[head] = _with(tree.get(head, {}), tuple(rest), value) if rest else value
    return out


def _mesh_of(model: nnx.Module) -> Mesh | None:
    """The mesh the model's parameters live on, if they carry NamedShardings."""
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def place_model(model: nnx.Module, mesh: Mesh | None = None) -> tuple[nnx.Module, Mesh]:
    """Make sure every parameter is sharded on a mesh by its partition rules.

    A model built by :func:`create_sharded_model` is returned as is; one built
    eagerly on a single device (a user's own module, say) is moved onto the mesh of
    its config.
    """
    current = _mesh_of(model)
    if current is not None and (mesh is None or mesh == current):
        return model, current
    mesh = mesh or mesh_for_config(model.config)
    graphdef, state = nnx.split(model)
    shardings = shardings_for_state(state, model.config.partition_axis, mesh)
    params = jax.device_put(nnx.to_pure_dict(state), shardings)
    return nnx.merge(graphdef, params), mesh
