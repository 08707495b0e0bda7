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
    """What ``train()`` returns: final state, mesh, and where the last checkpoint went."""

    state: Any
    mesh: Any
    checkpoint_path: str | None
    last_save_file_name: str | None


class TrainerConfigureFunctionOutput(NamedTuple):
    sharded_training_step_function: Callable
    sharded_evaluation_step_function: Callable
    mesh: Any
    checkpoint_manager: Any


class TrainerConfigureModelOutput(NamedTuple):
    model: Any
    state: Any
    optimizer: Any
    scheduler: Any


class TrainerConfigureDataloaderOutput(NamedTuple):
    dataloader_train: Any
    dataloader_eval: Any
    max_training_steps: int
    max_evaluation_steps: int | None


class BaseTrainerProtocol(abc.ABC):
    """Methods and properties of a trainer (names from EasyDeL's protocol)."""

    @abc.abstractmethod
    def train(self) -> TrainerOutput: ...

    @abc.abstractmethod
    def evaluate(self, state: Any = None, metric_calculator: Callable | None = None) -> dict[str, float]: ...

    @abc.abstractmethod
    def eval(self, model_state: Any) -> Iterator[dict[str, float]]: ...

    @abc.abstractmethod
    def save_pretrained(self, ckpt_path: str, state: Any = None) -> str: ...

    @abc.abstractmethod
    def configure_model(self) -> TrainerConfigureModelOutput: ...

    @abc.abstractmethod
    def configure_dataloaders(self) -> TrainerConfigureDataloaderOutput: ...

    @abc.abstractmethod
    def configure_functions(self) -> TrainerConfigureFunctionOutput: ...

    @property
    @abc.abstractmethod
    def arguments(self) -> Any: ...

    @property
    @abc.abstractmethod
    def dataset_train(self) -> Any: ...

    @property
    @abc.abstractmethod
    def dataset_eval(self) -> Any: ...

    @property
    @abc.abstractmethod
    def model(self) -> Any: ...

    @property
    @abc.abstractmethod
    def model_state(self) -> Any: ...

    @property
    @abc.abstractmethod
    def dtype(self) -> Any: ...

    @property
    @abc.abstractmethod
    def param_dtype(self) -> Any: ...

    @property
    @abc.abstractmethod
    def scheduler(self) -> Any: ...

    @property
    @abc.abstractmethod
    def optimizer(self) -> Any: ...


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
    train record, ``{}`` before the first log step).

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
