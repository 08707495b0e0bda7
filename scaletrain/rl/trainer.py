"""``GRPOTrainer``: the Trainer's loop, checkpoints and callbacks, with a step that samples before it learns.

One step: sample ``num_generations`` completions of each of the step's prompts from the live
training state through the rollout interface (``scaletrain.generation.interface``: no copy, no
weight sync), score the sampled tokens on the devices with the trainer's own forward (the old
log-probabilities, and the sampler-vs-trainer check ``rollout/logprob_diff_*``; with one iteration
the update's own forward does this check instead, so the step runs no extra forward, as TRL's) and,
with ``beta > 0``, with the reference; read only the completion ids to the host and run the reward
functions there; send the ``[N]`` rewards back, and one device program forms the group advantages
and takes one optimizer step of the GRPO objective (``scaletrain.objectives.grpo``;
``rl/step_programs.py`` holds both device programs). With ``num_iterations`` = μ the rollout batch is reused for μ
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
from pydantic import BaseModel

from scaletrain.data.prompts import PromptRow, is_messages, load_prompts
from scaletrain.errors import ConfigError, DataError
from scaletrain.generation import ContinuousBatchEngine, RolloutEngine, SamplingParams, StaticBatchEngine
from scaletrain.generation import stop_token_ids
from scaletrain.log_files import append_lines, drop_records_after
from scaletrain.objectives.grpo import GRPOObjective
from scaletrain.objectives.grpo_options import TRL_VLLM_OPTIONS, GRPOOptions
from scaletrain.objectives.registry import get_objective_type, register_trainer, validate_options
from scaletrain.rl.config import GRPOConfig, RLConfig
from scaletrain.rl.batch import kept_prompt_columns
from scaletrain.rl.prompt_batches import PromptBatch, PromptBatches
from scaletrain.rl import reward_model, rollout_store
from scaletrain.rl.advantages import on_host, reward_figures, weighted_rewards
from scaletrain.rl.agentic import Agentic, agentic_engine, objective_record, run_rewards, sample_step
from scaletrain.rl.flops import StepFlops, TokenCost, adapter_parameters
from scaletrain.rl.plan import grpo_plan_lines
from scaletrain.rl.process_rows import RowLayout
from scaletrain.rl.rewards import recorded_spec
from scaletrain.rl.row_scores import score_rows
from scaletrain.rl.scoring import completion_metrics, completion_records, decode, logs_completions
from scaletrain.rl.step_programs import FRESH_ONLY, REWARDS, ScoreSpec, learn_step, make_score_program, row_advantages
from scaletrain.parallel.host import to_host
from scaletrain.parallel.partition import axis_names
from scaletrain.training.base import batch_sharding
from scaletrain.training.checkpoint import Checkpointer
from scaletrain.training.metrics import peak_flops_per_device
from scaletrain.training.protocol import TrainerConfigureDataloaderOutput, TrainerConfigureFunctionOutput
from scaletrain.training.frozen import set_up
from scaletrain.training.state import FrozenModel, TrainState, state_shardings
from scaletrain.training.steps import LayoutJit, rank_sharding, train_step
from scaletrain.training.trainer import Trainer
from scaletrain.training.trl_inputs import default_arguments, model_from, one_of, tokenizer_from, with_peft_config

logger = logging.getLogger("scaletrain")

COMPLETIONS_FILE = "completions.jsonl"


@dataclasses.dataclass
class _Scored:
    """A rollout made into the objective's batch, on the devices: with the ``[N]`` rewards until its first update
    turns them into advantages, which a reuse (``num_iterations``) reads. Its figures, the prompt batch
    ``(epoch, index)`` it came from, and what ``completions.jsonl`` shows of it once the advantages are known."""

    batch: dict[str, jax.Array]
    metrics: dict[str, Any]
    epoch: int
    index: int
    update_flops: float | None = None  # model FLOPs of one update on this batch (rl/flops.py); None: not known
    update_tokens: float = 0.0  # the real tokens (prompt + completion) the update reads
    shown: tuple[list[Any], list[Any], np.ndarray, int] | None = None  # (prompts, completions, rewards, rows)


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
    ``rollout_engine``: what samples (a :class:`~scaletrain.generation.interface.RolloutEngine`; its sampling
    temperature should be ``options.temperature``, at which the trainer scores the tokens); default today's
    static-batch engine (:meth:`make_rollout_engine`).
    """

    objective_type: ClassVar[str] = "grpo"
    config_class: ClassVar[type[RLConfig]] = GRPOConfig

    def __init__(self, model: Any = None, reward_funcs: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, *, arguments: Any = None,
                 dataset_train: Any = None, dataset_eval: Any = None, tokenizer: Any = None,
                 options: GRPOOptions | dict[str, Any] | None = None, objective: Any = None,
                 eval_bytes_per_token: float | None = None, peft_config: Any = None,
                 rollout_engine: RolloutEngine | None = None, **kwargs: Any):
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
        if isinstance(rollout_engine, str):  # the option's name (a recipe's objective.rollout_engine), not an engine
            kwargs["rollout_engine"], rollout_engine = rollout_engine, None
        fields = {k: kwargs.pop(k) for k in list(kwargs) if k in kind.options.model_fields or k in TRL_VLLM_OPTIONS}
        base = arguments.rl_options().model_dump() if isinstance(arguments, RLConfig) else {}
        if isinstance(options, BaseModel):
            options = options.model_dump()
        self.options = validate_options(self.objective_type, {**base, **dict(options or {}), **fields})
        if one_of(eval_dataset=eval_dataset, dataset_eval=dataset_eval) is not None:
            raise ConfigError("GRPO has no evaluation split (its figures are logged every step): drop eval_dataset "
                              "(data.eval_source / eval_fraction)")
        o = self.options
        if tokenizer is None:
            raise ConfigError("GRPOTrainer needs a tokenizer: completions are decoded for the reward functions")
        self.prompts_per_step = check_batch_size(arguments.total_batch_size, o.num_generations)
        self.policy_tokenizer, self.agentic = tokenizer, Agentic.of(o)  # the tools and environments (rl/agentic.py)
        self.configure_rewards(reward_funcs if reward_funcs is not None else o.reward_funcs)
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
        self._given_engine = rollout_engine
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
    def configure_rewards(self, specs: Any) -> None:
        """The reward functions, weights and recorded specs of ``specs`` (none for a trainer without rewards)."""
        funcs = run_rewards(self.agentic, specs, self.options.reward_weights, tokenizer=self.policy_tokenizer)
        self.reward_functions, self.reward_weights = funcs
        self.reward_specs = [recorded_spec(s) for s in (specs if isinstance(specs, (list, tuple)) else [specs])]

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
        return self.set_up_frozen_models(built)

    def set_up_frozen_models(self, built: Any) -> Any:
        """The frozen models read (``training/frozen.py``): the KL reference, the reward models; a subclass's own."""
        o, model = self.options, built.model
        self.frozen_models.declare("reference")  # recorded (None without one), checked on resume: training/frozen.py
        reward_model.record_reward_models(self.frozen_models, self.reward_functions)
        if o.beta != 0.0:  # the KL reference: a frozen copy, a model folder, or the LoRA base (adapters off)
            state: TrainState = built.state
            self._reference = self.frozen_models.add(set_up("reference", o.reference, model, state.graphdef,
                                                            state.params, state.frozen, self._mesh)).model
        return built

    def configure_functions(self) -> TrainerConfigureFunctionOutput:
        """The device programs of a step (``rl/step_programs.py``): the score program, and as
        ``sharded_training_step_function`` the update that forms the advantages, jitted per batch layout with the
        base trainer's per-key in-shardings (``LayoutJit``); and the rollout engine."""
        args, o = self.arguments, self.options
        checked = batch_sharding(args, self._mesh)  # checks the batch against the mesh
        self._batch_axes = checked.spec[0] if len(checked.spec) else None
        # rows over the batch axes, every other dimension whole, cut to each key's rank as the base trainer's
        # (rank_sharding): a rollout's widths need not divide the sequence axis, so it is not split over it
        self.batch_sharding = NamedSharding(self._mesh, PartitionSpec(self._batch_axes))
        state_sh = state_shardings(self._model_state)
        replicated = NamedSharding(self._mesh, PartitionSpec())
        update = functools.partial(train_step, tx=self._optimizer, objective=self.objective,
                                   gradient_accumulation_steps=args.gradient_accumulation_steps,
                                   log_grad_norms=args.log_grad_norms, log_weight_stats=args.log_weight_stats)
        learn = LayoutJit(functools.partial(learn_step, update=update, num_generations=o.num_generations,
                                            estimator=self.objective.advantages, replicated=replicated),
                          state_sh, self.batch_sharding, (state_sh, replicated, self._row_sharding(1)),
                          donate_argnums=(0,))
        spec = ScoreSpec(temperature=o.temperature, check_in_update=self._check_in_update,
                         num_iterations=o.num_iterations, beta=o.beta, values="values" in self.objective.batch_keys,
                         mask_truncated_completions=o.mask_truncated_completions,
                         importance_sampling=(o.vllm_importance_sampling_mode, o.vllm_importance_sampling_clip_min,
                                              o.vllm_importance_sampling_clip_max)
                         if o.vllm_importance_sampling_correction else None,
                         kl_rows=self.objective.advantages.kl_coef != 0.0)
        self._score = make_score_program(self._model_state.graphdef, spec, self._row_sharding, replicated)
        self.rollout_engine = self.make_rollout_engine()
        self._flops_per_token = self._model.config.flops_per_token(args.max_length)
        self._peak_flops = peak_flops_per_device(args.peak_flops_per_device)
        cost = TokenCost.of(self._model.config, adapter_parameters(self._model_state.params),
                            lora=self._model_state.frozen is not None)
        self._flops = StepFlops(cost, self._peak_flops, jax.device_count())
        checkpointer = Checkpointer.for_run(args.output_dir, save_total_limit=args.save_total_limit,
                                            keep_best=args.save_best)
        return TrainerConfigureFunctionOutput(learn, None, self._mesh, checkpointer)

    def make_rollout_engine(self) -> RolloutEngine:
        """``rollout_engine=`` if given, else the engine ``options.rollout_engine`` names (static batch by default) with
        the options' sampling (TRL's names; the tokenizer's stop ids, its pad id); with tools, under the tool loop."""
        if self._given_engine is not None:
            return self._given_engine
        o, pad = self.options, getattr(self.tokenizer, "pad_token_id", None)
        stops = stop_token_ids(self.tokenizer, getattr(self._model.config, "eos_token_id", None))
        sampling = SamplingParams(
            max_completion_length=o.max_completion_length, temperature=o.temperature, top_k=o.top_k or None,
            top_p=None if o.top_p >= 1.0 else o.top_p, stop_token_ids=tuple(stops),
            pad_token_id=int(pad if pad is not None else (stops[0] if stops else 0)))
        engine = (ContinuousBatchEngine(sampling, slots=o.rollout_slots, cache_pages=o.rollout_cache_pages,
                                        keep_pages=o.rollout_keep_pages)
                  if o.rollout_engine == "continuous" else StaticBatchEngine(sampling))  # agentic: each turn sampled by it, tools between (rl/multi_turn)
        return engine if self.agentic is None else agentic_engine(engine, self.tokenizer, o, self._model.config)

    def plan_batch_lines(self) -> list[str]:
        """What a rollout samples and an update reads (``rl/plan.py``); the engine splits rows over the batch axes."""
        axes = axis_names(self._model.config.partition_axis.batch_axis)
        devices = int(np.prod([dict(self._mesh.shape).get(a, 1) for a in axes]))
        return grpo_plan_lines(self.arguments, self.options, [len(r.prompt_ids) for r in self.prompt_rows], devices)

    # ---- the step -------------------------------------------------------------------------
    def place_batch(self, batch: PromptBatch) -> PromptBatch:
        """The step's prompts stay host indices: sampling needs the current state, so nothing is placed ahead."""
        return batch

    def run_training_step(self, state: TrainState, prompts: PromptBatch) -> tuple[TrainState, dict[str, Any]]:
        """Sample and score a fresh rollout (or reuse the current one inside a ``num_iterations`` cycle), then the
        update program (``sharded_training_step_function``): the device arrays go in as they are."""
        step = self.global_step + 1
        host: dict[str, Any] = {}
        if prompts.fresh or self._scored is None:
            if not prompts.fresh:
                logger.warning("step %d reuses a rollout that the checkpoint did not keep: sampling it again from "
                               "the resumed parameters", step)
            self._scored = self._rollout(state, prompts, step)
            host = self._scored.metrics
        scored = self._scored
        start = time.perf_counter()
        state, metrics, formed = self.sharded_training_step_function(state, scored.batch)
        jax.block_until_ready(metrics["loss"])
        seconds = time.perf_counter() - start
        if REWARDS in scored.batch:  # its first update: the advantages join the batch that a reuse reads
            scored.batch = {**{k: v for k, v in scored.batch.items() if k not in FRESH_ONLY}, **formed}
            if scored.shown is not None:
                self._log_completions(step, scored.shown, row_advantages(formed))
        return state, {**metrics, **host, "time/update": seconds,
                       **self._flops.update(scored.update_flops, scored.update_tokens, seconds)}

    def throughput(self, tokens: float, seconds: float) -> dict[str, float]:
        """What the steps since the last log computed (``rl/flops.py``), not ``tokens`` (``max_length`` rows)."""
        return self._flops.interval(seconds)

    def _row_sharding(self, ndim: int) -> NamedSharding:
        """A batch key of rank ``ndim`` as the update reads it: rows over the batch axes (``rank_sharding``)."""
        return rank_sharding(self.batch_sharding, ndim)

    def _layout(self) -> RowLayout:
        """Which rows of a step's batch (``training.total_batch_size`` completions) this process holds and scores."""
        if self._rows is None:
            self._rows = RowLayout(self._row_sharding(1), self.arguments.total_batch_size)
        return self._rows

    def _place(self, whole: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """A whole batch that every process holds on the host (a stored rollout, the rewards) as global arrays, laid
        out as the update reads them."""
        return {k: jax.make_array_from_callback(np.shape(v), self._row_sharding(np.ndim(v)),
                                                lambda index, v=v: np.asarray(v)[index]) for k, v in whole.items()}

    def _rollout(self, state: TrainState, prompts: PromptBatch, step: int) -> _Scored:
        """Sample, score and form the step's batch, on the devices; only the completion ids (and the per-row lengths
        and truncation flags) are read to the host, for the rewards, and only the ``[N]`` rewards go back. On
        several processes every one runs the same rollout over the global mesh, reads the rows its devices hold,
        runs the rewards of the rows it owns, and gathers the small per-row results (rewards, lengths) so the
        batch-wide rewards and figures are the same everywhere (``rl/process_rows.py``)."""
        args, o = self.arguments, self.options
        rows, g = [self.prompt_rows[i] for i in prompts.indices], o.num_generations
        t0 = time.perf_counter()
        # agentic: a fresh environment per row, prompts rendered with the row's tools, the multi-turn rollout
        out, agent = sample_step(self.agentic, self.rollout_engine, state, rows, g, self.tokenizer, seed=args.seed,
                                 step=step, layout=self._layout())
        jax.block_until_ready(out)
        t1 = time.perf_counter()
        width = int(out.prompt_ids.shape[1])
        drop = width - kept_prompt_columns(width, agent.longest if agent else max(len(r.prompt_ids) for r in rows))
        batch, gap, for_host = self._score(state.params, state.frozen, self._reference, out._asdict(), drop=drop)
        jax.block_until_ready(batch)
        t2 = time.perf_counter()
        layout = self._layout()
        held = {k: layout.read(v) for k, v in for_host.items()}  # the only reads: this process's rows
        scored = score_rows(layout, held, rows, g, self.reward_functions, self.tokenizer, self.conversational,
                            o.reward_timeout, agent=agent)
        names = [f.name for f in self.reward_functions]
        # the [N] weighted rewards go back to the devices, where the update program makes them advantages with
        # the objective's estimator (less RLOO's KL, kl_rows); the figures TRL logs beside them are read here
        rewards, spec = weighted_rewards(scored.per_func, self.reward_weights), self.objective.advantages
        kl_rows = layout.gather(held["kl_rows"], rows="held") if "kl_rows" in held else None
        with on_host():  # host floats: no kernel launches on an accelerator
            shaped = np.asarray(spec.shaped(rewards, kl_rows))
        figures = reward_figures(scored.per_func, rewards, shaped, g, spec.spread, names)
        batch = {**batch, **self._place({REWARDS: rewards})}
        t3 = time.perf_counter()
        lengths = scored.lengths if agent is None else agent.model_tokens  # TRL counts the model's tokens only
        counted, flops, tokens = self._flops.rollout(np.repeat([len(r.prompt_ids) for r in rows], g), lengths,
                                                     t1 - t0, scored=not self._check_in_update, reference=o.beta != 0)
        metrics = {**figures, **completion_metrics(lengths, scored.truncated), **gap, **scored.timeouts,
                   **(agent.figures if agent else {}),
                   "time/rollout": t1 - t0, "time/reference": t2 - t1, "time/rewards": t3 - t2,
                   "rollout/tokens_per_s": float(lengths.sum()) / max(t1 - t0, 1e-9), **counted}
        shown = None
        if o.log_completions and logs_completions(step, o.num_iterations, o.log_completions_steps,
                                                  self.max_training_steps):
            all_ids = layout.gather(scored.comp_ids)  # every process takes part; process 0 writes
            count = len(all_ids) if o.num_completions_to_print is None else o.num_completions_to_print
            count = min(count, len(all_ids))
            texts = decode(self.tokenizer, all_ids[:count], scored.lengths[:count].astype(np.int64),
                           self.conversational) if agent is None else agent.records[:count]
            shown = ([rows[r // g].prompt for r in range(count)], texts, scored.per_func, count)
        return _Scored(batch, metrics, prompts.epoch, prompts.index, update_flops=flops, update_tokens=tokens,
                       shown=shown)

    def _log_completions(self, step: int, shown: tuple[list[Any], list[Any], np.ndarray, int],
                         advantages: jax.Array) -> None:
        """``completions.jsonl``'s records of a rollout, once its update formed the advantages (``[N]``, read here:
        a gather on several processes, so every process calls it; process 0 writes)."""
        advantages = to_host(advantages)
        if self.is_main_process:
            prompts, texts, per_func, count = shown
            names = [f.name for f in self.reward_functions]
            self._write_completions(completion_records(step, prompts, texts, per_func, names, advantages, count))

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
        meta["objective"] = {"name": self.objective_type, **objective_record(self.options),
                             "reward_funcs": [f.name for f in self.reward_functions],
                             "reward_specs": self.reward_specs}
        return meta

    def consumed_data_state(self) -> Any:
        """The prompt position a checkpoint records and, when the next step reuses the current rollout (inside a
        ``num_iterations`` cycle), that rollout's batch (``rl/rollout_store.py``): the data the next steps read.
        The whole batch, gathered from every process (process 0 writes it), so any process count resumes it."""
        position = dict(super().consumed_data_state())
        if position.get("repeat", 0) and self._scored is not None:
            whole = {k: to_host(v) for k, v in self._scored.batch.items()}  # gathers over processes: collectives
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
        if record is None:  # a checkpoint from before rollouts were stored: sampled again, with a warning
            return state
        whole = rollout_store.decode(record, epoch=position["epoch"], index=position["index"], where=where)
        self._scored = _Scored(self._place(whole), {}, position["epoch"], position["index"])
        return state


register_trainer(GRPOTrainer, "grpo")
