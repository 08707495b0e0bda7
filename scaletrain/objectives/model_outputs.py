"""What an objective reads from a causal LM's forward: final hidden states and auxiliary outputs.

Why one function: every objective needs the same forward, and the model contract is
changing under it. The contract is ``model.hidden_states_and_aux(input_ids,
positions=None, segment_ids=None, attention_mask=None) -> (hidden, aux)`` with
``aux`` ``{}`` for a dense model and ``{"router": RouterStats}`` for a mixture of
experts, and ``model.aux_shapes()`` giving ``aux``'s shapes without tracing. Models
that predate it have ``hidden_states`` / ``hidden_states_and_router_stats`` /
``router_stats_shape``; the fallbacks below read those, and go once every model has
the two methods.
"""

from __future__ import annotations

from typing import Any

import jax

Array = jax.Array
Batch = dict[str, Array]


def hidden_and_aux(model: Any, batch: Batch) -> tuple[Array, dict[str, Any]]:
    """``(hidden [B, T, H], aux)`` of ``model`` on ``batch``'s ``input_ids``, ``positions`` and ``segment_ids``.

    ``attention_mask`` is not passed: packed rows carry their padding as segment id 0,
    which is what the training forward has always read.
    """
    ids, positions, segments = batch["input_ids"], batch.get("positions"), batch.get("segment_ids")
    forward = getattr(model, "hidden_states_and_aux", None)
    if forward is not None:
        return forward(ids, positions=positions, segment_ids=segments)
    with_stats = getattr(model, "hidden_states_and_router_stats", None)
    if with_stats is None:
        return model.hidden_states(ids, positions, segments), {}
    hidden, stats = with_stats(ids, positions, segments)
    return hidden, {"router": stats}


def aux_shapes(model: Any) -> dict[str, Any]:
    """The shapes (``jax.ShapeDtypeStruct`` leaves) of :func:`hidden_and_aux`'s ``aux``, without tracing."""
    shapes = getattr(model, "aux_shapes", None)
    if shapes is not None:
        return shapes()
    router = getattr(model, "router_stats_shape", None)
    return {} if router is None else {"router": router()}
