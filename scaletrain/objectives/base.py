"""``Objective``: what a train step optimises, as the step and the evaluation loop see it.

Why a seam: the step's work (micro-batches, gradient accumulation, normalisation, the
non-finite guard, the optimizer) is the same whatever is optimised; what differs is
which batch keys and frozen models the loss reads, how it is computed, and how its
sums become metrics. An objective returns *sums* over a micro-batch, never means:
summed over micro-batches and divided once by the summed normaliser, they give
exactly the figures of one big batch.

The contract (:class:`Objective`):

- ``loss_and_sums(model, batch, frozen)`` -> ``(summed loss to differentiate,
  sums)``; ``sums`` is a flat ``{name: float32 array}`` holding at least ``"loss"``
  (the reported loss's sum; the non-finite guard reads it) and the normaliser.
  ``model`` is the merged module being trained; ``frozen`` maps each name of
  ``frozen_models`` to a merged module that is read, never differentiated.
- ``zero_sums(model)``: float32 zeros shaped like ``sums``, known without tracing
  the forward (the accumulation starts from them).
- ``step_metrics(sums, denom)``: the step's metrics (on device, inside jit) from
  the accumulated sums, ``denom`` being ``max(sums[normaliser], 1)``.
- ``eval_metrics(totals, bytes_per_token)``: the figures an evaluation reports
  (host floats, names starting ``eval_``, ``eval_loss`` among them) from sums added
  over every eval batch.

What the trainers read besides (declared here, so nothing is found by ``getattr``; inherit
:class:`ObjectiveBase` for the defaults, which a plain language-model-like loss keeps):

- ``batch_totals(batch) -> {name: scalar}``: counts over the *whole* batch (not the
  micro-batch) that the loss is scaled by; each micro-batch receives them as
  ``batch["total/<name>"]`` (:func:`with_batch_totals`). Why: a loss with two normalisers
  (ORPO's token-mean NLL beside its per-pair odds ratio) is exact under accumulation only if
  the micro-batch knows the batch's token count. Default: none.
- ``reference_source``: where it reads reference log-probabilities from (``"model"``,
  ``"adapters_off"``, ``"precomputed"``: ``objectives/reference.py``); None: it reads no
  reference, so the trainer sets none up (``training/frozen.py``). Default None.
- ``reference_inputs(batch) -> {batch key: rows}`` and ``precomputed_keys``: the rows whose
  reference log-probabilities ``precompute_ref_log_probs`` stores, and the keys it serves
  them under. Default: none.
- ``logged_metrics``: its figures named without a ``/`` that the train log keeps (TRL's
  ``nll_loss``, ``kl``, ...); callbacks read them through ``TrainerView``. Default none.
- ``sequences_per_row``: sequences one batch row forwards (a pair: 2), what tokens/s counts. Default 1.
- ``sampler_check``: whether its forward compares the sampler's log-probabilities with its own
  (GRPO with one iteration), so the rollout skips that scoring forward. Default False.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import jax

from scaletrain.errors import ConfigError, DataError

Array = jax.Array
Batch = Mapping[str, Array]
Sums = dict[str, Array]


@runtime_checkable
class Objective(Protocol):
    """What a step optimises (see the module's docstring for the contract)."""

    #: a short name, in error messages and logs
    name: str
    #: the batch keys ``loss_and_sums`` reads; a batch without one is refused, naming it
    batch_keys: tuple[str, ...]
    #: names in ``TrainState.frozen_models`` it reads (e.g. ``"reference"``)
    frozen_models: tuple[str, ...]
    #: the key of ``sums`` that gradients and metrics are divided by (target tokens, pairs, sequences)
    normaliser: str

    def loss_and_sums(self, model: Any, batch: Batch, frozen: Mapping[str, Any]) -> tuple[Array, Sums]: ...

    def zero_sums(self, model: Any) -> Sums: ...

    def step_metrics(self, sums: Sums, denom: Array) -> dict[str, Array]: ...

    def eval_metrics(self, totals: Mapping[str, Any], bytes_per_token: float | None = None) -> dict[str, float]: ...

    #: where reference log-probabilities come from (``objectives/reference.py``); None: no reference is read
    reference_source: str | None
    #: the batch keys ``precompute_ref_log_probs`` serves (with ``reference_inputs``)
    precomputed_keys: tuple[str, ...]
    #: its figures named without a ``/`` that the train log keeps
    logged_metrics: tuple[str, ...]
    #: sequences forwarded per batch row (chosen and rejected: 2), what tokens/s counts
    sequences_per_row: int
    #: its forward checks the sampler's log-probabilities (``rollout/logprob_diff_*``)
    sampler_check: bool

    def batch_totals(self, batch: Batch) -> Mapping[str, Array]: ...

    def reference_inputs(self, batch: Batch) -> dict[str, tuple[Array, Array, Array, Any]]: ...


class ObjectiveBase:
    """The defaults of :class:`Objective`'s members that only some objectives use (see the module docstring):
    no reference, no whole-batch totals, one sequence per row, no extra logged figures, no sampler check.

    An objective that inherits it writes only what it changes; a dataclass field of the same name overrides
    a default (``DPOObjective.reference_source``)."""

    reference_source: str | None = None
    precomputed_keys: tuple[str, ...] = ()
    logged_metrics: tuple[str, ...] = ()
    sequences_per_row: int = 1
    sampler_check: bool = False

    def batch_totals(self, batch: Batch) -> Mapping[str, Array]:
        return {}

    def reference_inputs(self, batch: Batch) -> dict[str, tuple[Array, Array, Array, Any]]:
        return {}


def check_batch(objective: Objective, batch: Batch) -> None:
    """DataError naming the first key ``objective`` needs that ``batch`` lacks.

    Called while the step is traced, so once per compiled shape, not once per step.
    """
    for key in objective.batch_keys:
        if key not in batch:
            raise DataError(f"objective {objective.name!r} needs the batch key {key!r}, but the batch has "
                            f"{sorted(batch)}; use a data kind that provides it")


def select_frozen(objective: Objective, available: Mapping[str, Any]) -> dict[str, Any]:
    """The frozen models ``objective`` reads, from ``available`` (``TrainState.frozen_models``).

    ConfigError naming the first one missing: a reference model is set up by the
    trainer, and a missing one is a configuration the step cannot run.
    """
    missing = [name for name in objective.frozen_models if name not in available]
    if missing:
        raise ConfigError(f"objective {objective.name!r} reads the frozen model {missing[0]!r}, but the train state "
                          f"holds {sorted(available) or 'none'}; give the state a frozen_models[{missing[0]!r}]")
    return {name: available[name] for name in objective.frozen_models}


TOTAL_PREFIX = "total/"


def with_batch_totals(objective: Objective, batch: Batch) -> dict[str, Array]:
    """``batch`` plus ``objective.batch_totals(batch)`` as ``total/<name>`` scalars (unchanged without any).

    Called on the whole batch before it is split into micro-batches; a scalar is handed to
    every micro-batch as it is (``steps.split_microbatches``)."""
    return {**batch, **{TOTAL_PREFIX + k: v for k, v in objective.batch_totals(batch).items()}}
