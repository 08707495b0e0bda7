"""Train state, pure steps, the trainer loop and its callbacks."""

from scaletrain.training.callbacks import Callback, StepOutput
from scaletrain.training.protocol import (
    BaseTrainerProtocol,
    TrainerConfigureDataloaderOutput,
    TrainerConfigureFunctionOutput,
    TrainerConfigureModelOutput,
    TrainerOutput,
)
from scaletrain.training.state import TrainState, create_train_state, params_sha256
from scaletrain.training.base import BaseTrainer
from scaletrain.training.trainer import Trainer

__all__ = [
    "BaseTrainer",
    "BaseTrainerProtocol",
    "Callback",
    "StepOutput",
    "TrainState",
    "Trainer",
    "TrainerConfigureDataloaderOutput",
    "TrainerConfigureFunctionOutput",
    "TrainerConfigureModelOutput",
    "TrainerOutput",
    "create_train_state",
    "params_sha256",
]
