"""Decoder layers that draw their parameters from one key each, so identical layers can be
initialised by one compiled program.

Why: XLA compiles a model's initialiser as one program whose size grows with depth, and
its GPU compile time grows faster than that (Llama-3.2-1B on an H100: 1 layer 2.1 s,
4 layers 7.3 s, 16 layers 74 s; measured on 2026-11-22, docs/benchmarks.md). Layer ``i`` here is built from
``fold_in(key, i)``, a key drawn once from the model's ``rngs``, so its values do not
depend on how many random numbers the layers before it drew. That lets
:func:`scaletrain.models.factory.create_sharded_model` build the model without its layers
(:func:`defer_layers`), then make every layer with one jitted ``init(key, i)`` compiled
once per distinct layer shape, and get bit for bit the parameters that one jitted
``Model(config, rngs=nnx.Rngs(seed))`` makes (op-by-op eager construction may differ from
either in the last bit: XLA fuses the normal draws' arithmetic differently).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import jax
from flax import nnx

#: ``build(i, rngs)``: decoder layer ``i`` drawing its parameters from ``rngs``
LayerBuilder = Callable[[int, nnx.Rngs], nnx.Module]


@dataclass
class DeferredLayers:
    """What :func:`build_layers` would have built, recorded instead of building it (the factory
    reads the layer count and shapes from the abstract model)."""

    build: LayerBuilder | None = None
    key: jax.Array | None = None
    placeholder: nnx.List | None = None


_DEFERRED: ContextVar[DeferredLayers | None] = ContextVar("scaletrain_deferred_layers", default=None)


def layer_rngs(key: jax.Array, index: jax.Array | int) -> nnx.Rngs:
    """The random streams of layer ``index`` (every stream a layer draws from starts at ``fold_in(key, index)``)."""
    return nnx.Rngs(jax.random.fold_in(key, index))


def build_layers(build: LayerBuilder, count: int, rngs: nnx.Rngs) -> nnx.List:
    """``[build(i, layer_rngs(key, i)) for i < count]`` with ``key = rngs.params()`` drawn once.

    Inside :func:`defer_layers` nothing is built: the builder and key are recorded
    and an empty list holds the layers' place, to be filled by the factory.
    """
    key = rngs.params()
    deferred = _DEFERRED.get()
    if deferred is not None:
        if deferred.build is not None:
            raise RuntimeError("build_layers was called twice while deferring; a model may defer one stack only")
        deferred.build, deferred.key = build, key
        deferred.placeholder = nnx.List([])
        return deferred.placeholder
    return nnx.List([build(i, layer_rngs(key, i)) for i in range(count)])


@contextlib.contextmanager
def defer_layers() -> Iterator[DeferredLayers]:
    """Record the layer stack of a model built inside this block instead of building it."""
    deferred = DeferredLayers()
    token = _DEFERRED.set(deferred)
    try:
        yield deferred
    finally:
        _DEFERRED.reset(token)


def path_of(model: nnx.Module, node: Any) -> tuple[Any, ...] | None:
    """The graph path of ``node`` inside ``model`` (by identity), or None."""
    for path, value in nnx.iter_graph(model):
        if value is node:
            return tuple(path)
    return None
