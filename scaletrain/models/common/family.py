"""Where a family registers itself: ``register(...)``, called once in its package, is the only place
its ``model_type`` is tied to its classes and its config.json mapping.

Why a registry below the families: the lookup by ``(model_type, task)``
(:mod:`scaletrain.models.registry`), the config.json reader and writer
(:mod:`scaletrain.models.hf_config`) and the list of supported types all read the
tables here, so a new family is one folder and one call, with no list to extend
elsewhere. :mod:`scaletrain.models` imports every family package, so the tables are
full wherever a model module is used.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from scaletrain.errors import ConfigError
from scaletrain.models.common.score_head import sequence_classifier
from scaletrain.models.hf_family import HFFamily
from scaletrain.models.task import BASE_MODULE, CAUSAL_LM, SEQUENCE_CLASSIFICATION, TASKS, task_name

#: ``(model_type, task) -> (config class, module class)``
MODULES: dict[tuple[str, str], tuple[type, type]] = {}
#: HF ``model_type`` -> its config.json mapping
FAMILIES: dict[str, HFFamily] = {}
#: HF ``model_type`` -> the HF architecture class name
ARCHITECTURES: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class FamilyConformance:
    """How the conformance suite (``tests/test_families_conformance.py``) checks a family against transformers.

    Why it lives beside the family: registering a family is what puts it under the suite, and the
    tiny configuration that switches on what the family adds is knowledge of the family, so adding
    one touches nothing outside its folder. ``hf``: transformers config overrides on top of the
    suite's tiny base config (``tests/hf_testing.py`` ``TINY``), chosen to exercise what is particular
    to the family (windows shorter than the test rows, biases, tied heads, several experts per token);
    ``load``: keyword arguments of our ``from_pretrained`` (e.g. an ``ep`` mesh); ``variants``: further
    overrides on ``TINY`` checked for logits and the export round trip only; ``lora``: which layers the
    PEFT check adapts ("all-linear" with trained norms, or "attention": q/k/v/o only, where
    transformers' experts are fused tensors PEFT's "all-linear" does not name as ours does);
    ``scan_layers``: False where the family's layer kinds cannot be one stack (Qwen3.5's linear and full
    attention layers hold different parameters): the suite then checks that asking for it is refused
    in one line instead of comparing scanned and unrolled layers.
    """

    hf: dict[str, Any] = dataclasses.field(default_factory=dict)
    load: dict[str, Any] = dataclasses.field(default_factory=dict)
    variants: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    lora: Literal["all-linear", "attention"] = "all-linear"
    scan_layers: bool = True


#: a vision-language HF ``model_type`` -> the text ``model_type`` its folders load as (their language model)
MULTIMODAL: dict[str, str] = {}
#: HF ``model_type`` -> how the conformance suite checks it
CONFORMANCE: dict[str, FamilyConformance] = {}


def register_module(model_type: str, task_type: str, config_class: type, module_class: type) -> None:
    """Register a module class (and its config class) for a model type and task."""
    MODULES[(model_type, task_name(task_type))] = (config_class, module_class)


def register(hf: HFFamily, causal_lm: type, base_module: type | None = None, *,
             conformance: FamilyConformance | None = None, multimodal: tuple[str, ...] = ()) -> None:
    """Register a family: its config.json mapping ``hf`` (which names the config class, whose
    ``model_type`` is the family's), its causal LM (and base module, where EasyDeL names one) and how
    the conformance suite checks it (a family without ``conformance`` fails that suite, saying so).
    Its ``*ForSequenceClassification`` (:mod:`~scaletrain.models.common.score_head`) is registered with it.
    ``multimodal``: vision-language ``model_type`` s whose folders hold this family as their language model
    (:mod:`scaletrain.models.hf_multimodal` loads them as this family)."""
    model_type = hf.model_type
    for module in (causal_lm, base_module):
        if module is not None and module.config_class is not hf.config_class:
            raise TypeError(f"{module.__qualname__}.config_class is not {hf.config_class.__qualname__}")
    FAMILIES[model_type] = hf
    ARCHITECTURES[model_type] = hf.architecture
    if conformance is not None:
        CONFORMANCE[model_type] = conformance
    MULTIMODAL.update({vl_type: model_type for vl_type in multimodal})
    register_module(model_type, CAUSAL_LM, hf.config_class, causal_lm)
    # every family's decoder with a score head (reward and value models): its class is made here, not spelled
    register_module(model_type, SEQUENCE_CLASSIFICATION, hf.config_class, sequence_classifier(causal_lm))
    if base_module is not None:
        register_module(model_type, BASE_MODULE, hf.config_class, base_module)


def get_modules_by_type(model_type: str, task_type: str = CAUSAL_LM) -> tuple[type, type]:
    """The ``(config_class, module_class)`` registered for ``model_type`` and ``task_type``."""
    try:
        key = (model_type, task_name(task_type))
    except ValueError:
        raise ConfigError(f"unknown task_type {task_type!r}; known: {list(TASKS)}") from None
    if key not in MODULES and model_type in MULTIMODAL:
        raise ConfigError(f"model_type {model_type!r} is a vision-language model and training its vision tower is not "
                          f"supported yet; use model_type {MULTIMODAL[model_type]!r} to train its language model "
                          f"(a {model_type} folder loads as that)")
    if key not in MODULES:
        known = sorted({f"{m}/{t}" for m, t in MODULES})
        raise ConfigError(f"unknown model_type/task {model_type!r}/{key[1]}; registered: {known}")
    return MODULES[key]


def registered_model_types() -> list[str]:
    return sorted({m for m, _ in MODULES})


def registered_module_types(module_class: type) -> list[tuple[str, str]]:
    """Every ``(model_type, task)`` ``module_class`` is registered under."""
    return [key for key, (_, cls) in MODULES.items() if cls is module_class]


def family_classes() -> dict[str, type]:
    """Every registered family's public classes by name (its config class and modules): what
    :mod:`scaletrain.models` and the top-level package export, so a new family adds no name by hand."""
    return {cls.__name__: cls for config_class, module in MODULES.values() for cls in (config_class, module)}


__all__: list[Any] = ["ARCHITECTURES", "CONFORMANCE", "FAMILIES", "MODULES", "MULTIMODAL", "FamilyConformance",
                      "family_classes",
                      "get_modules_by_type", "register", "register_module", "registered_model_types",
                      "registered_module_types"]
