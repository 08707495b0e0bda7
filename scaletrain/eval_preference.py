"""The objective and reference that score preference data (``--kind preference`` / ``unpaired_preference``).

Why here and not in the data evaluation: a preference figure (``eval_rewards/accuracies``,
``eval_rewards/margins``, ...) depends on two more things than the rows, the objective with its
options (β above all) and the reference model. For a preference run both are the run's own,
rebuilt as the run built them (its recorded objective; LoRA adapters off, a copy of its starting
model, or its reference folder, the latter two checked against the digest the checkpoint
recorded), so ``scaletrain eval RUN`` equals the run's final evaluation. For a model folder they
are the command's options (``--objective``, ``--beta``, ``--reference``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from scaletrain.errors import ConfigError

PREFERENCE_KINDS = ("preference", "unpaired_preference")
#: the objectives a model folder can be scored with, and the data kind each reads
FOLDER_OBJECTIVES = {"dpo": "preference", "orpo": "preference", "simpo": "preference", "kto": "unpaired_preference",
                     "reward": "preference"}
_DEFAULT = {"preference": "dpo", "unpaired_preference": "kto"}


@dataclasses.dataclass(frozen=True)
class PreferenceOptions:
    """The command's choices; None keeps the run's (or the default: DPO / KTO, β 0.1)."""

    objective: str | None = None
    beta: float | None = None
    reference: str | None = None


@dataclasses.dataclass
class PreferenceScoring:
    """What the eval step needs: the objective (its reference source set) and the frozen models it reads."""

    objective: Any
    frozen_models: dict[str, Any]
    reference: str | None  # what the table shows: a folder, "adapters off", the run's starting model, or None


def check_options(kind: str, options: PreferenceOptions) -> None:
    """Refuse options that do not fit ``kind`` before any model loads (one ConfigError each)."""
    if kind not in PREFERENCE_KINDS:
        given = [f"--{k}" for k, v in dataclasses.asdict(options).items() if v is not None]
        if given:
            raise ConfigError(f"{', '.join(given)}: only with --kind preference or unpaired_preference "
                              f"(got --kind {kind})")
        return
    name = options.objective
    if name is not None:
        if name not in FOLDER_OBJECTIVES:
            raise ConfigError(f"--objective {name!r} is not one of {sorted(FOLDER_OBJECTIVES)}")
        if FOLDER_OBJECTIVES[name] != kind:
            raise ConfigError(f"--objective {name} reads --kind {FOLDER_OBJECTIVES[name]} data, not {kind}")
    if options.beta is not None and not options.beta > 0:
        raise ConfigError(f"--beta {options.beta}: must be > 0")
    if options.reference is not None and not os.path.isfile(os.path.join(options.reference, "config.json")):
        raise ConfigError(f"--reference {options.reference}: not a Hugging Face model folder (no config.json)")


def preference_scoring(loaded: Any, kind: str, options: PreferenceOptions, mesh: Any) -> PreferenceScoring:
    """The objective and reference for ``loaded`` (a :class:`~scaletrain.eval.targets.Target` on ``mesh``)."""
    from scaletrain.models.common.score_head import is_sequence_classifier

    if is_sequence_classifier(loaded.model) or options.objective == "reward":
        return _reward_scoring(loaded, kind, options)
    recorded = (loaded.meta or {}).get("objective") if loaded.kind == "run" else None
    if recorded and recorded.get("name") not in {"dpo", "kto", "orpo", "cpo"}:
        recorded = None
    if recorded and options.objective is None:
        objective = _recorded_objective(recorded)
        if options.beta is not None:
            objective = dataclasses.replace(objective, beta=options.beta)
    else:
        from scaletrain.objectives.registry import build_objective

        name = options.objective or _DEFAULT[kind]
        objective = build_objective(name, {} if options.beta is None else {"beta": options.beta})
        recorded = None
    data_kind = "unpaired_preference" if objective.name == "kto" else "preference"
    if data_kind != kind:
        raise ConfigError(f"the objective {objective.name} reads --kind {data_kind} data, not {kind}")
    from scaletrain.training.frozen import needs_reference

    if not needs_reference(objective):
        if options.reference is not None:
            raise ConfigError(f"--reference {options.reference}: the objective {objective.name} reads no reference "
                              "model; drop --reference")
        return PreferenceScoring(objective, {}, None)
    return _with_reference(objective, loaded, options.reference, recorded is not None, mesh)


def _reward_scoring(loaded: Any, kind: str, options: PreferenceOptions) -> PreferenceScoring:
    """A reward model scores pairs by its own scores (``accuracy``, ``margin``): no β, no reference."""
    from scaletrain.models.common.score_head import is_sequence_classifier
    from scaletrain.objectives.reward import RewardObjective

    if not is_sequence_classifier(loaded.model):
        raise ConfigError(f"--objective reward: {loaded.name} is a causal LM, not a reward model (a folder whose "
                          "config.json names a *ForSequenceClassification)")
    given = [f"--{k}" for k in ("beta", "reference") if getattr(options, k) is not None]
    if options.objective not in (None, "reward") or given or kind != "preference":
        raise ConfigError(f"{loaded.name} is a reward model: it scores --kind preference pairs by its own scores; "
                          f"drop {', '.join(given) or '--objective ' + str(options.objective)}"
                          if kind == "preference" else f"{loaded.name} is a reward model: use --kind preference")
    return PreferenceScoring(RewardObjective(), {}, None)


def _recorded_objective(recorded: dict[str, Any]) -> Any:
    """The objective a run's checkpoint recorded (``{"name", field: value}``), lists back to tuples."""
    from scaletrain.objectives.dpo import DPOObjective
    from scaletrain.objectives.kto import KTOObjective
    from scaletrain.objectives.orpo import CPOObjective, ORPOObjective

    cls = {"dpo": DPOObjective, "kto": KTOObjective, "orpo": ORPOObjective, "cpo": CPOObjective}[recorded["name"]]
    names = {f.name for f in dataclasses.fields(cls)}
    keys = {k: tuple(v) if isinstance(v, list) else v for k, v in recorded.items() if k in names}
    keys.pop("reference_source", None)  # set again below, from what this evaluation holds
    return cls(**keys)


def _with_reference(objective: Any, loaded: Any, folder: str | None, own_run: bool, mesh: Any) -> PreferenceScoring:
    from scaletrain.training.frozen import GIVEN_MODULE, POLICY_COPY, default_source, load_reference_folder

    model = loaded.model
    if folder is not None:
        frozen = load_reference_folder(folder, model, mesh)
        return _scoring(objective, "model", frozen, folder)
    record = (loaded.meta or {}).get("reference") if own_run else None
    if own_run and record:  # the run held a reference model: rebuild it, and check it is the one it read
        name = record.get("reference")
        if name == POLICY_COPY:
            frozen, shown = _starting_model(loaded, mesh), "the run's starting model"
        elif isinstance(name, str) and name != GIVEN_MODULE:
            frozen, shown = load_reference_folder(name, model, mesh), name
        else:
            raise ConfigError(f"{loaded.name}: its reference model was given from Python; pass it as --reference DIR")
        _check_digest(frozen, record, loaded.name)
        return _scoring(objective, "model", frozen, shown)
    if default_source(model, None) == "adapters_off":
        return _scoring(objective, "adapters_off", None, "base (adapters off)")
    raise ConfigError(f"--objective {objective.name} scores against a reference model: give --reference DIR (a "
                      "Hugging Face model folder, usually the model before preference training), or --adapter for a "
                      "LoRA adapter (its base with the adapters off), or --objective orpo / simpo (no reference)")


def _scoring(objective: Any, source: str, frozen: Any, shown: str) -> PreferenceScoring:
    objective = dataclasses.replace(objective, reference_source=source)
    return PreferenceScoring(objective, {} if frozen is None else {"reference": frozen}, shown)


def _starting_model(loaded: Any, mesh: Any) -> Any:
    """The run's starting model (its ``model.pretrained`` folder, or its seeded initialisation), frozen on ``mesh``."""
    from scaletrain.recipe import Recipe
    from scaletrain.run import build_model
    from scaletrain.training.frozen import as_frozen

    recipe = (loaded.meta or {}).get("recipe")
    if not recipe:
        raise ConfigError(f"{loaded.name}: its reference was a copy of its starting model, and the checkpoint holds "
                          "no recipe to rebuild it from; pass that model as --reference DIR")
    return as_frozen(build_model(Recipe.from_dict(recipe), loaded.tokenizer), loaded.model, mesh)


def _check_digest(frozen: Any, record: dict[str, Any], name: str) -> None:
    from scaletrain.training.state import params_sha256

    want = record.get("reference_sha256")
    if want and params_sha256(frozen.params) != want:
        raise ConfigError(f"{name}: the reference rebuilt from {record.get('reference')!r} is not the one the run "
                          f"read (sha256 differs from {want[:12]}…); pass the run's reference as --reference DIR")
