"""``GRPOTrainer``: the Trainer's loop, checkpoints and callbacks, with a step that samples before it learns.

One step: sample ``num_generations`` completions of each of the step's prompts from the live
training state (``scaletrain.generation``: no copy, no weight sync), score the sampled tokens
with the trainer's own forward (the old log-probabilities, and the sampler-vs-trainer check
``rollout/logprob_diff_*``; with one iteration the update's own forward does this check instead,
so the step runs no extra forward, as TRL's) and, with ``beta > 0``, with the reference; run the reward
functions, form group advantages, and take one optimizer step of the GRPO objective
(``scaletrain.objectives.grpo``). With ``num_iterations`` = μ the rollout batch is reused for μ
steps, its old log-probabilities stored. Figures under TRL's names, the time split
(``time/rollout``, ``time/reference``, ``time/rewards``, ``time/update``), rollout tokens/s, and
``completions.jsonl`` on every ``log_completions_steps``-th step (the rollout it trains on, as TRL's logging steps).

``training.total_batch_size`` counts completions, as TRL's batch does: a step samples
``total_batch_size / num_generations`` prompts.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from typing import Any, ClassVar

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from scaletrain.data.prompts import PromptRow, is_messages, load_prompts
from scaletrain.errors import ConfigError, DataError
from scaletrain.generation import SamplingParams, rollout, rollout_rows, stop_token_ids
from scaletrain.log_files import append_lines, drop_records_after
from scaletrain.objectives.grpo import GRPOObjective
from scaletrain.objectives.grpo_loss import importance_sampling_ratio
from scaletrain.objectives.grpo_options import TRL_VLLM_OPTIONS, GRPOOptions
from scaletrain.objectives.reference import adapters_off
from scaletrain.objectives.registry import get_objective_type, register_trainer, validate_options
from scaletrain.objectives.token_logps import completion_token_stats
from scaletrain.rl.config import GRPOConfig, RLConfig
from scaletrain.rl.batch import trim_prompt_padding
from scaletrain.rl.prompt_batches import PromptBatch, PromptBatches
from scaletrain.rl import rollout_store
from scaletrain.rl.advantages import advantages_of, reward_kl_rows
from scaletrain.rl.flops import StepFlops, TokenCost, adapter_parameters
from scaletrain.rl.plan import grpo_plan_lines
from scaletrain.rl.process_rows import RowLayout
from scaletrain.rl.rewards import load_rewards, recorded_spec
from scaletrain.rl.row_scores import score_rows
from scaletrain.rl.scoring import (
    completion_metrics,
    completion_records,
    decode,
    logprob_diff_figures,
    logs_completions,
    objective_batch,
)
from scaletrain.parallel.partition import axis_names
from scaletrain.peft.lora import join_trainable
from scaletrain.training.base import batch_sharding
from scaletrain.training.checkpoint import Checkpointer
from scaletrain.training.metrics import peak_flops_per_device
from scaletrain.training.protocol import TrainerConfigureDataloaderOutput, TrainerConfigureFunctionOutput
from scaletrain.training.frozen import set_up
from scaletrain.training.state import FrozenModel, TrainState, state_shardings
from scaletrain.training.steps import train_step
from scaletrain.training.trainer import Trainer
from scaletrain.training.trl_inputs import default_arguments, model_from, one_of, tokenizer_from, with_peft_config

logger = logging.getLogger("scaletrain")

COMPLETIONS_FILE = "completions.jsonl"


@dataclasses.dataclass
class _Scored:
    """A rollout made into the objective's batch (placed on the devices), with its figures; ``host``: this
    process's rows of the same batch on the host, and the prompt batch ``(epoch, index)`` it came from."""

    batch: dict[str, jax.Array]
    metrics: dict[str, float]
    host: dict[str, np.ndarray]
    epoch: int
    index: int
    update_flops: float | None = None  # model FLOPs of one update on this batch (rl/flops.py); None: not known
    update_tokens: float = 0.0  # the real tokens (prompt + completion) the update reads


def check_batch_size(total_batch_size: int, num_generations: int) -> int:
    """Prompts per step; ConfigError unless ``num_generations`` divides ``training.total_batch_size``."""
    if total_batch_size % num_generations:
        raise ConfigError(f"training.total_batch_size={total_batch_size} counts completions and must be a multiple "
                          f"of objective.num_generations={num_generations} (each prompt's completions form a group)")
    return total_batch_size // num_generations


class GRPOTrainer(Trainer):
    """GRPO and its variants over prompts (see the module docstring).

    TRL's argument names (``model``, ``reward_funcs``, ``args``, ``train_dataset``, ``processing_class``,
    ``peft_config``) or ours (``arguments``, ``dataset_train``, ``tokenizer``). ``model``: a module, or a
    model folder as TRL takes it (its tokenizer read too; ``args`` then defaults to ``<model name>-GRPO``);
    ``peft_config``: a ``peft.LoraConfig``, mapped onto ``lora`` (``scaletrain.training.trl_inputs``).
    ``args``: a :class:`GRPOConfig` (its ``grpo`` options), or ``TrainingArguments`` with the GRPO options
    in ``options`` or as keywords.
    ``train_dataset``: :class:`~scaletrain.data.prompts.PromptRow` s, or prompt rows (a JSONL / Parquet /
    CSV path, dicts, a ``datasets.Dataset``) that the tokenizer turns into them. ``reward_funcs``:
    callables or recipe entries (``scaletrain.rl.rewards``); default ``options.reward_funcs``.
    A variant (``rl/variants.py``) names another ``objective_type`` (its options and objective) and config class.
    """

    objective_type: ClassVar[str] = "grpo"
    config_class: ClassVar[type[RLConfig]] = GRPOConfig

    def __init__(self, model: Any = None, reward_funcs: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, *, arguments: Any = None,
                 dataset_train: Any = None, dataset_eval: Any = None, tokenizer: Any = None,
                 options: GRPOOptions | dict[str, Any] | None = None, objective: Any = None,
                 eval_bytes_per_token: float | None = None, peft_config: Any = None, **kwargs: Any):
        arguments = one_of(args=args, arguments=arguments)
        if arguments is None and isinstance(model, (str, os.PathLike)):  # TRL's default: "<model name>-GRPO"
            arguments = default_arguments(self.config_class, model, self.objective_type.upper())
        dataset_train = one_of(train_dataset=train_dataset, dataset_train=dataset_train)
        model, folder = model_from(model, arguments, "GRPOTrainer")
        tokenizer = tokenizer_from(one_of(processing_class=processing_class, tokenizer=tokenizer), folder)
        if arguments is not None:
            arguments = with_peft_config(arguments, peft_config, model, folder, "GRPOTrainer")
        if arguments is None or dataset_train is None:
            raise ConfigError("GRPOTrainer needs args= (a GRPOConfig or TrainingArguments) and train_dataset= "
                              "(prompt rows)")
        kind = get_objective_type(self.objective_type)
        fields = {k: kwargs.pop(k) for k in list(kwargs) if k in kind.options.model_fields or k in TRL_VLLM_OPTIONS}
        base = arguments.rl_options().model_dump() if isinstance(arguments, RLConfig) else {}
        if isinstance(options, GRPOOptions):
            options = options.model_dump()
        self.options = validate_options(self.objective_type, {**base, **dict(options or {}), **fields})
        if one_of(eval_dataset=eval_dataset, dataset_eval=dataset_eval) is not None:
            raise ConfigError("GRPO has no evaluation split (its figures are logged every step): drop eval_dataset "
                              "(data.eval_source / eval_fraction)")
        o = self.options
        if tokenizer is None:
            raise ConfigError("GRPOTrainer needs a tokenizer: completions are decoded for the reward functions")
        self.prompts_per_step = check_batch_size(arguments.total_batch_size, o.num_generations)
        specs = reward_funcs if reward_funcs is not None else o.reward_funcs
        self.reward_functions, self.reward_weights = load_rewards(specs, o.reward_weights)
        self.reward_specs = [recorded_spec(s) for s in (specs if isinstance(specs, (list, tuple)) else [specs])]
        if isinstance(dataset_train, list) and dataset_train and isinstance(dataset_train[0], PromptRow):
            rows = [r if o.max_prompt_length is None else dataclasses.replace(
                r, prompt_ids=r.prompt_ids[-o.max_prompt_length:]) for r in dataset_train]
        else:
            rows = load_prompts(dataset_train, tokenizer, max_prompt_length=o.max_prompt_length, column_option=None)
        self.prompt_rows: list[PromptRow] = rows
        self.conversational = is_messages(rows[0].prompt)
        self._scored: _Scored | None = None
        self._reference: FrozenModel | None = None
        self._rows: RowLayout | None = None
        objective = objective if objective is not None else kind.build(o)
        if isinstance(objective, GRPOObjective):
            # one iteration, one micro-batch, no correction, no KL in the reward: the update's forward is the
            # trainer's forward at the sampling parameters, so it checks the sampler and the rollout skips a scoring
            # forward of its own
            objective = dataclasses.replace(objective, sampler_check=(
                o.num_iterations == 1 and not o.vllm_importance_sampling_correction
                and arguments.gradient_accumulation_steps == 1 and objective.advantages.kl_coef == 0.0))
        self._check_in_update = objective.sampler_check
        super().__init__(arguments, model=model, dataset_train=rows, tokenizer=tokenizer,
                         objective=objective, **kwargs)

    # ---- configuration ----------------------------------------------------------------
    def configure_dataloaders(self) -> TrainerConfigureDataloaderOutput:
        args, o = self.arguments, self.options
        n = len(self.prompt_rows)
        if n < self.prompts_per_step:
            raise DataError(f"dataset_train has {n} prompts, fewer than the {self.prompts_per_step} a step samples "
                            f"(training.total_batch_size={args.total_batch_size} / "
                            f"num_generations={o.num_generations})")
        batches = PromptBatches(n, self.prompts_per_step, seed=args.seed, shuffle=args.shuffle_train_dataset,
                                num_epochs=args.num_train_epochs, repeats=o.num_iterations)
        self._train_source, self._eval_source = self.prompt_rows, None
        self.num_epochs = args.num_train_epochs
        self.steps_per_epoch = batches.batches_per_epoch * o.num_iterations
        horizons = [args.max_training_steps] if args.max_training_steps is not None else []
        if args.num_train_epochs is not None:
            horizons.append(args.num_train_epochs * self.steps_per_epoch)
        if not horizons:
            raise ConfigError("set training.max_training_steps or training.num_train_epochs")
        return TrainerConfigureDataloaderOutput(batches, None, min(horizons), None)

    def configure_model(self) -> Any:
        built = super().configure_model()
        o, model = self.options, built.model
        longest = max(len(p.prompt_ids) for p in self.prompt_rows) + o.max_completion_length
        positions = getattr(model.config, "max_position_embeddings", None)
        if positions is not None and longest > positions:
            raise ConfigError(f"the longest prompt plus objective.max_completion_length is {longest} tokens, more than "
                              f"the model's max_position_embeddings={positions}; lower max_completion_length or set "
                              f"objective.max_prompt_length")
        self.frozen_models.declare("reference")  # recorded (None without one), checked on resume: training/frozen.py
        if o.beta != 0.0:  # the KL reference: a frozen copy, a model folder, or the LoRA base (adapters off)
            state: TrainState = built.state
            self._reference = self.frozen_models.add(set_up("reference", o.reference, model, state.graphdef,
                                                            state.params, state.frozen, self._mesh)).model
        return built

    def configure_functions(self) -> TrainerConfigureFunctionOutput:
        args, o = self.arguments, self.options
        sharding = batch_sharding(args, self._mesh)  # checks the batch against the mesh
        self._batch_axes = sharding.spec[0] if len(sharding.spec) else None
        state_sh = state_shardings(self._model_state)
        replicated = NamedSharding(self._mesh, PartitionSpec())
        self._update = jax.jit(
            functools.partial(train_step, tx=self._optimizer, objective=self.objective,
                              gradient_accumulation_steps=args.gradient_accumulation_steps,
                              log_grad_norms=args.log_grad_norms, log_weight_stats=args.log_weight_stats),
            out_shardings=(state_sh, replicated), donate_argnums=(0,))
        temperature = o.temperature
        graphdef = self._model_state.graphdef

        def policy_logps(params: Any, frozen: Any, ids: jax.Array, seg: jax.Array, pos: jax.Array,
                         width: int) -> jax.Array:
            return completion_token_stats(join_trainable(graphdef, params, frozen), ids, seg, pos, width, temperature)[0]

        def reference_logps(params: Any, frozen: Any, reference: Any, ids: jax.Array, seg: jax.Array,
                            pos: jax.Array, width: int) -> jax.Array:
            model = reference.model if reference is not None else adapters_off(join_trainable(graphdef, params, frozen))
            return completion_token_stats(model, ids, seg, pos, width, temperature)[0]

        self._policy_logps = jax.jit(policy_logps, static_argnames="width")
        self._reference_logps = jax.jit(reference_logps, static_argnames="width")
        stops = stop_token_ids(self.tokenizer, getattr(self._model.config, "eos_token_id", None))
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self._sampling = SamplingParams(
            max_completion_length=o.max_completion_length, temperature=o.temperature, top_k=o.top_k or None,
            top_p=None if o.top_p >= 1.0 else o.top_p, stop_token_ids=tuple(stops),
            pad_token_id=int(pad if pad is not None else (stops[0] if stops else 0)))
        self._flops_per_token = self._model.config.flops_per_token(args.max_length)
        self._peak_flops = peak_flops_per_device(args.peak_flops_per_device)
        cost = TokenCost.of(self._model.config, adapter_parameters(self._model_state.params),
                            lora=self._model_state.frozen is not None)
        self._flops = StepFlops(cost, self._peak_flops, jax.device_count())
        checkpointer = Checkpointer.for_run(args.output_dir, save_total_limit=args.save_total_limit,
                                            keep_best=args.save_best)
        return TrainerConfigureFunctionOutput(self._grpo_step, None, self._mesh, checkpointer)

    def plan_batch_lines(self) -> list[str]:
        """What a rollout samples and an update reads (``rl/plan.py``); the engine splits rows over the batch axes."""
        axes = axis_names(self._model.config.partition_axis.batch_axis)
        devices = int(np.prod([dict(self._mesh.shape).get(a, 1) for a in axes]))
        return grpo_plan_lines(self.arguments, self.options, [len(r.prompt_ids) for r in self.prompt_rows], devices)

    # ---- the step -------------------------------------------------------------------------
    def _fetch_batch(self) -> tuple[PromptBatch, Any] | None:
        """The next step's prompts (host indices: sampling needs the current state, so nothing is placed ahead)."""
        try:
            batch = next(self.dataloader_train)
        except StopIteration:
            return None
        return batch, self.dataloader_train.get_state()

    def _grpo_step(self, state: TrainState, prompts: PromptBatch) -> tuple[TrainState, dict[str, Any]]:
        step = self.global_step + 1
        host: dict[str, float] = {}
        if prompts.fresh or self._scored is None:
            if not prompts.fresh:
                logger.warning("step %d reuses a rollout that the checkpoint did not keep: sampling it again from "
                               "the resumed parameters", step)
            self._scored = self._rollout(state, prompts, step)
            host = self._scored.metrics
        start = time.perf_counter()
        state, metrics = self._update(state, self._scored.batch)
        jax.block_until_ready(metrics["loss"])
        seconds = time.perf_counter() - start
        return state, {**metrics, **host, "time/update": seconds,
                       **self._flops.update(self._scored.update_flops, self._scored.update_tokens, seconds)}

    def throughput(self, tokens: float, seconds: float) -> dict[str, float]:
        """What the steps since the last log computed (``rl/flops.py``), not ``tokens`` (``max_length`` rows)."""
        return self._flops.interval(seconds)

    def _row_sharding(self, ndim: int) -> NamedSharding:
        """Rows over the batch axes, every other dimension whole."""
        return NamedSharding(self._mesh, PartitionSpec(self._batch_axes, *([None] * (ndim - 1))))

    def _layout(self) -> RowLayout:
        """Which rows of a step's batch (``training.total_batch_size`` completions) this process holds and scores."""
        if self._rows is None:
            self._rows = RowLayout(self._row_sharding(1), self.arguments.total_batch_size)
        return self._rows

    def _place(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows of the objective's batch (``RowLayout.held``) as global arrays over the batch axes."""
        return {k: self._layout().place(np.asarray(v), self._row_sharding) for k, v in batch.items()}

    def _rollout(self, state: TrainState, prompts: PromptBatch, step: int) -> _Scored:
        """Sample, score and form the step's batch. On several processes every one runs the same rollout over the
        global mesh, reads the rows its devices hold, runs the rewards of the rows it owns, and gathers the small
        per-row results (rewards, lengths, log-prob gaps) so the batch-wide advantages and figures are the same
        everywhere (``rl/process_rows.py``)."""
        args, o = self.arguments, self.options
        rows, g = [self.prompt_rows[i] for i in prompts.indices], o.num_generations
        t0 = time.perf_counter()
        out = rollout(state, [list(r.prompt_ids) for r in rows], self._sampling, num_generations=g,
                      seed=args.seed, step=step)
        jax.block_until_ready(out)
        t1 = time.perf_counter()
        prompt_ids, prompt_mask = trim_prompt_padding(out.prompt_ids, out.prompt_mask,
                                                      max(len(r.prompt_ids) for r in rows))
        ids, seg, pos = rollout_rows(prompt_ids, prompt_mask, out.completion_ids, out.completion_mask)
        width = int(out.completion_ids.shape[1])
        device = {"input_ids": ids, "segment_ids": seg, "positions": pos, "completion_ids": out.completion_ids,
                  "completion_mask": out.completion_mask, "sampler": out.log_probs, "lengths": out.lengths,
                  "truncated": out.truncated}
        if not self._check_in_update:  # else the update's forward scores the tokens (rollout/logprob_diff_*)
            device["policy"] = self._policy_logps(state.params, state.frozen, ids, seg, pos, width=width)
        if o.beta != 0.0:
            device["ref_logps"] = self._reference_logps(state.params, state.frozen, self._reference, ids, seg, pos,
                                                        width=width)
        layout = self._layout()
        device = jax.device_put(device, {k: self._row_sharding(v.ndim) for k, v in device.items()})
        h = {k: layout.read(v) for k, v in device.items()}  # this process's rows only
        t2 = time.perf_counter()
        scored = score_rows(layout, h, rows, g, self.reward_functions, self.tokenizer, self.conversational,
                            o.reward_timeout, self._check_in_update)
        per_func, lengths, truncated, comp_ids = scored.per_func, scored.lengths, scored.truncated, scored.comp_ids
        names = [f.name for f in self.reward_functions]
        kl_rows = reward_kl_rows(self.objective.advantages, layout, h, o.mask_truncated_completions)
        adv = advantages_of(per_func, self.reward_weights, g, self.objective.advantages, names, kl_rows)
        t3 = time.perf_counter()
        mask = np.asarray(h["completion_mask"], np.float32)
        extra = {"ref_logps": h["ref_logps"]} if o.beta != 0.0 else {}
        if self._check_in_update:
            extra["sampler_logps"] = h["sampler"]
        if o.num_iterations > 1:
            extra["old_logps"] = h["policy"]
        if o.vllm_importance_sampling_correction:
            extra["importance_sampling_ratio"] = np.asarray(importance_sampling_ratio(
                h["policy"], h["sampler"], mask, o.vllm_importance_sampling_mode,
                o.vllm_importance_sampling_clip_min, o.vllm_importance_sampling_clip_max))
        batch = objective_batch(h["input_ids"], h["segment_ids"], h["positions"], mask, h["truncated"],
                                adv.advantages[layout.held], o.mask_truncated_completions, extra)
        counted, flops, tokens = self._flops.rollout(np.repeat([len(r.prompt_ids) for r in rows], g), lengths,
                                                     t1 - t0, scored=not self._check_in_update, reference=o.beta != 0)
        metrics = {**adv.metrics, **completion_metrics(lengths, truncated),
                   **({} if self._check_in_update else logprob_diff_figures(scored.diffs)), **scored.timeouts,
                   "time/rollout": t1 - t0, "time/reference": t2 - t1, "time/rewards": t3 - t2,
                   "rollout/tokens_per_s": float(lengths.sum()) / max(t1 - t0, 1e-9), **counted}
        if o.log_completions and logs_completions(step, o.num_iterations, o.log_completions_steps,
                                                  self.max_training_steps):
            all_ids = layout.gather(comp_ids)  # every process takes part; process 0 writes
            if self.is_main_process:
                shown = len(all_ids) if o.num_completions_to_print is None else o.num_completions_to_print
                shown = min(shown, len(all_ids))
                texts = decode(self.tokenizer, all_ids[:shown], lengths[:shown].astype(np.int64), self.conversational)
                self._write_completions(completion_records(step, [rows[r // g].prompt for r in range(shown)], texts,
                                                           per_func, names, adv.advantages, shown))
        return _Scored(self._place(batch), metrics, batch, prompts.epoch, prompts.index,
                       update_flops=flops, update_tokens=tokens)

    def _write_completions(self, records: list[dict[str, Any]]) -> None:
        """One whole append (``log_files``): a refused write leaves the file as it was and names it."""
        os.makedirs(self.arguments.output_dir, exist_ok=True)
        append_lines(os.path.join(self.arguments.output_dir, COMPLETIONS_FILE),
                     [json.dumps(record, ensure_ascii=False) for record in records])

    # ---- evaluation and checkpoints -------------------------------------------------------
    def evaluate(self, state: TrainState | None = None, metric_calculator: Any = None) -> dict[str, float]:
        raise ConfigError("GRPOTrainer has no evaluation split: its figures (reward, kl, ...) are logged every step")

    def checkpoint_metadata(self, state: TrainState) -> dict[str, Any]:
        meta = super().checkpoint_metadata(state)
        meta["objective"] = {"name": self.objective_type, **self.options.model_dump(exclude={"reward_funcs"}),
                             "reward_funcs": [f.name for f in self.reward_functions],
                             "reward_specs": self.reward_specs}
        return meta

    def consumed_data_state(self) -> Any:
        """The prompt position a checkpoint records and, when the next step reuses the current rollout (inside a
        ``num_iterations`` cycle), that rollout's batch (``rl/rollout_store.py``): the data the next steps read.
        The whole batch, gathered from every process (process 0 writes it), so any process count resumes it."""
        position = dict(super().consumed_data_state())
        if position.get("repeat", 0) and self._scored is not None:
            whole = {k: self._layout().gather(v, rows="held") for k, v in self._scored.host.items()}  # collectives
            position[rollout_store.KEY] = rollout_store.encode(whole, epoch=self._scored.epoch,
                                                               index=self._scored.index)
        return position

    def maybe_resume(self, state: TrainState) -> TrainState:
        """:meth:`_resume_checked`; then, once every check has passed, ``completions.jsonl`` cut back to the step
        resumed from: the steps this run redoes write their records again (an uninterrupted run's file results)."""
        state = self._resume_checked(state)
        args = self.arguments
        if self.is_main_process and (self.resumed_from is not None or args.resume_if_possible):
            drop_records_after(os.path.join(args.output_dir, COMPLETIONS_FILE), int(jax.device_get(state.step)))
        return state

    def _resume_checked(self, state: TrainState) -> TrainState:
        """The base resume (which checks the reference, ``training/frozen.py``); then, inside a ``num_iterations``
        cycle, the stored rollout put back so the next step reuses it as is."""
        state = super().maybe_resume(state)
        where = self.resumed_from
        if where is None:
            return state
        position = self.dataloader_train.get_state()
        if not position["repeat"]:
            return state
        try:
            with open(os.path.join(where, "data", "metadata"), encoding="utf-8") as f:
                record = json.load(f)["train"].get(rollout_store.KEY)
        except (OSError, ValueError, KeyError):
            record = None
        if record is None:  # a checkpoint from before rollouts were stored: _grpo_step samples it again, warning
            return state
        whole = rollout_store.decode(record, epoch=position["epoch"], index=position["index"], where=where)
        host = {k: v[self._layout().held] for k, v in whole.items()}  # this process's rows of the whole batch
        self._scored = _Scored(self._place(host), {}, host, position["epoch"], position["index"])
        return state


register_trainer(GRPOTrainer, "grpo")
