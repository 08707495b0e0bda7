"""What a trainer promises: ``BaseTrainerProtocol`` for its users, ``TrainerView`` for its callbacks.

``BaseTrainerProtocol`` keeps the method and property names of EasyDeL's trainer
protocol, so code written against EasyDeL's ``Trainer`` runs unchanged.
``TrainerView`` is the narrower surface a callback sees: everything a callback may
read or do is listed there and nothing else (like Levanter's hooks, which receive a
value rather than the trainer). Callbacks are typed against it, so this module is
the one place to look when writing a callback, and the callbacks never import the
trainer.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol


class TrainerOutput(NamedTuple):
    """What ``train()`` returns: final state, mesh, and where the last checkpoint went.

    It pickles (Ray returns it from a remote ``train()``, as in EasyDeL's Ray worker example):
    the state's arrays travel as numpy arrays on the host, in the state's own class
    (a custom ``state_class`` stays itself, ``graphdef`` and all), and the mesh, whose
    devices belong to the sending process, travels as a ``jax.sharding.AbstractMesh``
    with the same axis names and sizes. The receiver needs no devices to read it; to
    train on, pass ``output.state`` back as ``model_state=`` / ``state=`` and the
    trainer places it on its own mesh. A state split over several processes cannot
    be pickled from one of them (each holds only its shards): gather it first.
    """

    state: Any
    mesh: Any
    checkpoint_path: str | None
    last_save_file_name: str | None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        import jax

        mesh = self.mesh.abstract_mesh if isinstance(self.mesh, jax.sharding.Mesh) else self.mesh
        state = jax.tree.map(_host_leaf, self.state)
        return TrainerOutput, (state, mesh, self.checkpoint_path, self.last_save_file_name)


def _host_leaf(x: Any) -> Any:
    """A device array as a numpy array (no collective: refused for arrays split over processes)."""
    import jax

    if not isinstance(x, jax.Array):
        return x
    if not (x.is_fully_addressable or x.is_fully_replicated):
        raise TypeError(
            "cannot pickle a TrainerOutput whose state is split over several processes; gather it on every "
            "process first (jax.tree.map(scaletrain.parallel.host.to_host, output.state)) and pickle that"
        )
    from scaletrain.parallel.host import to_host

    return to_host(x)


class _FunctionFields(NamedTuple):
    sharded_training_step_function: Callable
    sharded_evaluation_step_function: Callable
    mesh: Any = None
    checkpoint_manager: Any = None


class TrainerConfigureFunctionOutput(_FunctionFields):
    """The jitted steps, the mesh and the checkpoint manager.

    Both of EasyDeL's spellings work, in the constructor and as attributes: its ``Trainer``
    names the steps ``sharded_training_step_function`` / ``sharded_evaluation_step_function``,
    its ``BaseTrainerProtocol`` ``train_step_fn`` / ``eval_step_fn``, and builds it from those two alone.
    """

    __slots__ = ()

    def __new__(
        cls,
        sharded_training_step_function: Callable | None = None,
        sharded_evaluation_step_function: Callable | None = None,
        mesh: Any = None,
        checkpoint_manager: Any = None,
        *,
        train_step_fn: Callable | None = None,
        eval_step_fn: Callable | None = None,
    ) -> TrainerConfigureFunctionOutput:
        train = _one_of("sharded_training_step_function", sharded_training_step_function,
                        "train_step_fn", train_step_fn)
        evaluate = _one_of("sharded_evaluation_step_function", sharded_evaluation_step_function,
                           "eval_step_fn", eval_step_fn)
        return super().__new__(cls, train, evaluate, mesh, checkpoint_manager)

    @property
    def train_step_fn(self) -> Callable:
        return self.sharded_training_step_function

    @property
    def eval_step_fn(self) -> Callable:
        return self.sharded_evaluation_step_function


def _one_of(name: str, value: Any, alias: str, alias_value: Any) -> Any:
    if value is not None and alias_value is not None and value is not alias_value:
        raise TypeError(f"give {name} or {alias} (the same function under two names), not two different ones")
    return value if value is not None else alias_value


class TrainerConfigureModelOutput(NamedTuple):
    """EasyDeL's protocol builds it from ``model`` and ``state`` alone; ``Trainer`` also returns its optimizer and schedule."""

    model: Any
    state: Any
    optimizer: Any = None
    scheduler: Any = None


class TrainerConfigureDataloaderOutput(NamedTuple):
    """EasyDeL's protocol builds it from the two loaders alone; ``Trainer`` also returns its step horizons."""

    dataloader_train: Any
    dataloader_eval: Any = None
    max_training_steps: int | None = None
    max_evaluation_steps: int | None = None


class BaseTrainerProtocol(abc.ABC):
    """Methods and properties of a trainer (names from EasyDeL's ``BaseTrainerProtocol``).

    The methods are abstract. The required properties are declared as annotations, not
    abstract properties: EasyDeL's protocol skeleton assigns them in ``__init__``
    (``self.arguments = arguments``), which an abstract read-only property would
    refuse; ``BaseTrainer`` provides them as read-only properties.
    ``train(model_parameters=None, state=None)`` takes the protocol's two optional starting
    points; what it returns is EasyDeL's ``Trainer``'s ``TrainerOutput`` (its ``state`` is what
    the protocol's ``train`` returns).
    """

    arguments: Any
    dataset_train: Any
    dataset_eval: Any
    model: Any
    model_state: Any
    dtype: Any
    param_dtype: Any
    scheduler: Any
    optimizer: Any

    @abc.abstractmethod
    def train(self, model_parameters: Any = None, state: Any = None) -> TrainerOutput: ...

    @abc.abstractmethod
    def evaluate(self, state: Any = None, metric_calculator: Callable | None = None) -> dict[str, float]: ...

    def eval(self, model_state: Any) -> Iterator[dict[str, float]]:
        """Running metrics per eval batch: EasyDeL's ``Trainer`` has it, its protocol does not require it."""
        raise NotImplementedError(f"{type(self).__name__} does not implement eval(); use evaluate()")

    @abc.abstractmethod
    def save_pretrained(self, ckpt_path: str, state: Any = None) -> str: ...

    @abc.abstractmethod
    def configure_model(self) -> TrainerConfigureModelOutput: ...

    @abc.abstractmethod
    def configure_dataloaders(self) -> TrainerConfigureDataloaderOutput: ...

    @abc.abstractmethod
    def configure_functions(self) -> TrainerConfigureFunctionOutput: ...


class TrainerView(Protocol):
    """What a callback may read and do while a run is under way.

    Read-only for callbacks: ``arguments`` (the run's TrainingArguments),
    ``global_step`` (steps done, counting those before a resume), ``start_step``
    (the step this run started from), ``epoch``, ``max_training_steps`` (the
    resolved horizon), ``start_time`` (``time.perf_counter()`` at ``train()``),
    ``current_state`` (the newest TrainState), ``model_state`` (the state built at
    init), ``mesh``, ``dataset_eval``, ``tokenizer`` (or None), ``stop_reason``
    (None until a stop was requested), ``failed`` (the error that will end the
    run, or None), ``is_main_process``, ``last_train_metrics`` (the newest logged
    train record, ``{}`` before the first log step), ``changes_on_resume`` (what
    resumes changed under ``training.resume_allow_changes``: ``after_step``, ``key``,
    ``old``, ``new``; ``[]`` for a run never changed), and of the objective what the logs need:
    ``logged_metrics`` (its figures named without a ``/`` that the train log keeps) and
    ``sequences_per_row`` (sequences a batch row forwards, what tokens/s counts).

    Actions: ask to stop (``request_stop``) or fail the run (``fail``); run an
    evaluation; save a checkpoint or wait for pending saves; write a record to the
    run's metrics; compute throughput and the learning rate at a step.
    """

    arguments: Any
    global_step: int
    start_step: int
    epoch: int
    max_training_steps: int
    start_time: float
    current_state: Any
    stop_reason: str | None
    failed: BaseException | None
    tokenizer: Any
    changes_on_resume: list[dict[str, Any]]

    @property
    def model_state(self) -> Any: ...

    @property
    def mesh(self) -> Any: ...

    @property
    def dataset_eval(self) -> Any: ...

    @property
    def is_main_process(self) -> bool: ...

    @property
    def last_train_metrics(self) -> dict[str, Any]: ...

    @property
    def logged_metrics(self) -> tuple[str, ...]: ...

    @property
    def sequences_per_row(self) -> int: ...

    def request_stop(self, reason: str) -> None:
        """Stop after the current step with ``reason`` (the first reason wins); a final checkpoint follows."""

    def fail(self, error: BaseException) -> None:
        """Stop after the current step and raise ``error`` from ``train()`` (no final checkpoint)."""

    def evaluate(self, state: Any = None, metric_calculator: Callable | None = None) -> dict[str, float]:
        """Evaluate ``state`` on the eval set; fires ``pre_evaluate`` / ``post_evaluate``."""

    def save_checkpoint(self, state: Any) -> str:
        """Save ``state`` at ``global_step`` (asynchronously); returns the checkpoint's path."""

    def wait_for_checkpoints(self) -> None:
        """Block until every pending asynchronous checkpoint write is complete."""

    def write_metrics(self, record: dict[str, Any]) -> None:
        """Append ``record`` to metrics.jsonl and the configured loggers (process 0 only)."""

    def throughput(self, tokens: float, seconds: float) -> dict[str, float]:
        """tokens/s, TFLOP/s and MFU for ``tokens`` processed in ``seconds``."""

    def learning_rate_at(self, step: int) -> float:
        """The schedule's learning rate at optimizer step ``step`` (0-based)."""
