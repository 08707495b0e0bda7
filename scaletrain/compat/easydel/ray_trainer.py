"""``RayDistributedTrainer``: EasyDeL's RayDistributedTrainer API, building models by ``scaling_index``.

The class keeps EasyDeL's contract (names, defaults, ``train()``'s priority order,
the JSON config) and fixes what EasyDeL's left undone:

- the config round-trips exactly (tagged JSON, :mod:`scaletrain.compat.easydel.codec`);
- ``bucket_path`` really loads a checkpoint (ours or a Hugging Face folder), from a
  local folder or an fsspec URL;
- :meth:`RayDistributedTrainer.launch` really runs on Ray: N JAX processes under Ray
  Train, one mesh over all of them, restarts from the last checkpoint when a worker
  dies (:mod:`scaletrain.launch.ray.launcher`).

This module is the façade: EasyDeL's methods, each a few lines. The defaults, the
resolution rules and the saved JSON live in :mod:`scaletrain.compat.easydel.ray_config`;
loading a Hugging Face folder or checkpoint in :mod:`scaletrain.compat.easydel.loading`.

Example (runs in the test suite; a tiny model from the bundled tokenizer)::

    >>> import jax.numpy as jnp
    >>> from scaletrain.data import bundled_tokenizer_path
    >>> from scaletrain import RayDistributedTrainer
    >>> from scaletrain.models import LlamaForCausalLM
    >>> trainer = RayDistributedTrainer(
    ...     pretrained_model_name_or_path=bundled_tokenizer_path(),
    ...     model_class=LlamaForCausalLM,
    ...     config_scaling_variables={"hidden_size": 16, "intermediate_size": 32,
    ...                               "num_attention_heads": 2, "num_key_value_heads": 1},
    ...     config_variables={"dtype": jnp.float32, "param_dtype": jnp.float32,
    ...                       "num_hidden_layers": 2, "vocab_size": 512,
    ...                       "max_position_embeddings": 64},
    ... )
    >>> trainer.create_config(scaling_index=2).hidden_size
    32
    >>> model = trainer.create_model_from_config(scaling_index=1)
    >>> trainer.convert_model_to_state(model).num_params
    21072
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from scaletrain.compat.easydel import ray_config
from scaletrain.compat.easydel.loading import load_bucket_model, load_hf_model
from scaletrain.compat.easydel.enums import TaskType
from scaletrain.compat.easydel.ray_config import MODULE_KEYS, RayDistributedConfig, require, resolve_model_class
from scaletrain.errors import ConfigError
from scaletrain.models.registry import get_modules_by_type
from scaletrain.remote_storage import check_storage

if TYPE_CHECKING:  # pragma: no cover
    from flax import nnx

    from scaletrain.arguments import TrainingArguments
    from scaletrain.launch.ray.launcher import LaunchResult
    from scaletrain.training.protocol import TrainerOutput
    from scaletrain.training.state import TrainState

logger = logging.getLogger("scaletrain")


class RayDistributedTrainer:
    """Builds models scaled by ``scaling_index`` and trains them, in one process or on Ray.

    ``CONFIG_SCALING_VARIABLES`` are multiplied by the scaling index,
    ``CONFIG_VARIABLES`` are passed as they are (both: EasyDeL's defaults; pass
    ``config_scaling_variables`` / ``config_variables`` to change or add keys, e.g.
    ``num_hidden_layers`` and ``vocab_size``, which otherwise take the config
    class's defaults). ``dtype``, ``param_dtype`` and ``precision`` go to the module,
    everything else to the model config.
    """

    model_task: TaskType
    model_type: str
    model_class: type
    state_class: type
    offload_backend: str
    trainer_module: type

    CONFIG_SCALING_VARIABLES: ClassVar[dict[str, int]] = ray_config.CONFIG_SCALING_VARIABLES
    CONFIG_VARIABLES: ClassVar[dict[str, Any]] = ray_config.CONFIG_VARIABLES
    # a class with ``from_pretrained(path, ...)``; None = scaletrain's offline loader (pad falls back to eos)
    _processor_loader_class: ClassVar[type | None] = None

    def __init__(
        self,
        pretrained_model_name_or_path: str,
        bucket_path: str | None = None,
        model_task: TaskType | str | None = None,
        model_type: str | None = None,
        model_class: type | None = None,
        state_class: type | None = None,
        offload_backend: str | None = None,
        trainer_module: type | None = None,
        config_scaling_variables: dict[str, int] | None = None,
        config_variables: dict[str, Any] | None = None,
    ):
        """Resolve the model class from ``model_class`` or ``(model_type, model_task)``.

        Rules (EasyDeL's, :func:`~scaletrain.compat.easydel.ray_config.resolve_model_class`):
        give ``model_class``, or both ``model_type`` and ``model_task``; with all three,
        the class wins and type/task are read from it. ``bucket_path`` is a local
        folder or fsspec URL of a checkpoint to start from; its protocol is checked here.
        """
        from scaletrain.training.state import TrainState
        from scaletrain.training.trainer import Trainer

        self.pretrained_model_name_or_path = pretrained_model_name_or_path
        self.model_class, model_type, model_task = resolve_model_class(model_class, model_type, model_task)
        self.config_scaling_variables = copy.deepcopy(self.CONFIG_SCALING_VARIABLES)
        self.config_variables = copy.deepcopy(self.CONFIG_VARIABLES)
        if config_scaling_variables is not None:
            self.config_scaling_variables.update(config_scaling_variables)
        if config_variables is not None:
            self.config_variables.update(config_variables)
        if bucket_path is not None:
            check_storage(bucket_path, "bucket_path")
        self.bucket_path = bucket_path
        self.model_task = model_task
        self.model_type = model_type
        self.offload_backend = offload_backend if offload_backend is not None else "cpu"
        self.state_class = state_class if state_class is not None else TrainState
        self.trainer_module = trainer_module if trainer_module is not None else Trainer

    # ---- persistence --------------------------------------------------------------
    @classmethod
    def from_config(
        cls,
        path: str | os.PathLike,
        model_class: type | None = None,
        state_class: type | None = None,
        trainer_module: type | None = None,
    ) -> RayDistributedTrainer:
        """A trainer from a JSON file written by :meth:`save_config` (local path or fsspec URL)."""
        cfg = RayDistributedConfig.read(path)
        return cls(
            pretrained_model_name_or_path=cfg.pretrained_model_name_or_path,
            bucket_path=cfg.bucket_path,
            model_task=cfg.model_task,
            model_type=cfg.model_type,
            config_scaling_variables=cfg.config_scaling_variables,
            config_variables=cfg.config_variables,
            offload_backend=cfg.offload_backend,
            trainer_module=trainer_module,
            state_class=state_class,
            model_class=model_class,
        )

    def save_config(self, path: str | os.PathLike) -> None:
        """Write the configuration as JSON (this trainer's own dicts are left untouched)."""
        RayDistributedConfig(
            pretrained_model_name_or_path=self.pretrained_model_name_or_path,
            model_task=self.model_task,
            model_type=self.model_type,
            offload_backend=self.offload_backend,
            config_scaling_variables=copy.deepcopy(self.config_scaling_variables),
            config_variables=dict(self.config_variables),
            bucket_path=self.bucket_path,
        ).write(path)

    # ---- tokenizer and data ---------------------------------------------------------
    def load_processor(self) -> Any:
        """The tokenizer in ``pretrained_model_name_or_path`` (local only, no remote code).

        A tokenizer without a pad token pads with eos (logged as a warning).
        """
        loader = self._processor_loader_class
        if loader is None:
            from scaletrain.data.tokenizer import load_processor

            return load_processor(self.pretrained_model_name_or_path)
        tokenizer = loader.from_pretrained(self.pretrained_model_name_or_path, local_files_only=True,
                                           trust_remote_code=False)
        if getattr(tokenizer, "pad_token_id", None) is None and getattr(tokenizer, "eos_token_id", None) is not None:
            logger.warning("Tokenizer has no pad_token. Falling back to eos_token for padding.")
            tokenizer.pad_token_id = tokenizer.eos_token_id
        return tokenizer

    @cached_property
    def processor(self) -> Any:
        """The tokenizer, loaded once."""
        return self.load_processor()

    @staticmethod
    def extract_column_names(dataset: Any) -> list[str] | None:
        """Column names of a dataset (``column_names``, else the first example's keys)."""
        from scaletrain.compat.easydel.processing import extract_column_names

        return extract_column_names(dataset)

    def process_sample_data(self, sample: Any, max_length: int, padding_side: str = "left") -> dict[str, np.ndarray]:
        """Tokenize one text, padded and truncated to ``max_length``; arrays flattened to 1-D."""
        from scaletrain.compat.easydel.processing import process_sample_data

        return process_sample_data(self.processor, sample, max_length, padding_side)  # type: ignore[arg-type]

    def process_messages_data(self, messages: Any, max_length: int,
                              padding_side: str = "left") -> dict[str, np.ndarray]:
        """Apply the tokenizer's chat template to ``messages``, padded to ``max_length``; arrays flattened."""
        from scaletrain.compat.easydel.processing import process_messages_data

        return process_messages_data(self.processor, messages, max_length, padding_side)  # type: ignore[arg-type]

    # ---- models -------------------------------------------------------------------
    def create_config(self, scaling_index: int) -> Any:
        """The model config: scaling variables times ``scaling_index``, plus the fixed variables."""
        if not isinstance(scaling_index, int) or isinstance(scaling_index, bool) or scaling_index < 1:
            raise ConfigError(f"scaling_index must be a positive int, got {scaling_index!r}")
        scaled = {k: v * scaling_index for k, v in copy.deepcopy(self.config_scaling_variables).items()}
        kwargs = {**{k: v for k, v in self.config_variables.items() if k not in MODULE_KEYS}, **scaled}
        config_class = getattr(self.model_class, "config_class", None)
        if config_class is None:
            config_class, _ = get_modules_by_type(model_type=self.model_type, task_type=self.model_task)
        try:
            return config_class(**kwargs)
        except ValueError as err:  # pydantic's ValidationError is a ValueError
            raise ConfigError(f"model config at scaling_index={scaling_index} is invalid: {err}") from None

    def _get_offload_device(self) -> jax.Device:
        """A local device of ``offload_backend`` (else the first global one)."""
        try:
            devices = jax.local_devices(backend=self.offload_backend)
            if devices:
                return devices[0]
        except RuntimeError:
            pass
        return jax.devices(self.offload_backend)[0]

    def create_model(
        self,
        config: Any,
        dtype: Any = jnp.bfloat16,
        param_dtype: Any = jnp.bfloat16,
        precision: Any = None,
        seed: int = 684,
        lazy: bool = False,
    ) -> nnx.Module:
        """A model for ``config``: sharded on its mesh, or abstract (``nnx.eval_shape``) when ``lazy``."""
        from scaletrain.models.factory import abstract_model, create_sharded_model

        if precision is None:
            precision = jax.lax.Precision.DEFAULT
        if lazy:
            return abstract_model(self.model_class, config, dtype=dtype, param_dtype=param_dtype,
                                  precision=precision, seed=seed)
        model, _ = create_sharded_model(self.model_class, config, dtype=dtype, param_dtype=param_dtype,
                                        precision=precision, seed=seed)
        return model

    def convert_model_to_state(self, model: nnx.Module) -> TrainState:
        """A train state at step 0 holding ``model``'s parameters (no optimizer state yet).

        The trainer creates the optimizer state with the right shardings; the
        parameters keep the placement they have.
        """
        from flax import nnx
        from jax.sharding import NamedSharding, PartitionSpec

        graphdef, variables = nnx.split(model)
        params = nnx.to_pure_dict(variables)
        leaves = jax.tree.leaves(params)
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
            raise ConfigError("convert_model_to_state got an abstract (lazy) model; create it with lazy=False")
        sharding = getattr(leaves[0], "sharding", None) if leaves else None
        step = jnp.zeros((), jnp.int32)
        rng = jax.random.key_data(jax.random.key(int(self.config_variables.get("seed", 0))))
        if isinstance(sharding, NamedSharding):
            replicated = NamedSharding(sharding.mesh, PartitionSpec())
            step, rng = jax.device_put(step, replicated), jax.device_put(rng, replicated)
        return self.state_class(step=step, params=params, opt_state=(), rng=rng, graphdef=graphdef)

    def create_model_from_config(self, scaling_index: int) -> nnx.Module:
        """A new model at ``scaling_index`` with the dtypes, precision and seed of ``config_variables``."""
        return self.create_model(
            config=self.create_config(scaling_index=scaling_index),
            dtype=self.config_variables["dtype"],
            param_dtype=self.config_variables["param_dtype"],
            precision=self.config_variables["precision"],
            seed=self.config_variables["seed"],
        )

    def create_model_from_pretrained(self) -> nnx.Module:
        """The Hugging Face model in ``pretrained_model_name_or_path`` with this trainer's runtime keys."""
        return load_hf_model(self.pretrained_model_name_or_path, self.config_variables)

    def load_bucket_model(self, cache_dir: str) -> nnx.Module:
        """The model saved at ``bucket_path``: a Hugging Face folder or a scaletrain run/checkpoint.

        Remote URLs are copied into ``cache_dir`` first. Mesh, partition axis, remat and
        attention options come from ``config_variables``; weights and architecture from
        the checkpoint (:mod:`scaletrain.compat.easydel.loading`).
        """
        if self.bucket_path is None:
            raise ConfigError("load_bucket_model needs bucket_path")
        return load_bucket_model(self.bucket_path, cache_dir, self.config_variables)

    # ---- training -----------------------------------------------------------------
    def create_trainer(
        self,
        arguments: TrainingArguments,
        dataset_train: Any,
        dataset_eval: Any = None,
        data_collator: Callable | None = None,
        state: TrainState | None = None,
        **trainer_kwargs: Any,
    ) -> Any:
        """``trainer_module(...)`` for ``state``; extra keywords (``callbacks``, ``tokenizer``) pass through."""
        return self.trainer_module(
            arguments=arguments,
            dataset_train=dataset_train,
            dataset_eval=dataset_eval,
            data_collator=data_collator,
            model_state=state,
            **trainer_kwargs,
        )

    def train(
        self,
        scaling_index: int,
        arguments: TrainingArguments,
        dataset_train: Any,
        dataset_eval: Any = None,
        data_collator: Callable | None = None,
        model: nnx.Module | None = None,
        state: TrainState | None = None,
        **trainer_kwargs: Any,
    ) -> TrainerOutput:
        """Train in this process (or in each process of :meth:`launch`).

        The starting point, first match wins: ``state``; ``model``; the checkpoint
        at ``bucket_path``; a new model at ``scaling_index``. Resuming an
        interrupted run is the trainer's job (``arguments.resume_if_possible``).
        Unless ``arguments`` set ``dtype``/``param_dtype`` explicitly, they follow
        the model's (a conflict set explicitly is an error).
        """
        if state is None and model is None:
            if self.bucket_path is not None:
                model = self.load_bucket_model(os.path.join(arguments.output_dir, "bucket_cache"))
            else:
                logger.info("No model/state/checkpoint. Creating a new model (scaling_index=%d).", scaling_index)
                self._require_trainable_class()
                model = self.create_model_from_config(scaling_index=scaling_index)
        if state is None and model is not None:
            state = self.convert_model_to_state(model)
        require(state is not None, "Unable to obtain a valid model state.")
        arguments = align_dtypes(arguments, state)
        return self.create_trainer(
            arguments=arguments,
            dataset_train=dataset_train,
            dataset_eval=dataset_eval,
            data_collator=data_collator,
            state=state,
            **trainer_kwargs,
        ).train()

    def _require_trainable_class(self) -> None:
        """The trainer trains language models: a base module (no head) is refused by name before it is built."""
        if self.model_task in (TaskType.BASE_MODULE, TaskType.SEQUENCE_CLASSIFICATION):
            raise ConfigError(
                f"model_class {self.model_class.__name__} is a {self.model_task.value} ({self.model_type}); "
                f"{self.trainer_module.__name__} trains causal language models: use the "
                f"{self.model_type} causal-LM class (e.g. model_class=LlamaForCausalLM, or "
                "model_task=TaskType.CAUSAL_LM)"
            )

    def launch(
        self,
        num_workers: int,
        arguments: TrainingArguments,
        dataset_train: Any,
        dataset_eval: Any = None,
        scaling_index: int = 1,
        data_collator: Callable | None = None,
        max_failures: int = 0,
        ray_address: str | None = None,
        resources_per_worker: dict[str, float] | None = None,
        use_gpu: bool = False,
        use_tpu: bool = False,
        callbacks: Sequence[Any] = (),
        worker_env: dict[str, str] | None = None,
        num_cpus: int | None = None,
    ) -> LaunchResult:
        """Run :meth:`train` on ``num_workers`` JAX processes under Ray Train; see
        :func:`scaletrain.launch.ray.launcher.launch_on_ray` for every argument.

        ``dataset_train`` / ``dataset_eval`` are shipped to every worker (each reads
        only its own shard); pass a zero-argument callable instead to load them on
        the workers. Returns a :class:`LaunchResult` (``summary``: the run's ``summary.json``).
        """
        from scaletrain.compat.easydel.train_job import TrainJob
        from scaletrain.launch.ray.launcher import launch_on_ray

        # Ray Train runs workers in its own folder: make every path absolute first
        arguments = arguments.model_copy(update={"output_dir": os.path.abspath(arguments.output_dir)})
        job = TrainJob(self, scaling_index, arguments, dataset_train, dataset_eval, data_collator, tuple(callbacks))
        return launch_on_ray(
            job, num_workers=num_workers, output_dir=arguments.output_dir, max_failures=max_failures,
            ray_address=ray_address, resources_per_worker=resources_per_worker, use_gpu=use_gpu,
            use_tpu=use_tpu, worker_env=worker_env, num_cpus=num_cpus,
            resume_if_possible=arguments.resume_if_possible,
        )

    def __repr__(self) -> str:
        items = []
        for k, v in self.__dict__.items():
            if k.startswith("_") or k == "processor":
                continue
            try:
                s = str(v).replace("\n", "\n  ")
                if len(s) > 200:
                    s = f"{v.__class__.__name__}(...)"
                items.append(f"  {k} : {s}")
            except TypeError:
                items.append(f"  {k} : <unrepresentable>")
        return f"{self.__class__.__name__}(\n" + "\n".join(items) + "\n)"

    __str__ = __repr__


def align_dtypes(arguments: TrainingArguments, state: Any) -> TrainingArguments:
    """``arguments`` with ``dtype``/``param_dtype`` taken from the model where the user left them unset."""
    model = state.model
    update = {}
    for name in ("dtype", "param_dtype"):
        if name not in arguments.model_fields_set:
            update[name] = jnp.dtype(getattr(model, name)).name
    if not update:
        return arguments
    return type(arguments)(**{**arguments.model_dump(exclude_unset=True), **update})
