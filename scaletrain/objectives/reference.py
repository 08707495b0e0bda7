"""Where a preference objective reads its reference log-probabilities from.

Three sources, one per memory cost (the trainer picks and sets them up, see
``training/frozen.py``):

- ``"model"``: a frozen model in ``TrainState.frozen_models["reference"]`` (a copy of the
  starting policy, or another model folder), run on the same concatenated rows;
- ``"adapters_off"``: a LoRA/QLoRA policy with its adapters zeroed: the frozen base itself,
  so no second copy of the weights exists;
- ``"precomputed"``: log-probabilities computed once before training and served in the batch
  (``ref_chosen_logps`` / ``ref_rejected_logps``, or KTO's ``ref_logps`` / ``ref_kl_logps``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from scaletrain.errors import ConfigError
from scaletrain.objectives.logps import row_logps
from scaletrain.peft.lora import LoRAParam

Array = jax.Array
REFERENCE_SOURCES = ("model", "adapters_off", "precomputed")
REFERENCE = "reference"


def check_source(source: str) -> str:
    if source not in REFERENCE_SOURCES:
        raise ConfigError(f"reference_source={source!r} is not one of {list(REFERENCE_SOURCES)}")
    return source


def adapters_off(model: Any) -> Any:
    """``model`` with every LoRA adapter zeroed: its frozen base's function, sharing the base's arrays.

    Zeroing ``A`` and ``B`` makes each adapted layer add exactly ``0`` to the base's output, so the
    result equals the base model bit for bit; only the (small) adapters are materialised as zeros.
    """
    graphdef, lora, rest = nnx.split(model, LoRAParam, ...)
    return nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, lora), rest)


def reference_frozen_models(source: str) -> tuple[str, ...]:
    """The frozen models a ``source`` reads: the reference model for ``"model"``, none otherwise."""
    return (REFERENCE,) if source == "model" else ()


def reference_logps(source: str, model: Any, frozen: Mapping[str, Any], rows: tuple[Array, Array, Array, Any],
                    precomputed: tuple[Array, ...]) -> Array:
    """Reference completion log-probabilities [N] of ``rows`` (``(input_ids, segment_ids, loss_mask, positions)``).

    ``precomputed``: the batch's stored values, concatenated like ``rows`` (read for ``"precomputed"``).
    Never differentiated.
    """
    if source == "precomputed":
        return jax.lax.stop_gradient(jnp.concatenate([p.astype(jnp.float32) for p in precomputed], axis=0))
    reference = frozen[REFERENCE] if source == "model" else adapters_off(model)
    return row_logps(reference, *rows)
