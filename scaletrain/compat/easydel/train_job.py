"""What every Ray worker runs for ``RayDistributedTrainer.train``: the façade's job for the Ray launcher.

Why here and not beside the launcher: the launcher runs any picklable job and knows
nothing of the façade; this one calls the façade's ``train`` on each worker (with
``resume_if_possible``, so a restarted worker group resumes) and hands back the summary
of the Trainer it built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

@dataclass
class TrainJob:
    """``RayDistributedTrainer.train`` with these arguments, run on every worker."""

    trainer: Any
    scaling_index: int
    arguments: Any
    dataset_train: Any
    dataset_eval: Any = None
    data_collator: Callable | None = None
    callbacks: tuple[Any, ...] = ()

    def __call__(self, callbacks: Sequence[Any]) -> dict[str, Any]:
        from scaletrain.training.callbacks import Callback

        train = self.dataset_train() if callable(self.dataset_train) else self.dataset_train
        evals = self.dataset_eval() if callable(self.dataset_eval) else self.dataset_eval
        arguments = self.arguments.model_copy(update={"resume_if_possible": True})
        captured: dict[str, Any] = {}

        class Capture(Callback):
            def post_init(self, trainer: Any) -> None:
                captured["trainer"] = trainer

        self.trainer.train(self.scaling_index, arguments, train, evals, self.data_collator,
                           callbacks=[*self.callbacks, *callbacks, Capture()])
        return dict(captured["trainer"].summary)

