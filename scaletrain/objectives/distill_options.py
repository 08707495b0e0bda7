"""The options of distillation from a teacher: ``objective.type: distillation`` (TRL 1.16's ``DistillationConfig``)
and ``objective.type: gkd`` (TRL's experimental ``GKDConfig``), under TRL's names and defaults.

Why two option models over one objective: TRL has two trainers with overlapping names that mean slightly
different things, and a recipe ported from either should mean what it meant there.

- ``distillation``: always on-policy (the student samples every step), ``beta`` (default 1: the reverse KL),
  ``temperature`` for sampling *and* the loss, ``max_completion_length``, ``top_p``/``top_k``.
- ``gkd``: ``lmbda`` (the share of steps that sample from the student; the others read the dataset's
  completions), ``beta`` (default 0.5: the Jensen-Shannon divergence), ``temperature`` (default 0.9) for
  sampling only (TRL's GKD loss is at temperature 1), ``max_new_tokens``, ``seq_kd`` (off-policy steps read
  completions the teacher samples instead of the dataset's).

Ours in both: ``teacher`` (a Hugging Face model folder of the same vocabulary; TRL's
``teacher_model_name_or_path`` is accepted as its other name) and ``teacher_dtype`` (``bfloat16`` for a teacher
held and run in bf16 beside a float32 student; TRL's ``teacher_model_init_kwargs: {dtype: ...}`` means the same
and is read as it). ``max_prompt_length`` keeps a prompt's last tokens, and ``rollout_engine`` /
``rollout_slots`` choose the engine that samples, as GRPO's.

A few names the GRPO trainer reads (``num_generations``, ``num_iterations``, ``max_completion_length`` ...) are
read-only properties here: one completion a prompt, each rollout used once.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TEACHER_DTYPES = ("float32", "bfloat16", "float16")


class _TeacherOptions(BaseModel):
    """What both distillation objectives share: the teacher and how prompts are cut."""

    model_config = ConfigDict(extra="forbid")
    #: TRL's names read as ours (``_trl_names``)
    other_names: ClassVar[frozenset[str]] = frozenset({"teacher_model_name_or_path", "teacher_model_init_kwargs"})

    teacher: str | None = None  # a model folder (required in a recipe; the Python API may pass teacher_model=)
    teacher_dtype: str | None = None  # None: the student's dtypes
    max_prompt_length: int | None = Field(None, ge=1)
    # which engine samples (GRPO's option, ours alone): "static" per shape bucket, "continuous" over rollout_slots
    rollout_engine: Literal["static", "continuous"] = "static"
    rollout_slots: int = Field(16, ge=1)
    rollout_cache_pages: int | None = Field(None, ge=1)  # continuous: the page pool (None: 3/4 of the worst case)

    @model_validator(mode="before")
    @classmethod
    def _trl_names(cls, data: Any) -> Any:
        """TRL's ``teacher_model_name_or_path`` and ``teacher_model_init_kwargs={"dtype": ...}`` as ours."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "teacher_model_name_or_path" in data:
            name = data.pop("teacher_model_name_or_path")
            if data.get("teacher") not in (None, name):
                raise ValueError("give teacher or teacher_model_name_or_path, not both")
            data["teacher"] = name
        kwargs = data.pop("teacher_model_init_kwargs", None) or {}
        unknown = sorted(set(kwargs) - {"dtype", "torch_dtype"})
        if unknown:
            raise ValueError(f"teacher_model_init_kwargs: only dtype is read here (the teacher is loaded from a "
                             f"local folder onto the student's mesh); drop {unknown}")
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        if dtype not in (None, "auto"):
            data.setdefault("teacher_dtype", str(dtype).removeprefix("torch."))
        return data

    @model_validator(mode="after")
    def _dtype(self) -> "_TeacherOptions":
        if self.teacher_dtype is not None and self.teacher_dtype not in TEACHER_DTYPES:
            raise ValueError(f"teacher_dtype={self.teacher_dtype!r} is not one of {list(TEACHER_DTYPES)}")
        return self

    # what the GRPO trainer's rollout and loop read: one completion a prompt, each rollout used once, no rewards
    @property
    def num_generations(self) -> int:
        return 1

    @property
    def num_iterations(self) -> int:
        return 1

    @property
    def reward_funcs(self) -> list[Any]:
        return []

    @property
    def reward_weights(self) -> None:
        return None


class DistillationOptions(_TeacherOptions):
    """TRL 1.16's ``DistillationConfig`` options (see the module docstring); ``max_completion_length`` 256 (TRL:
    512) to suit a CPU, as GRPO's."""

    beta: float = Field(1.0, ge=0, le=1)
    temperature: float = Field(1.0, gt=0)
    max_completion_length: int = Field(256, ge=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)

    @property
    def lmbda(self) -> float:
        return 1.0  # every step samples from the student

    @property
    def seq_kd(self) -> bool:
        return False


class GKDOptions(_TeacherOptions):
    """TRL's experimental ``GKDConfig`` options (see the module docstring)."""

    lmbda: float = Field(0.5, ge=0, le=1)
    beta: float = Field(0.5, ge=0, le=1)
    temperature: float = Field(0.9, gt=0)
    max_new_tokens: int = Field(128, ge=1)
    seq_kd: bool = False

    @property
    def max_completion_length(self) -> int:
        return self.max_new_tokens

    @property
    def top_p(self) -> float:
        return 1.0  # TRL's GKD samples with top_p=1, top_k=0

    @property
    def top_k(self) -> int:
        return 0


def build_distillation_objective(o: DistillationOptions) -> Any:
    from scaletrain.objectives.distill import DistillationObjective

    return DistillationObjective(beta=o.beta, temperature=o.temperature)


def build_gkd_objective(o: GKDOptions) -> Any:
    """GKD's loss is at temperature 1 whatever it samples at (TRL's ``GKDTrainer.compute_loss``)."""
    from scaletrain.objectives.distill import DistillationObjective

    return DistillationObjective(beta=o.beta, temperature=1.0)
