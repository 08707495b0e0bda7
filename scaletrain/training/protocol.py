"""``BaseTrainerProtocol``: the contract every trainer meets (seed 003) and its outputs."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple


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
