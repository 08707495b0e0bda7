"""What an objective reads from a causal LM's forward: final hidden states and auxiliary outputs.

Why one function: every objective needs the same forward with the batch's keys mapped onto
its arguments. Every causal LM (``models/common/decoder.py``'s ``CausalLM``) has
``hidden_states_and_aux(input_ids, positions=None, segment_ids=None, attention_mask=None) ->
(hidden, aux)``, ``aux`` being ``{}`` for a dense model and ``{"router": RouterStats}`` for a
mixture of experts, and ``aux_shapes()``, ``aux``'s shapes known without tracing.
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
    return model.hidden_states_and_aux(batch["input_ids"], positions=batch.get("positions"),
                                       segment_ids=batch.get("segment_ids"))


def aux_shapes(model: Any) -> dict[str, Any]:
    """The shapes (``jax.ShapeDtypeStruct`` leaves) of :func:`hidden_and_aux`'s ``aux``, without tracing."""
    return model.aux_shapes()
