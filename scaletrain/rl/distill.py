"""``DistillationTrainer`` and ``GKDTrainer``: a student trained towards a frozen teacher on the same mesh.

Why subclasses of :class:`~scaletrain.rl.trainer.GRPOTrainer`: on-policy distillation samples from the live
student exactly as GRPO does (the rollout engine over the training arrays: no copy, no weight sync), with one
completion a prompt and no reward; what changes is the frozen model the step reads (the ``teacher``, set up,
recorded and checked on resume by ``training/frozen.py``) and the update, one plain ``train_step`` of
:class:`~scaletrain.objectives.distill.DistillationObjective` whose teacher forward runs inside the same jitted
program. The prompts, their batches, the engine, checkpoints with their resume checks, ``completions/*`` figures
and the FLOP accounting are GRPO's.

A step's rows come from one of three places (:meth:`DistillationTrainer.step_source`):

- ``student``: sampled from the live student (every step of ``distillation``; a ``lmbda`` share of GKD's);
- ``dataset``: the dataset's completions (GKD's other steps; ``rl/distill_rows.py``);
- ``teacher``: sampled from the teacher (GKD's other steps with ``seq_kd``).

Which one is drawn from ``(seed, step)``, so a resumed run draws what the uninterrupted one drew. TRL's names
throughout: ``model``, ``teacher_model``, ``args``, ``train_dataset``, ``processing_class``, ``peft_config``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from scaletrain.errors import ConfigError
from scaletrain.generation import rollout_rows, stop_token_ids
from scaletrain.objectives.distill import ROW_KEYS, TEACHER
from scaletrain.objectives.registry import register_trainer
from scaletrain.parallel.host import to_host
from scaletrain.rl.batch import kept_prompt_columns
from scaletrain.rl.config import DistillationConfig, GKDConfig, RLConfig
from scaletrain.rl.distill_rows import fixed_rollout, with_completions
from scaletrain.rl.flops import StepFlops, TokenCost, adapter_parameters, forward_flops, update_flops
from scaletrain.rl.prompt_batches import PromptBatch
from scaletrain.rl.scoring import completion_metrics
from scaletrain.rl.trainer import GRPOTrainer, _Scored
from scaletrain.training.base import batch_sharding
from scaletrain.training.checkpoint import Checkpointer
from scaletrain.training.frozen import set_up
from scaletrain.training.metrics import peak_flops_per_device
from scaletrain.training.protocol import TrainerConfigureDataloaderOutput, TrainerConfigureFunctionOutput
from scaletrain.training.state import FrozenModel, TrainState, state_shardings
from scaletrain.training.steps import LayoutJit, train_step

Array = jax.Array
SOURCES = ("student", "dataset", "teacher")


def make_rows_program(row_sharding: Callable[[int], Any]) -> Callable[..., dict[str, Array]]:
    """``rows(rollout, drop=) -> batch``, jitted: a rollout's prompts (less ``drop`` left padding columns) and
    completions as the rows the update reads, laid out as it reads them."""

    def rows(rollout: dict[str, Array], drop: int) -> dict[str, Array]:
        ids, seg, pos = rollout_rows(rollout["prompt_ids"][:, drop:], rollout["prompt_mask"][:, drop:],
                                     rollout["completion_ids"], rollout["completion_mask"])
        return {"input_ids": ids, "segment_ids": seg, "positions": pos,
                "completion_mask": rollout["completion_mask"].astype(jnp.float32)}

    return jax.jit(rows, static_argnames="drop", out_shardings={k: row_sharding(2) for k in ROW_KEYS})


class DistillationTrainer(GRPOTrainer):
    """TRL 1.16's ``DistillationTrainer`` (see the module docstring). ``teacher_model``: a model folder or a module
    (default ``options.teacher``, a recipe's ``objective.teacher``); ``args``: a :class:`DistillationConfig` or
    ``TrainingArguments`` with the options as keywords; ``train_dataset``: prompt rows (and, for GKD's off-policy
    steps, their completions); ``rollout_engine``: what samples the student (default GRPO's)."""

    objective_type: ClassVar[str] = "distillation"
    config_class: ClassVar[type[RLConfig]] = DistillationConfig

    def __init__(self, model: Any = None, teacher_model: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, **kwargs: Any):
        if "reward_funcs" in kwargs:
            raise ConfigError(f"{type(self).__name__} scores no rewards: drop reward_funcs")
        self._teacher_given = teacher_model
        self._teacher: FrozenModel | None = None
        self._completions: list[list[int]] | None = None
        super().__init__(model, None, args, train_dataset, eval_dataset, processing_class, **kwargs)

    # ---- configuration ----------------------------------------------------------------
    def configure_rewards(self, specs: Any) -> None:
        self.reward_functions, self.reward_weights, self.reward_specs = [], [], []

    def configure_dataloaders(self) -> TrainerConfigureDataloaderOutput:
        """GRPO's prompt batches; first, when some steps read the dataset's completions, those completions."""
        o = self.options
        if o.lmbda < 1.0 and not o.seq_kd:
            eos = getattr(self.tokenizer, "eos_token_id", None)
            if eos is None:
                raise ConfigError("the tokenizer has no eos_token_id, which ends each dataset completion; set one")
            self.prompt_rows, self._completions = with_completions(self.prompt_rows, self.tokenizer, int(eos),
                                                                   o.max_prompt_length)
        return super().configure_dataloaders()

    def set_up_frozen_models(self, built: Any) -> Any:
        """The teacher: a model folder or module on the student's mesh (``teacher_dtype``: its dtype), frozen,
        recorded as ``teacher`` and checked on resume; into ``TrainState.frozen_models`` for the update."""
        o, state = self.options, built.state
        given = self._teacher_given if self._teacher_given is not None else o.teacher
        if given is None:
            raise ConfigError("objective.teacher is not set: give the teacher's model folder (a Hugging Face model "
                              "of the student's tokenizer), or teacher_model= in Python")
        self.frozen_models.declare(TEACHER)
        dtype = jnp.dtype(o.teacher_dtype) if o.teacher_dtype else None
        setup = self.frozen_models.add(set_up(TEACHER, given, built.model, state.graphdef, state.params,
                                              state.frozen, self._mesh, dtype=dtype))
        self._teacher = setup.model
        return built._replace(state=state.replace(frozen_models={**state.frozen_models, TEACHER: setup.model}))

    def starting_state(self, state: TrainState | None = None, model_parameters: Any = None) -> TrainState:
        """The base's, with the teacher kept: a state given to ``train(state=...)`` carries only the student."""
        if state is not None:
            state = state.replace(frozen_models=self._model_state.frozen_models)
        return super().starting_state(state, model_parameters)

    def configure_functions(self) -> TrainerConfigureFunctionOutput:
        """The rows program and the update (``train_step`` of the distillation objective, the teacher read from
        the state's frozen models inside it), jitted per batch layout; the rollout engine; the FLOP counts."""
        args = self.arguments
        checked = batch_sharding(args, self._mesh)
        self._batch_axes = checked.spec[0] if len(checked.spec) else None
        self.batch_sharding = NamedSharding(self._mesh, PartitionSpec(self._batch_axes))
        state_sh = state_shardings(self._model_state)
        replicated = NamedSharding(self._mesh, PartitionSpec())
        update = functools.partial(train_step, tx=self._optimizer, objective=self.objective,
                                   gradient_accumulation_steps=args.gradient_accumulation_steps,
                                   log_grad_norms=args.log_grad_norms, log_weight_stats=args.log_weight_stats)
        learn = LayoutJit(update, state_sh, self.batch_sharding, (state_sh, replicated), donate_argnums=(0,))
        self._rows_program = make_rows_program(self._row_sharding)
        self.rollout_engine = self.make_rollout_engine()
        self._flops_per_token = self._model.config.flops_per_token(args.max_length)
        self._peak_flops = peak_flops_per_device(args.peak_flops_per_device)
        cost = TokenCost.of(self._model.config, adapter_parameters(self._model_state.params),
                            lora=self._model_state.frozen is not None)
        self._flops = StepFlops(cost, self._peak_flops, jax.device_count())
        assert self._teacher is not None
        self._teacher_cost = TokenCost.of(self._teacher.model.config, 0.0, lora=False)
        checkpointer = Checkpointer.for_run(args.output_dir, save_total_limit=args.save_total_limit,
                                            keep_best=args.save_best)
        return TrainerConfigureFunctionOutput(learn, None, self._mesh, checkpointer)

    # ---- the step -------------------------------------------------------------------------
    def step_source(self, step: int) -> str:
        """Where step ``step``'s rows come from (see the module docstring): drawn from ``(seed, step)`` with
        probability ``lmbda`` of the student, as TRL's GKD draws per step."""
        o = self.options
        if o.lmbda >= 1.0:
            return "student"
        draw = np.random.default_rng([self.arguments.seed, step, 0x6B64]).random()
        if draw < o.lmbda:
            return "student"
        return "teacher" if o.seq_kd else "dataset"

    def run_training_step(self, state: TrainState, prompts: PromptBatch) -> tuple[TrainState, dict[str, Any]]:
        step = self.global_step + 1
        scored = self._rollout(state, prompts, step)
        start = time.perf_counter()
        state, metrics = self.sharded_training_step_function(state, scored.batch)
        jax.block_until_ready(metrics["loss"])
        seconds = time.perf_counter() - start
        return state, {**metrics, **scored.metrics, "time/update": seconds,
                       **self._flops.update(scored.update_flops, scored.update_tokens, seconds)}

    def _rollout(self, state: TrainState, prompts: PromptBatch, step: int) -> _Scored:
        """The step's rows on the devices (sampled, or the dataset's); only lengths and truncation flags are read."""
        args, o = self.arguments, self.options
        rows = [self.prompt_rows[i] for i in prompts.indices]
        source = self.step_source(step)
        t0 = time.perf_counter()
        if source == "dataset":
            assert self._completions is not None
            stops = stop_token_ids(self.tokenizer, getattr(self._model.config, "eos_token_id", None))
            pad = self.rollout_engine.sampling.pad_token_id
            fixed = fixed_rollout([r.prompt_ids for r in rows], [self._completions[i] for i in prompts.indices],
                                  o.max_completion_length, pad, stops)
            out = self._place(fixed.arrays())
        else:
            sampler = state if source == "student" else self._teacher_sampler(state)
            out = self.rollout_engine.generate(sampler, [list(r.prompt_ids) for r in rows], num_generations=1,
                                               seed=args.seed, step=step)._asdict()
        jax.block_until_ready(out)
        t1 = time.perf_counter()
        width = int(out["prompt_ids"].shape[1])
        drop = width - kept_prompt_columns(width, max(len(r.prompt_ids) for r in rows))
        batch = self._rows_program({k: out[k] for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                        "completion_mask")}, drop=drop)
        lengths, truncated = to_host(out["lengths"]), to_host(out["truncated"])
        p = np.asarray([len(r.prompt_ids) for r in rows], np.float64)
        c = lengths.astype(np.float64)
        counted: dict[str, float] = {}
        if source == "dataset":
            flops, tokens = update_flops(self._flops.cost, p + c, c), float(np.sum(p + c))
        else:  # a sample of the teacher counts at the student's cost: an estimate, named as the student's rollout
            counted, flops, tokens = self._flops.rollout(p, c, t1 - t0, scored=False, reference=False)
        flops += forward_flops(self._teacher_cost, p + c, c, adapters=False)  # the teacher's forward in the update
        metrics = {**completion_metrics(lengths, truncated), "time/rollout": t1 - t0, **counted,
                   "rollout/on_policy": float(source == "student"),
                   "rollout/tokens_per_s": float(c.sum()) / max(t1 - t0, 1e-9)}
        return _Scored(batch, metrics, prompts.epoch, prompts.index, update_flops=flops, update_tokens=tokens)

    def _teacher_sampler(self, state: TrainState) -> TrainState:
        """The teacher as the rollout engine reads a state (``seq_kd``): its graph and arrays, no LoRA base."""
        assert self._teacher is not None
        return state.replace(graphdef=self._teacher.graphdef, params=self._teacher.params, frozen=None,
                             frozen_models={})


class GKDTrainer(DistillationTrainer):
    """TRL's experimental ``GKDTrainer``: ``lmbda``, ``beta``, ``temperature``, ``max_new_tokens``, ``seq_kd``
    (see the module docstring); arguments as :class:`DistillationTrainer`'s, with a :class:`GKDConfig`."""

    objective_type: ClassVar[str] = "gkd"
    config_class: ClassVar[type[RLConfig]] = GKDConfig


register_trainer(DistillationTrainer, "distillation")
register_trainer(GKDTrainer, "gkd")
