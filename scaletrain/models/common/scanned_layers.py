"""Identical decoder layers stored as one stack (``model.scan_layers``) and run by ``lax.scan``.

Why: XLA compiles every layer of an unrolled model again, and the train step's cold
compile grows with depth (0.64 s per layer for Llama-3.2-1B compiled for an H100; the
optimizer update alone is 148 arrays of its own, ~0.3 s per layer). Stored stacked, each
parameter of the layers is one array with a leading layer axis: the forward and
backward compile one layer body inside a loop, and the optimizer updates 9 arrays for the
layers instead of 9 per layer. The maths is the unrolled model's: the same layer, the same
values (layer ``i`` draws from ``fold_in(key, i)`` as :func:`unrolled_layers.build_layers`
does, so both layouts start from identical parameters).

The stack lives at ``model.layers.stack.<name>`` (leading axis: the layer). The Hugging
Face checkpoint code reads and writes it as the per-layer tensors
``model.layers.<i>.<name>`` (:func:`per_layer_names`), and optimizer rules that look at a
parameter's rank (weight decay on matrices) discount the layer axis (:func:`stacked_axes`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from scaletrain.key_paths import key_names
from scaletrain.models.common.unrolled_layers import LayerBuilder, layer_rngs

#: the logical name of the layer axis (replicated: every device holds its shard of every layer)
LAYER_AXIS = "layers"
#: the attribute of :class:`StackedLayers` that holds the stack, as it appears in parameter paths
STACK = "stack"

Carry = TypeVar("Carry")
_STACKED_NAME = re.compile(rf"^(?P<prefix>(?:.*\.)?layers)\.{STACK}\.(?P<rest>.+)$")


class StackedLayers(nnx.Module):
    """``count`` layers made by ``build`` kept as one module whose arrays are ``[count, ...]``."""

    def __init__(self, build: LayerBuilder, count: int, key: jax.Array):
        self.count = count
        # layer i from fold_in(key, i): the values build_layers gives layer i, made by one vmapped program
        self.stack = nnx.vmap(lambda i: build(0, layer_rngs(key, i)), in_axes=0, out_axes=0)(
            jnp.arange(count, dtype=jnp.int32))
        for _, node in nnx.iter_graph(self.stack):
            if isinstance(node, nnx.Variable):
                axes = node.get_metadata().get("logical_axes")
                if axes is not None:
                    node.set_metadata(logical_axes=(LAYER_AXIS, *axes))

    def scan(self, step: Callable[..., tuple[Carry, Any]], carry: Carry, xs: Any = None) -> tuple[Carry, Any]:
        """``lax.scan`` of ``step(layer, carry) -> (carry, y)`` over the layers in order, ``y`` stacked;
        with ``xs`` (stacked over the layers, a key/value cache say) ``step(layer, carry, x)``."""
        graphdef, state = nnx.split(self.stack)

        def body(c: Carry, layer_and_x: tuple[Any, Any]) -> tuple[Carry, Any]:
            layer = nnx.merge(graphdef, layer_and_x[0])
            return step(layer, c) if xs is None else step(layer, c, layer_and_x[1])

        return lax.scan(body, carry, (state, xs))


def per_layer_names(name: str, count: int) -> tuple[str, ...] | None:
    """``model.layers.<i>.<rest>`` for i < ``count``, for a stacked parameter's dotted ``name``; else None."""
    m = _STACKED_NAME.match(name)
    if m is None:
        return None
    return tuple(f"{m['prefix']}.{i}.{m['rest']}" for i in range(count))


def stacked_axes(path: tuple[Any, ...]) -> int:
    """Leading layer axes of the parameter at ``path`` (a pytree key path): 1 inside a stack, else 0."""
    keys = key_names(path)
    return int(any(a == "layers" and b == STACK for a, b in zip(keys, keys[1:])))
