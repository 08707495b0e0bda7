"""The device half of a GRPO step: a rollout scored into the objective's batch, then the update that forms its
advantages from the rewards. Both are jitted; nothing per token crosses to the host.

Why two programs and where the host sits between them: the rewards are Python callables over text,
so the completion ids must be read and decoded on the host, and only the ``[N]`` rewards come back.
Everything else stays where the rollout left it:

1. :func:`make_score_program` (one program per prompt width): the rows the update reads
   (prompt cut to the columns it needs, then the completion: ``input_ids`` / ``segment_ids`` /
   ``positions``), the loss mask (``mask_truncated_completions``), and what the objective declares
   beside them: the old log-probabilities (``num_iterations`` > 1), the reference's
   (``beta`` != 0), TRL's importance-sampling ratio, the sampler's log-probabilities when the
   update's forward checks them; else the sampler-vs-trainer gap ``rollout/logprob_diff_*`` as
   two device scalars. It runs before the rewards (its time is ``time/reference``).
2. :func:`learn_step` (the trainer's ``sharded_training_step_function``, jitted per batch layout with
   the base trainer's per-key in-shardings, ``training.steps.LayoutJit``): the ``[N]`` rewards become
   advantages (the objective's estimator, ``objectives/advantage_estimators.py``), join the batch, and one
   optimizer step of the objective runs; a reused rollout (``num_iterations``) comes back with its advantages
   and runs the update alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from scaletrain.generation import rollout_rows
from scaletrain.objectives.advantage_estimators import AdvantageSpec
from scaletrain.objectives.grpo_loss import importance_sampling_ratio
from scaletrain.objectives.reference import adapters_off
from scaletrain.objectives.token_logps import completion_token_stats, completion_token_stats_and_values
from scaletrain.peft.lora import join_trainable
from scaletrain.rl.batch import truncated_mask

Array = jax.Array
FOR_HOST = ("completion_ids", "lengths", "truncated")  # what the host reads of a rollout: decoded for the rewards
REWARDS = "rewards"
KL_ROWS = "kl_rows"  # [N] each completion's summed policy-vs-reference log-ratio, for an estimator with kl_coef
FORMED = ("advantages", "returns")  # what a rollout's first update forms from its rewards (returns: PPO's)
FRESH_ONLY = (REWARDS, KL_ROWS)  # what only a fresh rollout's first update reads


@dataclasses.dataclass(frozen=True)
class ScoreSpec:
    """What the score program adds to a rollout's rows (static: one trainer's options)."""

    temperature: float
    check_in_update: bool  # the update's forward checks the sampler: keep its log-probs, run no forward here
    num_iterations: int
    beta: float
    mask_truncated_completions: bool
    importance_sampling: tuple[str, float | None, float | None] | None = None  # (mode, clip_min, clip_max)
    kl_rows: bool = False  # the estimator takes a KL off the reward (RLOO's beta): each row's summed log-ratio
    values: bool = False  # PPO: the old log-probs and the value head's values of every rollout (GAE reads both)


def gap_figures(trainer_logps: Array, sampler_logps: Array, mask: Array) -> dict[str, Array]:
    """``rollout/logprob_diff_max`` / ``_mean`` over the completion tokens, as device scalars."""
    keep = mask != 0
    diff = jnp.where(keep, jnp.abs(trainer_logps - sampler_logps), 0.0)
    count = jnp.sum(keep)
    return {"rollout/logprob_diff_max": jnp.max(diff, initial=0.0),
            "rollout/logprob_diff_mean": jnp.where(count > 0, jnp.sum(diff) / jnp.maximum(count, 1), 0.0)}


def make_score_program(graphdef: Any, spec: ScoreSpec, batch_sharding_of: Callable[[int], Any],
                       replicated: Any) -> Callable[..., tuple[dict[str, Array], dict[str, Array], dict[str, Array]]]:
    """``score(params, frozen, reference, rollout, drop=) -> (batch, figures, for_host)``, jitted (one program per
    prompt width): see the module docstring. ``rollout``: the engine's arrays (``prompt_ids``, ``prompt_mask``,
    ``completion_ids``, ``completion_mask``, ``log_probs``, ``lengths``, ``truncated``); ``drop``: the prompt's
    left padding columns the update does not read (``rl.batch.kept_prompt_columns``). The batch comes out laid
    out as the update reads it (``batch_sharding_of(rank)``), and so do ``for_host``'s ``completion_ids``,
    ``lengths`` and ``truncated``, the arrays the host reads (each process its own rows, ``rl.process_rows``):
    laid out here, on the devices, they need no other move (a ``jax.device_put`` to another layout goes
    through the host)."""
    keys = ["input_ids", "segment_ids", "positions", "completion_mask"]
    if spec.check_in_update:
        keys.append("sampler_logps")
    if spec.num_iterations > 1 or spec.values:
        keys.append("old_logps")
    if spec.values:
        keys.append("values")
    if spec.beta != 0.0:
        keys.append("ref_logps")
    if spec.importance_sampling is not None:
        keys.append("importance_sampling_ratio")
    figures = () if spec.check_in_update else ("rollout/logprob_diff_max", "rollout/logprob_diff_mean")

    def score(params: Any, frozen: Any, reference: Any, rollout: dict[str, Array], drop: int) -> tuple[Any, ...]:
        completion_ids, sampler = rollout["completion_ids"], rollout["log_probs"]
        ids, seg, pos = rollout_rows(rollout["prompt_ids"][:, drop:], rollout["prompt_mask"][:, drop:],
                                     completion_ids, rollout["completion_mask"])
        # a multi-turn rollout's tool tokens (tool_mask 0) are read but neither trained nor checked
        raw_mask = rollout["completion_mask"] * rollout.get("tool_mask", 1)
        width, mask = completion_ids.shape[1], raw_mask.astype(jnp.float32)
        loss_mask = truncated_mask(mask, rollout["truncated"]) if spec.mask_truncated_completions else mask
        batch = {"input_ids": ids, "segment_ids": seg, "positions": pos, "completion_mask": loss_mask}
        out: dict[str, Array] = {}
        if spec.check_in_update:
            batch["sampler_logps"] = sampler
        else:  # the trainer's forward at the sampling parameters: the old log-probs and the sampler check
            model = join_trainable(graphdef, params, frozen)
            if spec.values:  # one forward: the log-probs and the value head's values (PPO's GAE reads both)
                policy, _, batch["values"] = completion_token_stats_and_values(model, ids, seg, pos, width,
                                                                               spec.temperature)
            else:
                policy = completion_token_stats(model, ids, seg, pos, width, spec.temperature)[0]
            out = gap_figures(policy, sampler, raw_mask)
            if spec.num_iterations > 1 or spec.values:
                batch["old_logps"] = policy
            if spec.importance_sampling is not None:
                batch["importance_sampling_ratio"] = importance_sampling_ratio(policy, sampler, mask,
                                                                               *spec.importance_sampling)
        if spec.beta != 0.0:
            model = reference.model if reference is not None else adapters_off(join_trainable(graphdef, params, frozen))
            batch["ref_logps"] = completion_token_stats(model, ids, seg, pos, width, spec.temperature)[0]
        for_host = {k: rollout[k] for k in FOR_HOST}
        if spec.kl_rows:  # TRL's RLOOTrainer: sum_t (policy_t - reference_t) over the tokens the loss counts
            batch[KL_ROWS] = for_host[KL_ROWS] = jnp.sum((policy - batch["ref_logps"]) * loss_mask, axis=1)
        return batch, out, for_host

    host_keys = FOR_HOST + ((KL_ROWS,) if spec.kl_rows else ())
    if spec.kl_rows:
        keys.append(KL_ROWS)
    shardings = ({k: batch_sharding_of(1 if k == KL_ROWS else 2) for k in keys}, {k: replicated for k in figures},
                 {k: batch_sharding_of(2 if k == "completion_ids" else 1) for k in host_keys})
    return jax.jit(score, static_argnames="drop", out_shardings=shardings)


def learn_step(state: Any, batch: dict[str, Array], *, update: Callable[..., tuple[Any, dict[str, Array]]],
               num_generations: int, estimator: AdvantageSpec, replicated: Any
               ) -> tuple[Any, dict[str, Array], dict[str, Array]]:
    """``(state, metrics, formed)``: a fresh rollout's ``rewards`` [N] made into ``advantages`` by the
    objective's ``estimator`` (``objectives/advantage_estimators.py``; PPO's GAE adds per-token ``returns``
    and its figures), then ``update(state, batch)`` (``training.steps.train_step``); ``formed``: the keys
    the estimator added, which join the batch a reuse reads (a reused rollout's batch carries them already,
    and they come back as they are).

    The rewards are gathered whole onto every device (``replicated``) before the group and batch statistics:
    each device then computes every advantage alike, with no sum across devices or processes, so any mesh
    and any process count give the same bits."""
    batch, figures = dict(batch), {}
    formed = {k: batch[k] for k in FORMED if k in batch}
    if REWARDS in batch:
        rewards = jax.lax.with_sharding_constraint(batch.pop(REWARDS), replicated)
        kl_rows = batch.pop(KL_ROWS, None)
        kl_rows = None if kl_rows is None else jax.lax.with_sharding_constraint(kl_rows, replicated)
        formed, figures = estimator.form(rewards, batch, num_generations, kl_rows)
        batch.update(formed)
    state, metrics = update(state, batch)
    return state, {**metrics, **figures}, formed


def row_advantages(formed: dict[str, Array], mask: Array | None = None) -> Array:
    """[N]: a completion's advantage as ``completions.jsonl`` shows it; per-token advantages (PPO's) at the
    completion's first token."""
    advantages = formed["advantages"]
    return advantages if advantages.ndim == 1 else advantages[:, 0]
