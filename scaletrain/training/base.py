"""``BaseTrainer``: builds what the loop needs — data iterators, model state, jitted steps.

The three ``configure_*`` methods are EasyDeL's names (see ``BaseTrainerProtocol``);
each returns its NamedTuple so a subclass can replace one piece. ``Trainer`` adds the
loop and evaluation. Side effects (logging, checkpoints, stopping) are callbacks; the
trainer offers them the surface listed in ``TrainerView`` and nothing more.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from scaletrain.arguments import TrainingArguments
from scaletrain.compile_cache import enable_compilation_cache
from scaletrain.data.loader import as_source_or_rows, make_batch_iterator, steps_per_epoch
from scaletrain.errors import ConfigError, DataError
from scaletrain.models.factory import place_model
from scaletrain.objectives import LanguageModelObjective, Objective
from scaletrain.objectives.loss import resolve_chunk_size
from scaletrain.parallel.partition import batch_problems
from scaletrain.training.callbacks import (
    Callback,
    CheckpointSaver,
    MetricsLogger,
    PeriodicEvaluation,
    PreviewGeneration,
    ProgressBar,
    TrainingHorizon,
)
from scaletrain.training.checkpoint import Checkpointer, resume_source
from scaletrain.training.frozen import FrozenModels
from scaletrain.training.loggers import RunWriters
from scaletrain.training.metrics import peak_flops_per_device, throughput
from scaletrain.training.optim import make_optimizer, make_schedule
from scaletrain.training.router_bias import outside_optimizer
from scaletrain.training.protocol import (BaseTrainerProtocol, TrainerConfigureDataloaderOutput,
                                          TrainerConfigureFunctionOutput, TrainerConfigureModelOutput)
from scaletrain.training.lora_state import base_record, with_lora
from scaletrain.training.resume import check_same_run, restore_data_position, warn_about_later_checkpoints
from scaletrain.training.run_lock import RunLock, acquire_run_lock, release_run_lock
from scaletrain.training.state import TrainState, adopt_state, create_train_state, state_shardings
from scaletrain.training.steps import make_step_functions, rank_sharding
from scaletrain.training.stopping import NanGuard, StoppingRules

logger = logging.getLogger("scaletrain")


class BaseTrainer(BaseTrainerProtocol):
    """Builds model state, data loaders and step functions; ``Trainer`` adds the loop."""

    def __init__(
        self,
        arguments: TrainingArguments,
        model: nnx.Module | None = None,
        model_state: TrainState | None = None,
        dataset_train: Any = None,
        dataset_eval: Any = None,
        data_collator: Callable[[list[dict]], dict[str, np.ndarray]] | None = None,
        callbacks: Sequence[Callback] = (),
        eval_bytes_per_token: float | None = None,
        tokenizer: Any = None,
        objective: Objective | None = None,  # what the steps optimise; None: the language-model loss of arguments
    ):
        if not isinstance(arguments, TrainingArguments):
            raise ConfigError(f"arguments must be TrainingArguments, got {type(arguments).__name__}")
        if model is None and model_state is None:
            raise ConfigError("pass model= or model_state= to the trainer")
        if dataset_train is None:
            raise DataError("dataset_train is required")
        self._arguments = arguments
        enable_compilation_cache(arguments.compilation_cache_dir)  # no-op if run_training or the user set one
        self._dataset_train = dataset_train
        self._dataset_eval = dataset_eval
        self.data_collator = data_collator
        self.eval_bytes_per_token = eval_bytes_per_token
        self.tokenizer = tokenizer
        self._given_model = model
        self._given_state = model_state
        self.objective = objective
        self.frozen_models = FrozenModels()  # what frozen models a run reads, recorded once (training/frozen.py)
        self.metrics_logger = MetricsLogger()
        self.nan_guard = NanGuard()
        # order matters: stop rules first, then logging, evaluation, and saving last
        self.callbacks: list[Callback] = [
            TrainingHorizon(), StoppingRules(), self.nan_guard, self.metrics_logger, ProgressBar(),
            PeriodicEvaluation(), CheckpointSaver(), PreviewGeneration(), *callbacks,
        ]
        self.writers = RunWriters(arguments)
        self.recipe: dict[str, Any] | None = None
        self.stop_reason: str | None = None
        self.failed: BaseException | None = None
        self.last_checkpoint: str | None = None
        self.resumed_from: str | None = None
        self.changes_on_resume: list[dict[str, Any]] = []  # what resumes changed (training.resume_allow_changes)
        self.last_eval: tuple[int, dict[str, float]] | None = None
        self.global_step = 0
        self.start_step = 0
        self.start_time = time.perf_counter()
        self.epoch = 0
        self._consumed_data_state: Any = None
        self._run_lock: RunLock | None = None
        self.hold_run_lock()  # one run per output_dir, taken before anything is written there
        try:
            self._configure_all()
        except BaseException:
            self.release_run_lock()
            raise

    def _configure_all(self) -> None:
        """The three ``configure_*`` steps and the init callbacks (the run lock is already held)."""
        self.fire("pre_init")
        data = self.configure_dataloaders()
        self.dataloader_train, self.dataloader_eval = data.dataloader_train, data.dataloader_eval
        self.max_training_steps, self.max_evaluation_steps = data.max_training_steps, data.max_evaluation_steps
        built = self.configure_model()
        self._model, self._model_state = built.model, built.state
        self._optimizer, self._scheduler = built.optimizer, built.scheduler
        if self.objective is None:  # before configure_functions, which a subclass may replace; eval reads it too
            chunk = resolve_chunk_size(self.arguments.loss_chunk_size, self._model.config.vocab_size,
                                       self.arguments.max_length)
            self.objective = LanguageModelObjective(z_loss=self.arguments.z_loss, chunk_size=chunk)
        funcs = self.configure_functions()
        self.sharded_training_step_function = funcs.sharded_training_step_function
        self.sharded_evaluation_step_function = funcs.sharded_evaluation_step_function
        self.checkpoint_manager = funcs.checkpoint_manager
        self.current_state = self._model_state
        self.fire("post_init")

    # ---- protocol properties -----------------------------------------------------
    @property
    def arguments(self) -> TrainingArguments:
        return self._arguments

    @property
    def dataset_train(self) -> Any:
        return self._dataset_train

    @property
    def dataset_eval(self) -> Any:
        return self._dataset_eval

    @property
    def model(self) -> nnx.Module:
        return self._model

    @property
    def model_state(self) -> TrainState:
        return self._model_state

    @property
    def parameter_counts(self) -> tuple[int, int]:
        """``(trainable, total)``: equal for a full fine-tune; with LoRA the adapters and adapters + base,
        the base counted from its config, not its arrays (QLoRA stores it as packed codes and scales)."""
        trainable = self._model_state.num_params
        if self._model_state.frozen is None:
            return trainable, trainable
        return trainable, trainable + self._model.config.num_params

    @property
    def dtype(self) -> Any:
        return self._model.dtype

    @property
    def param_dtype(self) -> Any:
        return self._model.param_dtype

    @property
    def scheduler(self) -> Any:
        return self._scheduler

    @property
    def optimizer(self) -> Any:
        return self._optimizer

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def is_main_process(self) -> bool:
        return jax.process_index() == 0

    @property
    def last_train_metrics(self) -> dict[str, Any]:
        return self.metrics_logger.last_train

    # ---- callbacks -----------------------------------------------------------------
    def add_callback(self, callback: Callback) -> None:
        self.callbacks.append(callback)

    def fire(self, event: str, *args: Any) -> None:
        """Call ``event`` on every callback, in registration order."""
        for cb in self.callbacks:
            getattr(cb, event)(self, *args)

    def request_stop(self, reason: str) -> None:
        """Ask the loop to stop after the current step (first reason wins)."""
        if self.stop_reason is None:
            self.stop_reason = reason

    def fail(self, error: BaseException) -> None:
        """Stop the loop and raise ``error`` from ``train()`` (no final checkpoint)."""
        if self.failed is None:
            self.failed = error
            self.request_stop(str(error))

    def on_step_start(self, state: TrainState, step: int) -> TrainState:
        """The seeds' trainer hook (core contract): override to change the state before step ``step`` runs."""
        return state

    def on_step_end(self, state: TrainState, metrics: dict[str, Any], step: int) -> tuple[TrainState, dict]:
        """The seeds' trainer hook (core contract): override to change the state or metrics after step ``step``."""
        return state, metrics

    # ---- configuration ----------------------------------------------------------------
    def configure_dataloaders(self) -> TrainerConfigureDataloaderOutput:
        """Resolve the step horizon and build the training iterator."""
        args = self.arguments
        self._train_source = as_source_or_rows(self._dataset_train)  # converted once, used everywhere
        rows = len(self._train_source)
        if rows == 0:
            raise DataError("dataset_train is empty")
        self.steps_per_epoch = steps_per_epoch(self._train_source, args.total_batch_size)
        if self.steps_per_epoch == 0:
            raise DataError(f"dataset_train has {rows} rows, fewer than total_batch_size={args.total_batch_size}")
        horizons = [args.max_training_steps] if args.max_training_steps is not None else []
        if args.num_train_epochs is not None:
            horizons.append(args.num_train_epochs * self.steps_per_epoch)
        self.num_epochs = args.num_train_epochs  # None: the step budget alone decides (endless epochs)
        train_iter = self.make_iterator(self._train_source, shuffle=self.arguments.shuffle_train_dataset,
                                        num_epochs=self.num_epochs, drop_remainder=True)
        eval_steps = None
        self._eval_source = None if self._dataset_eval is None else as_source_or_rows(self._dataset_eval)
        if self._eval_source is not None and args.do_eval:
            if len(self._eval_source) == 0:
                raise DataError("dataset_eval is empty")
            eval_steps = steps_per_epoch(self._eval_source, args.total_batch_size, drop_remainder=False)
            if args.max_evaluation_steps:
                eval_steps = min(eval_steps, args.max_evaluation_steps)
        return TrainerConfigureDataloaderOutput(train_iter, self._dataset_eval, min(horizons), eval_steps)

    def make_iterator(self, dataset: Any, *, shuffle: bool, num_epochs: int | None, drop_remainder: bool) -> Any:
        args = self.arguments
        return make_batch_iterator(
            dataset, args.total_batch_size, max_length=args.max_length, seed=args.seed, shuffle=shuffle,
            num_epochs=num_epochs, drop_remainder=drop_remainder, truncation_mode=args.truncation_mode,
            collate_fn=self.data_collator,
        )

    def configure_model(self) -> TrainerConfigureModelOutput:
        """Place the model on its mesh, build schedule and optimizer, create the state."""
        args = self.arguments
        model = self._given_model if self._given_model is not None else self._given_state.model
        model, self._mesh = place_model(model)
        model = with_lora(model, args.lora)
        for name in ("dtype", "param_dtype"):
            want, have = jnp.dtype(getattr(args, name)), jnp.dtype(getattr(model, name))
            if want != have:
                raise ConfigError(
                    f"training.{name} is {want.name} but the model was built with {name}={have.name}; "
                    f"build the model with {name}={want.name!r} or set training.{name}={have.name}")
        positions = getattr(model.config, "max_position_embeddings", None)
        if positions is not None and args.max_length > positions:
            raise ConfigError(
                f"training.max_length={args.max_length} is longer than the model's "
                f"max_position_embeddings={positions}; lower training.max_length or use a model with "
                f"max_position_embeddings >= {args.max_length}")
        scheduler = make_schedule(args, self.max_training_steps)
        optimizer = make_optimizer(args, scheduler, outside_optimizer(model.config, args.lora))
        state = create_train_state(model, optimizer, self._mesh, seed=args.seed)
        if self._given_state is not None:  # its class (a custom state_class), step, RNG and extra fields
            state = adopt_state(self._given_state, state)
        return TrainerConfigureModelOutput(model, state, optimizer, scheduler)

    def configure_functions(self) -> TrainerConfigureFunctionOutput:
        """Jit the train and eval steps with the state's shardings; the state is donated."""
        args, self.batch_sharding = self.arguments, batch_sharding(self.arguments, self._mesh)
        train, evaluate = make_step_functions(
            self._optimizer, state_shardings(self._model_state), self.batch_sharding,
            NamedSharding(self._mesh, PartitionSpec()), self.objective, args.gradient_accumulation_steps,
            log_grad_norms=args.log_grad_norms, log_weight_stats=args.log_weight_stats,
            log_data_fingerprint=args.log_data_fingerprint,
        )
        # measured once here, outside any mesh context (the CPU fallback runs a matmul)
        self._flops_per_token = self._model.config.flops_per_token(args.max_length)
        self._peak_flops = peak_flops_per_device(args.peak_flops_per_device)
        checkpointer = Checkpointer.for_run(args.output_dir, save_total_limit=args.save_total_limit,
                                            keep_best=args.save_best)
        return TrainerConfigureFunctionOutput(train, evaluate, self._mesh, checkpointer)

    # ---- checkpoints --------------------------------------------------------------
    def checkpoint_metadata(self, state: TrainState) -> dict[str, Any]:
        from scaletrain import __version__

        trainable, total = self.parameter_counts
        return {
            "scaletrain_version": __version__,
            "config": self._model.config.to_dict(),
            "arguments": self.arguments.model_dump(mode="json"),
            "recipe": self.recipe,
            "num_params": total,
            "num_trainable_params": trainable,
            "train_rows": len(self._train_source),
            "mesh": dict(self._mesh.shape),
            "lora": self.lora_base_record(state),
            "changes_on_resume": self.changes_on_resume,
            **self.frozen_models.records,
        }

    def lora_base_record(self, state: TrainState) -> dict[str, Any] | None:
        """The frozen base a LoRA run's adapter-only checkpoints need (path, digest; one gather per run)."""
        self._base_record = getattr(self, "_base_record", None) or base_record(self._model, state.frozen)
        return self._base_record

    def save_checkpoint(self, state: TrainState) -> str:
        """Save ``state`` and the data iterator's position (asynchronously)."""
        step = self.global_step
        self.fire("pre_checkpoint", step)
        eval_loss = None
        if self.last_eval is not None and self.last_eval[0] == step:
            eval_loss = self.last_eval[1]["eval_loss"]
        path = self.checkpoint_manager.save(
            step, state, {"train": self.consumed_data_state()}, self.checkpoint_metadata(state), eval_loss=eval_loss,
        )
        self.last_checkpoint = path
        self.fire("post_checkpoint", step, path)
        return path

    def wait_for_checkpoints(self) -> None:
        self.checkpoint_manager.wait()

    def maybe_resume(self, state: TrainState) -> TrainState:
        """Continue where the resume policy (:func:`resume_source`) says, or return ``state`` as is."""
        args = self.arguments
        found = resume_source(self.checkpoint_manager, args.resume_from, args.resume_if_possible)
        if found is None:
            return state
        source, step = found
        state, data_state, meta = source.restore(step, state)
        self.changes_on_resume = check_same_run(meta, self.checkpoint_metadata(state), source.path(step), step,
                                                args.resume_allow_changes)  # base, objective, model; rows
        self.frozen_models.check(meta, source.path(step))  # the same reference (teacher, ...) by its digest
        restore_data_position(self.dataloader_train, source.path(step), data_state)  # required: exact resume
        warn_about_later_checkpoints(self.checkpoint_manager.directory, self.checkpoint_manager.all_steps(), step)
        self.resumed_from = source.path(step)
        logger.info("resumed from %s (step %d)", self.resumed_from, step)
        return state

    def starting_state(self, state: TrainState | None = None, model_parameters: Any = None) -> TrainState:
        """What ``train(model_parameters=, state=)`` starts from (EasyDeL's protocol), placed like the built state.

        ``state`` replaces the state built at init (same class and parameter shapes;
        its optimizer state is kept when its structure matches, as for ``model_state=``);
        ``model_parameters`` (a pure dict like ``state.params``, or an ``nnx.State``)
        then replaces its parameters. The resume policy runs afterwards, as it does
        for ``model_state=``: a checkpoint it picks wins over both.
        """
        built = self._model_state
        if state is None and model_parameters is None:
            return built
        if state is not None:
            if type(state) is not type(built):
                raise ConfigError(f"train(state=...) got a {type(state).__name__}, but this trainer was built for "
                                  f"a {type(built).__name__}; pass that state as model_state= when creating it")
            _check_like(state.params, built.params, "train(state=...).params")
            same_opt = jax.tree.structure(state.opt_state) == jax.tree.structure(built.opt_state)
            state = state.replace(graphdef=built.graphdef, opt_state=state.opt_state if same_opt else built.opt_state)
            state = jax.device_put(state, state_shardings(built))
        state = state if state is not None else built
        if model_parameters is not None:
            if isinstance(model_parameters, nnx.State):
                model_parameters = nnx.to_pure_dict(model_parameters)
            _check_like(model_parameters, built.params, "train(model_parameters=...)")
            params = jax.tree.map(lambda x, b: jax.device_put(jnp.asarray(x, b.dtype), b.sharding),
                                  model_parameters, built.params)
            state = state.replace(params=params)
        return state

    def consumed_data_state(self) -> Any:
        """The training iterator's position after the last batch a step consumed.

        The loop reads one batch ahead (see ``Trainer._loop``), so the iterator itself
        is a batch further on; a checkpoint must record where the *state* is.
        """
        consumed = self._consumed_data_state
        return consumed if consumed is not None else self.dataloader_train.get_state()

    # ---- helpers offered to callbacks (TrainerView) ----------------------------------
    def shard_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Global arrays from this process's rows of the batch, each key split over the batch axes (rank_sharding)."""
        return {k: jax.make_array_from_process_local_data(rank_sharding(self.batch_sharding, np.ndim(v)),
                                                          np.asarray(v)) for k, v in batch.items()}

    def learning_rate_at(self, step: int) -> float:
        return float(self._scheduler(step))

    def throughput(self, tokens: float, seconds: float) -> dict[str, float]:
        return throughput(tokens, seconds, self._flops_per_token, self._peak_flops, jax.device_count())

    def write_metrics(self, record: dict[str, Any]) -> None:
        """Send one record to metrics.jsonl and the other loggers (process 0 only)."""
        if self.is_main_process:
            self.writers.write(record)

    def close(self) -> None:
        self.writers.close()

    def hold_run_lock(self) -> None:
        """Take ``output_dir``'s lock unless this trainer holds it; process 0 only (it speaks for all)."""
        if self._run_lock is None and self.is_main_process:
            self._run_lock = acquire_run_lock(self.arguments.output_dir)

    def release_run_lock(self) -> None:
        """Let go of ``output_dir``'s lock (``train()`` does, however it ends); safe to call twice."""
        lock, self._run_lock = self._run_lock, None
        release_run_lock(lock)


def _check_like(tree: Any, like: Any, what: str) -> None:
    """ConfigError unless ``tree`` has ``like``'s structure and shapes (naming the first difference)."""
    if jax.tree.structure(tree) != jax.tree.structure(like):
        raise ConfigError(f"{what} does not have this model's parameter structure; pass parameters of the "
                          "same architecture (state.params of a TrainState, or nnx.to_pure_dict(nnx.state(model)))")
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree.leaves(like)):
        if tuple(np.shape(x)) != tuple(y.shape):
            raise ConfigError(f"{what}{jax.tree_util.keystr(path)} has shape {tuple(np.shape(x))}, "
                              f"this model's has {tuple(y.shape)}")


def batch_sharding(args: TrainingArguments, mesh: Mesh) -> NamedSharding:
    """The sharding of a global batch (``step_partition_spec``), checked against the mesh and the shapes."""
    spec = PartitionSpec(*args.step_partition_spec)
    problems = batch_problems(args.step_partition_spec, dict(mesh.shape), total_batch_size=args.total_batch_size,
                              max_length=args.max_length)
    if problems:
        raise ConfigError("; ".join(problems))
    return NamedSharding(mesh, spec)
