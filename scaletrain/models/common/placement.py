"""Placement: how a model runs and where its arrays sit, as one frozen value read in one place.

Why apart from the architecture: the same weights run under another mesh, remat policy,
attention kernel or FP8 setting, and a recipe may change these on a loaded model
(``models.config.RUNTIME_KEYS``). The config keeps the fields (their names are the recipe's,
EasyDeL's and a saved config's keys) and :attr:`LlamaConfig.placement` gathers them into a
:class:`Placement`. The layers hold none of it: :meth:`CausalLM.forward` makes its config's
placement the active one for the call (:func:`use_placement`) and a layer reads
:func:`active_placement` when it runs, so a key set on the config after the model was built
takes effect at the next trace, and no layer keeps a copy that could go stale.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import Any

from scaletrain.parallel.partition import PartitionAxis


@dataclass(frozen=True)
class Placement:
    """The placement fields of a model config (same names and meanings as there)."""

    gradient_checkpointing: str = "none"
    attn_mechanism: str = "auto"
    attn_dtype: str | None = None
    attn_softmax_dtype: str | None = "float32"
    fp8: bool = False
    scan_layers: bool = False
    sharding_axis_names: tuple[str, ...] = ("dp", "fsdp", "ep", "tp", "sp")
    sharding_axis_dims: tuple[int, ...] = (1, -1, 1, 1, 1)
    sharding_dcn_axis_dims: tuple[int, ...] | None = None
    partition_axis: PartitionAxis = PartitionAxis()

    @classmethod
    def of(cls, config: Any) -> Placement:
        """The placement of ``config`` (any object with these fields as attributes)."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})


#: the names of :class:`Placement`'s fields: the config fields that are placement
PLACEMENT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Placement))

_ACTIVE: ContextVar[Placement | None] = ContextVar("scaletrain_placement", default=None)


def active_placement() -> Placement:
    """The placement of the forward being traced (the defaults outside one: a layer called on its own)."""
    placement = _ACTIVE.get()
    return Placement() if placement is None else placement


@contextlib.contextmanager
def use_placement(placement: Placement) -> Iterator[Placement]:
    """Make ``placement`` the active one inside the block (nested blocks restore the outer one)."""
    token = _ACTIVE.set(placement)
    try:
        yield placement
    finally:
        _ACTIVE.reset(token)
