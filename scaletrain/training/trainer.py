"""``BaseTrainer`` and ``Trainer``: the loop that drives the pure step functions.

The loop fetches a batch, calls the jitted step and dispatches callbacks. It never
blocks on the device except where a callback reads metrics (log steps), so the
host prepares batch ``n+1`` while the device computes step ``n``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from scaletrain.arguments import TrainingArguments
from scaletrain.compile_cache import enable_compilation_cache
from scaletrain.errors import ConfigError, DataError
from scaletrain.models.factory import mesh_for_config
from scaletrain.parallel.partition import axis_names, shardings_for_state
from scaletrain.data.collate import as_source
from scaletrain.data.packing import PackedRows
from scaletrain.data.pipeline import make_batch_iterator, steps_per_epoch
from scaletrain.errors import CheckpointError
from scaletrain.training.callbacks import (
    Callback,
    CheckpointSaver,
    JsonlWriter,
    MetricsLogger,
    PeriodicEvaluation,
    PreviewGeneration,
    ProgressBar,
    StepOutput,
    TrainingHorizon,
)
from scaletrain.training.checkpoint import Checkpointer, resolve_checkpoint
from scaletrain.training.stopping import NanGuard, StoppingRules
from scaletrain.training.loss import LossSums, resolve_chunk_size
from scaletrain.training.metrics import peak_flops_per_device, throughput
from scaletrain.training.optim import make_optimizer, make_schedule, resolved_learning_rate_end
from scaletrain.training.protocol import (
    BaseTrainerProtocol,
    TrainerConfigureDataloaderOutput,
    TrainerConfigureFunctionOutput,
    TrainerConfigureModelOutput,
    TrainerOutput,
)
from scaletrain.training.state import TrainState, create_train_state, params_sha256, state_shardings
from scaletrain.training.steps import make_step_functions

logger = logging.getLogger("scaletrain")


def _mesh_of(model: nnx.Module) -> Mesh | None:
    """The mesh the model's parameters live on, if they carry NamedShardings."""
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def place_model(model: nnx.Module, mesh: Mesh | None = None) -> tuple[nnx.Module, Mesh]:
    """Make sure every parameter is sharded on a mesh by its partition rules.

    A model built by :func:`create_sharded_model` is returned as is; one built
    eagerly on a single device is moved onto the mesh of its config.
    """
    current = _mesh_of(model)
    if current is not None and (mesh is None or mesh == current):
        return model, current
    mesh = mesh or mesh_for_config(model.config)
    graphdef, state = nnx.split(model)
    shardings = shardings_for_state(state, model.config.partition_axis, mesh)
    params = jax.device_put(nnx.to_pure_dict(state), shardings)
    return nnx.merge(graphdef, params), mesh


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
        self.metrics_logger = MetricsLogger()
        self.nan_guard = NanGuard()
        # order matters: stop rules first, then logging, evaluation, and saving last
        self.callbacks: list[Callback] = [
            TrainingHorizon(), StoppingRules(), self.nan_guard, self.metrics_logger, ProgressBar(),
            PeriodicEvaluation(), CheckpointSaver(), PreviewGeneration(), *callbacks,
        ]
        self.recipe: dict[str, Any] | None = None
        self.stop_reason: str | None = None
        self.failed: BaseException | None = None
        self.last_checkpoint: str | None = None
        self.resumed_from: str | None = None
        self.last_eval: tuple[int, dict[str, float]] | None = None
        self.global_step = 0
        self.start_step = 0
        self.start_time = time.perf_counter()
        self.epoch = 0
        self._writers: list[Any] = []
        self.fire("pre_init")
        data = self.configure_dataloaders()
        self.dataloader_train, self.dataloader_eval = data.dataloader_train, data.dataloader_eval
        self.max_training_steps, self.max_evaluation_steps = data.max_training_steps, data.max_evaluation_steps
        built = self.configure_model()
        self._model, self._model_state = built.model, built.state
        self._optimizer, self._scheduler = built.optimizer, built.scheduler
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
        """Seed hook: override to change the state before step ``step`` runs."""
        return state

    def on_step_end(self, state: TrainState, metrics: dict[str, Any], step: int) -> tuple[TrainState, dict]:
        """Seed hook: override to change the state or metrics after step ``step``."""
        return state, metrics

    # ---- configuration ----------------------------------------------------------------
    def configure_dataloaders(self) -> TrainerConfigureDataloaderOutput:
        """Resolve the step horizon and build the training iterator."""
        args = self.arguments
        rows = len(as_source_or_rows(self._dataset_train))
        if rows == 0:
            raise DataError("dataset_train is empty")
        per_epoch = steps_per_epoch(as_source_or_rows(self._dataset_train), args.total_batch_size)
        if per_epoch == 0:
            raise DataError(
                f"dataset_train has {len(as_source_or_rows(self._dataset_train))} rows, fewer than "
                f"total_batch_size={args.total_batch_size}"
            )
        self.steps_per_epoch = per_epoch
        horizons = []
        if args.num_train_epochs is not None:
            horizons.append(args.num_train_epochs * per_epoch)
        if args.max_training_steps is not None:
            horizons.append(args.max_training_steps)
        max_steps = min(horizons)
        epochs = None if args.max_training_steps is not None and args.num_train_epochs is None else args.num_train_epochs
        self.num_epochs = epochs
        train_iter = self.make_iterator(self._dataset_train, shuffle=True, num_epochs=epochs, drop_remainder=True)
        if self._dataset_eval is not None and args.do_eval:
            eval_rows = len(as_source_or_rows(self._dataset_eval))
            if eval_rows == 0:
                raise DataError("dataset_eval is empty")
            eval_steps = math.ceil(eval_rows / args.total_batch_size)
            if args.max_evaluation_steps:
                eval_steps = min(eval_steps, args.max_evaluation_steps)
        else:
            eval_steps = None
        return TrainerConfigureDataloaderOutput(train_iter, self._dataset_eval, max_steps, eval_steps)

    def make_iterator(self, dataset: Any, *, shuffle: bool, num_epochs: int | None,
                      drop_remainder: bool) -> Any:
        args = self.arguments
        return make_batch_iterator(
            dataset,
            args.total_batch_size,
            max_length=args.max_length,
            seed=args.seed,
            shuffle=shuffle,
            num_epochs=num_epochs,
            drop_remainder=drop_remainder,
            truncation_mode=args.truncation_mode,
            collate_fn=self.data_collator,
        )

    def configure_model(self) -> TrainerConfigureModelOutput:
        """Place the model on its mesh, build schedule and optimizer, create the state."""
        args = self.arguments
        model = self._given_model if self._given_model is not None else self._given_state.model
        model, self._mesh = place_model(model)
        for name in ("dtype", "param_dtype"):
            want, have = jnp.dtype(getattr(args, name)), jnp.dtype(getattr(model, name))
            if want != have:
                raise ConfigError(
                    f"training.{name} is {want.name} but the model was built with {name}={have.name}; "
                    f"build the model with {name}={want.name!r} or set training.{name}={have.name}"
                )
        scheduler = make_schedule(args, self.max_training_steps)
        optimizer = make_optimizer(args, scheduler)
        state = create_train_state(model, optimizer, self._mesh, seed=args.seed)
        given = self._given_state
        if given is not None:
            same_opt = jax.tree.structure(given.opt_state) == jax.tree.structure(state.opt_state)
            state = state.replace(
                step=given.step,
                opt_state=given.opt_state if same_opt else state.opt_state,
                rng=given.rng,
            )
        return TrainerConfigureModelOutput(model, state, optimizer, scheduler)

    def configure_functions(self) -> TrainerConfigureFunctionOutput:
        """Jit the train and eval steps with the state's shardings; the state is donated."""
        args = self.arguments
        mesh = self._mesh
        spec = PartitionSpec(*args.step_partition_spec)
        for axes in args.step_partition_spec:
            for a in axis_names(axes):
                if a not in mesh.shape:
                    raise ConfigError(f"training.step_partition_spec names mesh axis {a!r}; the mesh has {list(mesh.shape)}")
        batch_shards = math.prod(mesh.shape[a] for a in axis_names(spec[0]))
        if args.total_batch_size % batch_shards:
            raise ConfigError(
                f"training.total_batch_size={args.total_batch_size} must be divisible by the batch mesh "
                f"axes {spec[0]} (size {batch_shards})"
            )
        if len(spec) > 1 and args.max_length % math.prod(mesh.shape[a] for a in axis_names(spec[1])):
            raise ConfigError(f"training.max_length={args.max_length} must be divisible by the sequence axes {spec[1]}")
        self.batch_sharding = NamedSharding(mesh, spec)
        replicated = NamedSharding(mesh, PartitionSpec())
        train, evaluate = make_step_functions(
            self._optimizer,
            state_shardings(self._model_state),
            self.batch_sharding,
            replicated,
            args.gradient_accumulation_steps,
            args.z_loss,
            log_grad_norms=args.log_grad_norms,
            log_weight_stats=args.log_weight_stats,
            loss_chunk_size=resolve_chunk_size(args.loss_chunk_size, self._model.config.vocab_size, args.max_length),
        )
        # measured once here, outside any mesh context (the CPU fallback runs a matmul)
        self._flops_per_token = self._model.config.flops_per_token(args.max_length)
        self._peak_flops = peak_flops_per_device(args.peak_flops_per_device)
        checkpointer = Checkpointer.for_run(args.output_dir, save_total_limit=args.save_total_limit,
                                            keep_best=args.save_best)
        return TrainerConfigureFunctionOutput(train, evaluate, mesh, checkpointer)

    # ---- checkpoints --------------------------------------------------------------
    def checkpoint_metadata(self, state: TrainState) -> dict[str, Any]:
        from scaletrain import __version__

        return {
            "scaletrain_version": __version__,
            "config": self._model.config.to_dict(),
            "arguments": self.arguments.model_dump(mode="json"),
            "recipe": self.recipe,
            "num_params": self._model_state.num_params,
            "train_rows": len(as_source_or_rows(self._dataset_train)),
            "mesh": dict(self._mesh.shape),
        }

    def save_checkpoint(self, state: TrainState) -> str:
        """Save ``state`` and the data iterator's position (asynchronously)."""
        step = self.global_step
        self.fire("pre_checkpoint", step)
        eval_loss = None
        if self.last_eval is not None and self.last_eval[0] == step:
            eval_loss = self.last_eval[1]["eval_loss"]
        path = self.checkpoint_manager.save(
            step, state, {"train": self.consumed_data_state()}, self.checkpoint_metadata(state),
            eval_loss=eval_loss,
        )
        self.last_checkpoint = path
        self.fire("post_checkpoint", step, path)
        return path

    def maybe_resume(self, state: TrainState) -> TrainState:
        """Continue from ``resume_from`` or, with ``resume_if_possible``, the newest checkpoint.

        A run never starts fresh on top of another run's checkpoints: if
        ``output_dir`` already holds some and resuming is off, that is an error.
        """
        args = self.arguments
        own = self.checkpoint_manager
        if args.resume_from:
            directory, step = resolve_checkpoint(args.resume_from)
            source = own if os.path.abspath(directory) == own.directory else Checkpointer(directory)
        elif args.resume_if_possible and own.latest_step() is not None:
            source, step = own, own.latest_step()
        else:
            if own.all_steps():
                raise CheckpointError(
                    f"{own.directory} already holds checkpoints {own.all_steps()}; set "
                    "training.resume_if_possible=true to continue that run, or choose a new training.output_dir"
                )
            return state
        state, data_state, meta = source.restore(step, state)
        if "train" in data_state:
            self.dataloader_train.set_state(data_state["train"])
        if meta.get("train_rows") not in (None, len(as_source_or_rows(self._dataset_train))):
            logger.warning("resuming with a different training set (%s rows, checkpoint had %s): the data "
                           "order will not match the original run", len(as_source_or_rows(self._dataset_train)),
                           meta.get("train_rows"))
        self.resumed_from = source.path(step)
        logger.info("resumed from %s (step %d)", self.resumed_from, step)
        return state

    def consumed_data_state(self) -> Any:
        """The training iterator's position after the last batch a step consumed.

        The loop reads one batch ahead (see ``Trainer._loop``), so the iterator itself
        is a batch further on; a checkpoint must record where the *state* is.
        """
        consumed = getattr(self, "_consumed_data_state", None)
        return consumed if consumed is not None else self.dataloader_train.get_state()

    # ---- helpers used by callbacks ---------------------------------------------------
    def shard_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Assemble global arrays from this process's rows of the batch."""
        return {
            k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(v))
            for k, v in batch.items()
        }

    def learning_rate_at(self, step: int) -> float:
        return float(self._scheduler(step))

    def throughput(self, tokens: float, seconds: float) -> dict[str, float]:
        return throughput(tokens, seconds, self._flops_per_token, self._peak_flops, jax.device_count())

    def write_metrics(self, record: dict[str, Any]) -> None:
        """Send one record to metrics.jsonl and the other loggers (process 0 only)."""
        if not self.is_main_process:
            return
        for w in self._open_writers():
            w.write(record)

    def _open_writers(self) -> list[Any]:
        if not self._writers:
            from scaletrain.training.loggers import TensorBoardWriter, WandbWriter

            a = self.arguments
            out = a.ensure_output_dir()
            self._writers.append(JsonlWriter(os.path.join(out, "metrics.jsonl")))
            if "tensorboard" in a.report_to:
                self._writers.append(TensorBoardWriter(out))
            if "wandb" in a.report_to:
                self._writers.append(WandbWriter(out, a.wandb_project, a.model_dump(mode="json")))
        return self._writers

    def close(self) -> None:
        for w in self._writers:
            w.close()
        self._writers = []


def as_source_or_rows(dataset: Any) -> Any:
    """Packed rows as they are, any other dataset as a random-access source."""
    return dataset if isinstance(dataset, PackedRows) else as_source(dataset)


class Trainer(BaseTrainer):
    """Causal-LM trainer: ``train()``, ``evaluate()``, ``eval()`` and ``save_pretrained()``."""

    def train(self) -> TrainerOutput:
        args = self.arguments
        state = self.maybe_resume(self._model_state)
        self.global_step = self.start_step = int(jax.device_get(state.step))
        self.current_state = state
        self.start_time = time.perf_counter()
        self.print_plan()
        self.fire("pre_train", state)
        try:
            state = self._loop(state)
        except BaseException:
            self._teardown(state)
            raise
        self._model_state = self.current_state = state
        if self.failed is not None:
            self._teardown(state)
            raise self.failed
        if args.save_at_end:
            self.save_checkpoint(state)
        reached_horizon = self.global_step >= self.max_training_steps
        if reached_horizon and args.do_eval and self._dataset_eval is not None:
            if self.last_eval is None or self.last_eval[0] != self.global_step:
                results = self.evaluate(state)
                self.checkpoint_manager.record_eval(self.global_step, results["eval_loss"])
        self._teardown(state)
        self.write_summary(state)
        logger.info("stopped: %s", self.stop_reason)
        return TrainerOutput(
            state=state,
            mesh=self._mesh,
            checkpoint_path=self.last_checkpoint,
            last_save_file_name=None if self.last_checkpoint is None else os.path.basename(self.last_checkpoint),
        )

    def _fetch_batch(self) -> tuple[dict[str, jax.Array], Any] | None:
        """The next batch, already placed on the devices, and the iterator state after it."""
        try:
            batch = next(self.dataloader_train)
        except StopIteration:
            return None
        return self.shard_batch(batch), self.dataloader_train.get_state()

    def _loop(self, state: TrainState) -> TrainState:
        """Step until a stop condition; batch ``n+1`` is fetched and transferred while step ``n`` runs.

        The step is dispatched asynchronously, so reading and placing the next batch
        right after the dispatch overlaps it with the device's work, and a callback
        that syncs on step ``n`` (a log step) finds step ``n+1``'s input already there.
        """
        epoch = None
        self._consumed_data_state = None
        with jax.set_mesh(self._mesh):
            ahead = self._fetch_batch() if self.global_step < self.max_training_steps else None
            while self.stop_reason is None and self.global_step < self.max_training_steps:
                self.epoch = self.global_step // self.steps_per_epoch
                if self.epoch != epoch:
                    if epoch is not None:
                        self.fire("post_epoch", epoch)
                    epoch = self.epoch
                    self.fire("pre_epoch", epoch)
                if ahead is None:
                    self.request_stop(f"the training data ran out after step {self.global_step}")
                    break
                batch, data_state = ahead
                step = self.global_step + 1
                self.fire("pre_step", step)
                state = self.on_step_start(state, step)
                state, metrics = self.sharded_training_step_function(state, batch)
                self._consumed_data_state = data_state
                ahead = self._fetch_batch() if step < self.max_training_steps else None
                state, metrics = self.on_step_end(state, metrics, step)
                self.global_step = step
                self.current_state = state
                self.fire("post_step", step, StepOutput(metrics))
            if epoch is not None:
                self.fire("post_epoch", epoch)
        if self.stop_reason is None:
            self.request_stop(f"reached the training horizon of {self.max_training_steps} steps")
        return state

    def _teardown(self, state: TrainState) -> None:
        """Finish pending checkpoint writes and close loggers, whatever ended the run."""
        try:
            self.fire("post_train", state)
        finally:
            self.checkpoint_manager.wait()
            self.close()

    # ---- evaluation -----------------------------------------------------------------
    def _eval_batches(self) -> Iterator[dict[str, jax.Array]]:
        it = self.make_iterator(self._dataset_eval, shuffle=False, num_epochs=1, drop_remainder=False)
        for i, batch in enumerate(it):
            if self.max_evaluation_steps is not None and i >= self.max_evaluation_steps:
                break
            yield self.shard_batch(batch)

    def eval(self, model_state: TrainState | None = None) -> Iterator[dict[str, float]]:
        """Yield running evaluation metrics after every eval batch (seed 002)."""
        state = model_state if model_state is not None else self.current_state
        total = LossSums(*(0.0 for _ in LossSums._fields))
        with jax.set_mesh(self._mesh):
            for i, batch in enumerate(self._eval_batches(), start=1):
                sums = jax.device_get(self.sharded_evaluation_step_function(state, batch))
                total = LossSums(*(float(a) + float(b) for a, b in zip(total, sums)))
                yield {"eval_step": i, **self._eval_summary(total)}

    def evaluate(self, state: TrainState | None = None, metric_calculator: Callable | None = None) -> dict[str, float]:
        """Full evaluation; returns ``eval_loss``, ``eval_accuracy``, ``eval_perplexity`` (and bits/byte)."""
        if self._dataset_eval is None:
            raise DataError("evaluate() needs dataset_eval")
        state = state if state is not None else self.current_state
        self.fire("pre_evaluate", self.global_step)
        acc: Any = None
        with jax.set_mesh(self._mesh):
            for batch in self._eval_batches():
                sums = self.sharded_evaluation_step_function(state, batch)
                acc = sums if acc is None else jax.tree.map(jnp.add, acc, sums)
        total = LossSums(*(float(x) for x in jax.device_get(acc)))
        results = self._eval_summary(total)
        if metric_calculator is not None:
            results.update(metric_calculator(state, results))
        self.last_eval = (self.global_step, results)
        self.fire("post_evaluate", self.global_step, results)
        return results

    def _eval_summary(self, total: LossSums) -> dict[str, float]:
        n = max(total.tokens, 1.0)
        loss = total.loss / n
        out = {
            "eval_loss": loss,
            "eval_accuracy": total.correct / n,
            "eval_perplexity": math.exp(min(loss, 50.0)),
            "eval_tokens": total.tokens,
        }
        if self.eval_bytes_per_token:
            out["eval_bits_per_byte"] = loss / math.log(2) / self.eval_bytes_per_token
        return out

    # ---- outputs ---------------------------------------------------------------------
    def save_pretrained(self, ckpt_path: str, state: TrainState | None = None) -> str:
        """Write a Hugging Face folder (config.json + safetensors) for ``state``."""
        from scaletrain.models.hf import save_hf_checkpoint

        state = state if state is not None else self.current_state
        return save_hf_checkpoint(state.model, ckpt_path, tokenizer=self.tokenizer)

    def print_plan(self) -> None:
        """Log the resolved run plan: nothing that shapes the schedule stays hidden."""
        if not self.is_main_process:
            return
        a = self.arguments
        cfg = self._model.config
        tokens = self.max_training_steps * a.total_batch_size * a.max_length
        lines = [
            f"output_dir      {os.path.abspath(a.output_dir)}",
            f"model           {cfg.model_type}: {self._model_state.num_params / 1e6:.2f}M parameters, "
            f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}",
            f"precision       params {jnp.dtype(self.param_dtype).name}, compute {jnp.dtype(self.dtype).name}, "
            f"softmax/loss float32",
            f"mesh            {dict(self._mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} "
            f"device(s), {jax.process_count()} process(es)",
            f"steps           {self.start_step} -> {self.max_training_steps} "
            f"({self.steps_per_epoch} per epoch, epochs={self.num_epochs}, "
            f"max_training_steps={a.max_training_steps})",
            f"batch           {a.total_batch_size} x {a.max_length} tokens "
            f"({a.gradient_accumulation_steps} micro-batches), {tokens / 1e6:.2f}M tokens in all",
            f"schedule        {a.optimizer}, {a.scheduler} lr {a.learning_rate:g} -> "
            f"{resolved_learning_rate_end(a):g}, warmup {a.warmup_steps}, clip {a.clip_grad}, "
            f"weight decay {a.weight_decay}",
        ]
        logger.info("run plan\n  " + "\n  ".join(lines))

    def write_summary(self, state: TrainState) -> dict[str, Any]:
        """``summary.json``: final losses, steady throughput, MFU and the parameter digest."""
        last_train = self.metrics_logger.last_train
        last_eval = self.metrics_logger.last_eval
        steady = self.metrics_logger.steady_throughput()
        summary = {
            "final_step": self.global_step,
            "stop_reason": self.stop_reason,
            "final_train_loss": last_train.get("loss"),
            "final_eval_loss": last_eval.get("eval_loss"),
            "final_eval_accuracy": last_eval.get("eval_accuracy"),
            "final_eval_bits_per_byte": last_eval.get("eval_bits_per_byte"),
            "tokens_per_s": steady.get("tokens_per_s", last_train.get("tokens_per_s")),
            "tflops": steady.get("tflops", last_train.get("tflops")),
            "mfu": steady.get("mfu", last_train.get("mfu")),
            "max_training_steps": self.max_training_steps,
            "train_tokens": self.global_step * self.arguments.total_batch_size * self.arguments.max_length,
            "flops_per_token": self._flops_per_token,
            "num_params": self._model_state.num_params,
            "process_count": jax.process_count(),
            "params_sha256": params_sha256(state.params),  # all processes: the gather is a collective
            "elapsed_s": time.perf_counter() - self.start_time,
            "checkpoint": self.last_checkpoint,
            "resumed_from": self.resumed_from,
            "skipped_nonfinite_steps": self.nan_guard.skipped_count(),
        }
        if self.is_main_process:
            path = os.path.join(self.arguments.ensure_output_dir(), "summary.json")
            with open(path + ".tmp", "w") as f:
                json.dump(summary, f, indent=2, sort_keys=True)
            os.replace(path + ".tmp", path)
        self.summary = summary
        return summary
