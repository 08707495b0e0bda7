"""Loss aggregations: how per-token losses become the batch's loss, a registry under TRL 1.16's ``loss_type`` names.

Why a registry: ``grpo``, ``bnpo``, ``dr_grpo`` and ``dapo`` differ only in what they sum and what the
step divides by, so each is one decorated function (:func:`loss_aggregation`) that returns a sum over the
micro-batch, with the normaliser the step divides the whole batch's sum by (``"sequences"``: completions,
``"tokens"``: completion tokens, TRL's ``num_items_in_batch``). Summing micro-batches and dividing once
gives the loss of the whole batch under gradient accumulation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from scaletrain.errors import ConfigError

Array = jax.Array
#: ``aggregate(masked_loss [N, C], mask [N, C], max_completion_length) -> scalar sum``
Aggregate = Callable[[Array, Array, int], Array]


@dataclasses.dataclass(frozen=True)
class Aggregation:
    """A registered loss aggregation: its sum and the normaliser (``"sequences"`` or ``"tokens"``)."""

    name: str
    fn: Aggregate
    normaliser: str


_AGGREGATIONS: dict[str, Aggregation] = {}


def loss_aggregation(name: str, normaliser: str) -> Callable[[Aggregate], Aggregate]:
    """Register ``fn`` as the ``loss_type`` ``name`` divided by ``normaliser``; a name twice is a programming error."""
    if normaliser not in ("sequences", "tokens"):
        raise ValueError(f"normaliser={normaliser!r} is not 'sequences' or 'tokens'")

    def register(fn: Aggregate) -> Aggregate:
        if name in _AGGREGATIONS:
            raise ValueError(f"loss aggregation {name!r} is already registered")
        _AGGREGATIONS[name] = Aggregation(name, fn, normaliser)
        return fn
    return register


def aggregation_names() -> tuple[str, ...]:
    return tuple(_AGGREGATIONS)


def get_aggregation(name: str) -> Aggregation:
    if name not in _AGGREGATIONS:
        raise ConfigError(f"loss_type {name!r} is not one of {list(aggregation_names())}")
    return _AGGREGATIONS[name]


@loss_aggregation("grpo", normaliser="sequences")
def per_sequence_mean(masked: Array, mask: Array, max_completion_length: int) -> Array:
    """Each completion's token mean, summed (GRPO's original loss: long completions weigh less per token)."""
    return jnp.sum(jnp.sum(masked, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0))


@loss_aggregation("bnpo", normaliser="tokens")
def bnpo_token_sum(masked: Array, mask: Array, max_completion_length: int) -> Array:
    """Token sums, over the batch's completion tokens (BNPO)."""
    return jnp.sum(masked)


@loss_aggregation("dr_grpo", normaliser="sequences")
def constant_length_sum(masked: Array, mask: Array, max_completion_length: int) -> Array:
    """Token sums over the constant ``max_completion_length`` (Dr. GRPO: no length bias)."""
    return jnp.sum(masked) / max_completion_length


@loss_aggregation("dapo", normaliser="tokens")
def dapo_token_sum(masked: Array, mask: Array, max_completion_length: int) -> Array:
    """Token sums, over the batch's completion tokens (DAPO, TRL's default)."""
    return jnp.sum(masked)
