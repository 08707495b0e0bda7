"""The recipe's ``eval_harness`` section: lm-eval tasks and extra eval data sets scored during training.

Why in ``eval/`` and plain pydantic: the recipe composes it (``Recipe.eval_harness``) and the
in-loop callback reads it; neither lm-eval nor JAX is imported to validate a recipe.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EvalDataSet(BaseModel):
    """One extra eval data set: its ``source`` scored whole, read as ``kind`` with the data section's keys."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    source: str
    kind: str = "pretrain"
    split: str = "train"
    text_column: str = "text"
    messages_column: str = "messages"
    format: str = "auto"


class EvalHarnessSection(BaseModel):
    """Every ``every_steps`` steps (and at the end with ``at_end``): run ``tasks`` (lm-eval; YAMLs of your own
    under ``include_path``) on at most ``limit`` examples each, and score each of ``data``; the figures go to
    metrics.jsonl and TensorBoard as the ``harness`` split, with the seconds it took."""

    model_config = ConfigDict(extra="forbid")

    tasks: list[str] = Field(default_factory=list)
    include_path: str | None = None
    limit: float | None = Field(None, gt=0)
    num_fewshot: int | None = Field(None, ge=0)
    batch_size: int = Field(8, ge=1)
    data: list[EvalDataSet] = Field(default_factory=list)
    every_steps: int | None = Field(None, ge=1)
    at_end: bool = True

    @property
    def enabled(self) -> bool:
        return bool(self.tasks or self.data) and (self.every_steps is not None or self.at_end)
