"""The YAML recipe: ``model``, ``data``, ``tokenizer``, ``training``, ``objective``, ``mesh``, ``sample``, ``ray``,
``launch``, ``sweep``, ``eval_harness``.

A recipe is validated as a whole; every problem is reported as
``<file>: <section>.<key>: <what is wrong>``. Command-line overrides are dotted
paths into it (``training.max_training_steps=50``), parsed as YAML values.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from scaletrain.arguments import TrainingArguments, format_validation_error
from scaletrain.config_keys import problem_lines
from scaletrain.data.config import DataSection
from scaletrain.errors import ConfigError
from scaletrain.eval.config import EvalHarnessSection
from scaletrain.peft.lora_config import LoRAConfig
from scaletrain.parallel.mesh import AXIS_NAMES
from scaletrain.parallel.partition import PartitionAxis


class ModelSection(BaseModel):
    """``type`` (registry key), optional local ``pretrained`` folder, and HF config keys."""

    model_config = ConfigDict(extra="allow")

    type: str = "llama"
    pretrained: str | None = None

    @field_validator("pretrained")
    @classmethod
    def _pretrained_folder(cls, value: str | None) -> str | None:
        """``cache:NAME`` is NAME under scaletrain's cache folder (``$SCALETRAIN_CACHE``, else
        ``~/.cache/scaletrain``: where scripts/convert_smollm2.py writes), so a recipe can name a
        converted model without a machine-specific path; resolved here so the run's recipe.yaml
        (read again by export) holds the real folder."""
        if value is None:
            return None
        if value.startswith("cache:"):
            from scaletrain.data.prepared import cache_root

            return str(cache_root() / value.split(":", 1)[1])
        return os.path.expanduser(value)

    @model_validator(mode="after")
    def _known_keys(self) -> ModelSection:
        from scaletrain.models.registry import get_modules_by_type

        try:
            config_class, _ = get_modules_by_type(self.type)
        except ConfigError as err:
            raise ValueError(str(err)) from None
        unknown = sorted(k for k in self.config_overrides if k not in config_class.model_fields)
        if unknown:
            raise ValueError(f"unknown model config key(s) {unknown} for model type {self.type!r}")
        try:
            config_class.model_validate(self.config_overrides)
        except ValidationError as err:
            raise ValueError(format_validation_error(err, "model")) from None
        return self

    @property
    def config_overrides(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class TokenizerSection(BaseModel):
    """``path``: a local tokenizer folder, ``bundled`` or ``prepared:NAME`` (built offline on first use);
    unset means the pretrained model's folder if there is one, else the bundled tokenizer."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = None


class ObjectiveSection(BaseModel):
    """What training optimises: ``type`` (``lm``, ``dpo``, ``orpo``, ``cpo``, ``simpo``, ``kto``, ``grpo``; the registry of
    ``scaletrain.objectives.registry``) and its options under TRL's names (``beta``, ``loss_type``, ...)."""

    model_config = ConfigDict(extra="allow")

    type: str = "lm"

    @model_validator(mode="after")
    def _valid_options(self) -> ObjectiveSection:
        from scaletrain.objectives.registry import build_objective

        try:
            build_objective(self.type, self.options)
        except ConfigError as err:
            raise ValueError(str(err)) from None
        return self

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class MeshSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    axis_dims: tuple[int, ...] = (1, -1, 1, 1, 1)
    axis_names: tuple[str, ...] = AXIS_NAMES
    partition_axis: PartitionAxis = PartitionAxis()


class SampleSection(BaseModel):
    """What to generate at the end of a run (skipped when ``max_new_tokens`` is 0)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = "\n"
    max_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(0.8, ge=0.0)
    top_k: int | None = Field(40, ge=1)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int = 0


class RaySection(BaseModel):
    """Run the training on Ray Train (``num_workers`` JAX processes); unset ``num_workers`` = no Ray.

    ``address``: None starts a local Ray instance (``num_cpus`` logical CPUs), ``auto``
    joins the running cluster. ``max_failures``: worker-group restarts, each resuming
    from the newest checkpoint (set ``training.save_steps``).
    """

    model_config = ConfigDict(extra="forbid")

    num_workers: int | None = Field(None, ge=1)
    address: str | None = None
    max_failures: int = Field(0, ge=-1)
    use_gpu: bool = False
    resources_per_worker: dict[str, float] | None = None
    num_cpus: int | None = Field(None, ge=1)


class LaunchSection(BaseModel):
    """How the processes of a run find each other without Ray (``backend: jax``; docs/launch.md).

    Unset keys come from the command line (``--coordinator``, ``--num-processes``,
    ``--process-id``), then ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` /
    ``JAX_PROCESS_ID``, then JAX's own cluster detection (Slurm, Cloud TPU, Open MPI).
    ``backend: auto`` picks ``jax`` when any of them says there are several processes.
    The timeouts bound every wait: joining (``initialization_timeout``) and noticing a
    lost process (``heartbeat_timeout``), both in seconds. Process 0 listens for the others
    on the coordinator's own address (a loopback address stays on this host), or on
    ``coordinator_bind_address`` when set (``0.0.0.0`` or ``::``: every interface).
    """

    model_config = ConfigDict(extra="forbid")

    backend: str = Field("auto", pattern="^(auto|local|jax)$")
    coordinator_address: str | None = Field(None, pattern=r"^\S+:\d+$")
    num_processes: int | None = Field(None, ge=1)
    process_id: int | None = Field(None, ge=0)
    initialization_timeout: int = Field(300, ge=1)
    heartbeat_timeout: int = Field(60, ge=2)
    coordinator_bind_address: str | None = Field(None, pattern=r"^[^\s:]+$|^\[?[0-9a-fA-F:.]+\]?$")


class SweepSection(BaseModel):
    """A scaling ladder (``scaletrain sweep``): one training per scaling index.

    Each key of ``scaled_keys`` is the ``model`` value times the index (EasyDeL RayDistributedTrainer's
    ``CONFIG_SCALING_VARIABLES``). ``member_overrides`` maps an index to extra
    ``section.key=value`` overrides for that member only.
    """

    model_config = ConfigDict(extra="forbid")

    scaling_indices: tuple[int, ...] = (1, 2, 4, 8)
    scaled_keys: tuple[str, ...] = ("hidden_size", "intermediate_size", "num_attention_heads",
                                    "num_key_value_heads")
    cpus_per_member: float = Field(1.0, gt=0)
    member_overrides: dict[int, list[str]] = Field(default_factory=dict)


class Recipe(BaseModel):
    """A whole training job."""

    model_config = ConfigDict(extra="forbid")

    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    tokenizer: TokenizerSection = TokenizerSection()
    training: TrainingArguments = TrainingArguments()
    objective: ObjectiveSection = ObjectiveSection()
    # LoRA / QLoRA (scaletrain.peft.lora_config); the same object as training.lora
    lora: LoRAConfig | None = None
    mesh: MeshSection = MeshSection()
    sample: SampleSection = SampleSection()
    ray: RaySection = RaySection()
    launch: LaunchSection = LaunchSection()
    sweep: SweepSection = SweepSection()
    # lm-eval tasks and extra eval data sets scored during training (scaletrain.eval.callback)
    eval_harness: EvalHarnessSection = EvalHarnessSection()
    # the folder of the recipe file it was read from (None: built in Python); see `folder`
    _folder: str | None = PrivateAttr(default=None)

    @property
    def folder(self) -> str | None:
        """The folder of the recipe file this recipe was read from (None: built in Python): where its
        ``module:function`` references (GRPO's ``reward_funcs``) are looked for first, as ``python script.py``
        finds the modules beside the script."""
        return self._folder

    def __eq__(self, other: object) -> bool:
        """Recipes that say the same are equal, wherever their files were read from (``folder`` is not part of
        what a recipe says: its YAML round trip, a saved ``recipe.yaml``, compare equal to the original)."""
        if not isinstance(other, Recipe):
            return NotImplemented
        return self.__dict__ == other.__dict__ and self.__pydantic_extra__ == other.__pydantic_extra__

    __hash__ = None  # type: ignore[assignment]  # mutable, as pydantic models are

    @model_validator(mode="after")
    def _lora_into_training(self) -> Recipe:
        """The ``lora`` section is ``training.lora``; its base defaults to ``model.pretrained``."""
        lora = self.lora if self.lora is not None else self.training.lora
        if self.lora is not None and self.training.lora is not None and self.training.lora != self.lora:
            raise ValueError("set LoRA in the lora section or in training.lora, not both")
        if lora is not None and lora.base_model is None and self.model.pretrained:
            lora = lora.model_copy(update={"base_model": self.model.pretrained})
        self.lora = self.training.lora = lora
        return self

    @model_validator(mode="after")
    def _objective_reads_its_data(self) -> Recipe:
        """An objective that reads pairs (or KTO's rows) needs the data kind that serves them."""
        from scaletrain.objectives.registry import get_objective_type

        try:
            want = get_objective_type(self.objective.type).data_kind
        except ConfigError:
            return self  # reported by the objective section
        if want is not None and self.data.kind != want:
            raise ValueError(f"objective.type={self.objective.type!r} reads rows of the data kind {want!r}, but "
                             f"data.kind is {self.data.kind!r}; set data.kind: {want}")
        if want is None and self.data.kind in ("preference", "unpaired_preference"):
            raise ValueError(f"data.kind={self.data.kind!r} serves preference rows; set objective.type to dpo, orpo, "
                             "cpo, simpo or kto")
        if want is None and self.data.kind == "prompt":
            raise ValueError("data.kind='prompt' serves prompts to sample completions from; set objective.type: grpo")
        return self

    @model_validator(mode="after")
    def _prepared_as_trl_by_default(self) -> Recipe:
        """Unset, ``data.preparation`` and ``training.truncation_mode`` become what TRL's trainer of this objective
        does (ORPO/CPO/SimPO: its ORPO/CPO preparation; preference kinds: ``keep_start``), so a run's first step
        equals TRL's with no extra option. Filled in here, so ``recipe.yaml`` records what the run did."""
        from scaletrain.data.kinds import DATA_KINDS
        from scaletrain.objectives.registry import get_objective_type

        kind = DATA_KINDS.get(self.data.kind)
        if kind is None or kind.truncation_mode is None:
            return self
        if "truncation_mode" not in self.training.model_fields_set:
            self.training.truncation_mode = kind.truncation_mode  # type: ignore[assignment]
        if self.data.preparation is None:
            try:
                self.data.preparation = get_objective_type(self.objective.type).preparation  # type: ignore[assignment]
            except ConfigError:
                pass  # reported by the objective section
        return self

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "recipe", overrides: tuple[str, ...] | list[str] = ()
                  ) -> Recipe:
        """Validate ``data``; every problem on one line, an override's named as the user typed it."""
        try:
            recipe = cls(**data)
        except ValidationError as err:
            raise ConfigError(recipe_problems(err, cls, where, overrides)) from None
        recipe.check_lengths(where)
        return recipe

    def check_lengths(self, where: str = "recipe") -> None:
        """Refuse sequences longer than the model's positions (the Trainer checks again for a pretrained model)."""
        positions = self.model.config_overrides.get("max_position_embeddings")
        if isinstance(positions, int) and self.training.max_length > positions:
            raise ConfigError(
                f"{where}: training.max_length={self.training.max_length} is longer than "
                f"model.max_position_embeddings={positions}; lower training.max_length or raise "
                "model.max_position_embeddings"
            )

    @classmethod
    def load(cls, path: str, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
        """Read ``path`` (YAML), apply ``key.path=value`` overrides, validate."""
        if not os.path.isfile(path):
            raise ConfigError(f"recipe file not found: {path}")
        with open(path) as f:
            data = load_yaml(f, path) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the recipe must be a mapping of sections, got {type(data).__name__}")
        data = apply_overrides(data, overrides)
        recipe = cls.from_dict(data, where=path, overrides=overrides)
        recipe._folder = os.path.dirname(os.path.abspath(path))
        return recipe

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def to_dict(self) -> dict[str, Any]:
        out = self.model_dump(mode="json")
        out["model"] = {"type": self.model.type, "pretrained": self.model.pretrained, **self.model.config_overrides}
        if self.eval_harness == EvalHarnessSection():  # unset: a recipe written before the section reads the same
            out.pop("eval_harness")
        return out


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Set each ``a.b.c=value`` (value parsed as YAML) in a copy of ``data``."""
    data = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r}: empty key segment")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        node = data
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
            node = child
        node[parts[-1]] = value
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last, silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(f"{self.name}: line {line}: key {key!r} is given twice in one section (first on "
                                  f"line {seen[key]}); the second would silently win, so keep one")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(stream: Any, name: str) -> Any:
    """Parse a recipe's YAML; a syntax error or a repeated key is one ConfigError naming ``name``."""
    loader = _UniqueKeyLoader(stream)
    loader.name = name
    try:
        return loader.get_single_data()
    except yaml.YAMLError as err:
        raise ConfigError(f"{name}: not valid YAML: {err}") from None
    finally:
        loader.dispose()


def recipe_problems(err: ValidationError, model: type[BaseModel], where: str,
                    overrides: tuple[str, ...] | list[str] = ()) -> str:
    """``<file>: invalid recipe`` and one line per problem; a problem an override made names that override.

    Why: the user typed the override on the command line, and pointing at the file alone
    sends them looking for a key that is not there.
    """
    keys = {item.split("=", 1)[0].strip(): item for item in overrides if "=" in item}
    lines, from_file = [], False
    for loc, line in problem_lines(err, "", model=model):
        item = next((keys[k] for k in keys if loc == k or loc.startswith(k + ".") or k.startswith(loc + ".")), None)
        from_file |= item is None
        lines.append(line if item is None else f"{line} [command-line override {item!r}]")
    title = f"{where}: invalid recipe" if from_file else f"invalid command-line override (recipe {where})"
    return title + "\n" + "\n".join(lines)

