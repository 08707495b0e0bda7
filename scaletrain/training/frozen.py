"""The frozen models a run reads: set up from what the objective declares, recorded, checked on resume.

Why one component: a DPO/KTO reference, a GRPO KL reference, and next a distillation teacher
or a reward model are all the same thing, a model the objective reads and never trains. Each
is set up once when the trainer configures its model, its name and a digest of its weights are
recorded in every checkpoint and in ``summary.json`` under the frozen model's name (the base
trainer writes them, ``FrozenModels.records``), and a resumed run is refused when it reads
another one (:meth:`FrozenModels.check`). The trainers only say which frozen model they need.

Choices, by memory cost (the policy's weights counted once):

- a frozen **copy of the starting policy** (default for full fine-tuning): one more copy of the
  weights, no gradients or optimizer moments;
- **another model folder** (``reference: DIR``): loaded like the policy (same mesh, partition
  rules, dtypes), its path and a digest of its weights recorded;
- **a module** given from Python (``ref_model=``), placed on the policy's mesh;
- **LoRA/QLoRA adapters off** (default with LoRA, unless embeddings or norms are trained too):
  the frozen base itself, so no second copy at all;
- **precomputed log-probabilities** (``precompute_ref_log_probs``, ``preference/precompute.py``):
  one pass before training, after which no model is held.

A frozen model lives in ``TrainState.frozen_models[name]`` (or, for GRPO's reference, beside the
state, read by the rollout): passed through the step, never differentiated, never given optimizer
moments, never checkpointed; only its record is.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from scaletrain.errors import CheckpointError, ConfigError
from scaletrain.peft.lora import lora_config_of
from scaletrain.training.state import FrozenModel, params_sha256

POLICY_COPY = "starting policy (copy)"
_CROSS = {"teacher": " (cross-tokenizer distillation is not offered yet)"}
GIVEN_MODULE = "ref_model (given)"


@dataclasses.dataclass(frozen=True)
class FrozenSetup:
    """One frozen model set up: ``source`` ``"model"`` (``model`` holds it) or ``"adapters_off"`` (the policy's
    LoRA base, no copy), and its ``record`` (``{name: label, name_sha256: digest}``; None for adapters off)."""

    name: str
    source: str
    model: FrozenModel | None
    record: dict[str, Any] | None


def set_up(name: str, given: str | nnx.Module | None, policy: nnx.Module, graphdef: Any, params: Any,
           frozen: Any, mesh: Any, dtype: Any = None) -> FrozenSetup:
    """The frozen model ``name`` from ``given`` (a folder, a module, or None: the starting policy) for ``policy``.

    ``graphdef``/``params``/``frozen``: the policy's state (copied for the default). ``dtype``: a folder's
    weights and compute in this dtype (a bf16 teacher beside a float32 student); None: the policy's. Every
    process must call it: the digest is a gather.
    """
    if default_source(policy, given) == "adapters_off":
        return FrozenSetup(name, "adapters_off", None, None)
    if given is None:
        model, label = copy_of(graphdef, params, frozen), POLICY_COPY
    elif isinstance(given, (str, os.PathLike)):
        model, label = load_reference_folder(os.fspath(given), policy, mesh, name, dtype), os.fspath(given)
    elif isinstance(given, nnx.Module):
        model, label = as_frozen(given, policy, mesh, name), GIVEN_MODULE
    else:
        raise ConfigError(f"{name} must be a model folder or a model, got {type(given).__name__}")
    return FrozenSetup(name, "model", model, {name: label, f"{name}_sha256": params_sha256(model.params)})


class FrozenModels:
    """The records of a run's frozen models, by name: what checkpoints and ``summary.json`` hold, what a resume
    checks. A trainer ``declare``s each frozen model its objective reads (recorded as None until set up, e.g.
    adapters off or precomputed: nothing to digest) and ``add``s each one it sets up."""

    def __init__(self) -> None:
        self.records: dict[str, dict[str, Any] | None] = {}

    def declare(self, name: str) -> None:
        self.records.setdefault(name, None)

    def add(self, setup: FrozenSetup) -> FrozenSetup:
        self.records[setup.name] = setup.record
        return setup

    def check(self, saved_meta: Mapping[str, Any], checkpoint: str) -> None:
        """CheckpointError unless the checkpoint's run read the frozen models this run reads (by digest)."""
        for name, current in self.records.items():
            check_frozen(name, saved_meta.get(name), current, checkpoint)


def needs_reference(objective: Any) -> bool:
    """Whether ``objective`` reads reference log-probabilities (DPO, KTO; not ORPO or CPO/SimPO)."""
    return objective.reference_source is not None


def default_source(model: nnx.Module, given: Any) -> str:
    """``"model"`` (a frozen model) or ``"adapters_off"`` for a policy ``model`` and a ``given`` reference.

    Adapters off is the reference only when the adapters are the whole difference from the base:
    a LoRA run that also trains embeddings or norms changes weights the base shares, so it gets a copy.
    """
    lora = lora_config_of(model)
    if given is not None or lora is None:
        return "model"
    return "model" if (lora.train_embeddings or lora.train_norms) else "adapters_off"


def copy_of(graphdef: Any, params: Any, frozen: Any = None) -> FrozenModel:
    """A frozen copy of a state's model (its LoRA base included): new arrays, placed like the originals.

    A copy, not the same arrays: the train step donates the policy's buffers, so a reference that
    shared them would be read after they were overwritten.
    """
    pieces = (params,) if frozen is None else (params, frozen)
    module = nnx.merge(graphdef, *jax.tree.map(jnp.copy, pieces))
    ref_graphdef, ref_params = nnx.split(module)
    return FrozenModel(params=nnx.to_pure_dict(ref_params), graphdef=ref_graphdef)


def load_reference_folder(folder: str, policy: nnx.Module, mesh: Any, name: str = "reference",
                          dtype: Any = None) -> FrozenModel:
    """The Hugging Face model in ``folder``, on the policy's mesh with its partition rules and dtypes (or
    ``dtype`` for both its weights and its compute).

    It must score the policy's tokens: a different vocabulary size is refused, naming the folder and
    ``objective.<name>``."""
    from scaletrain.models.registry import AutoModelForCausalLM

    if not os.path.isdir(folder):
        unset = "leave it unset for a copy of the starting policy" if name == "reference" else "it is required"
        raise ConfigError(f"objective.{name}={folder!r} is not a folder; give a Hugging Face model folder "
                          f"(config.json + safetensors); {unset}")
    cfg = policy.config
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype or policy.dtype, param_dtype=dtype or policy.param_dtype, mesh=mesh,
        partition_axis=cfg.partition_axis, scan_layers=bool(getattr(cfg, "scan_layers", False)))
    if model.config.vocab_size != cfg.vocab_size:
        raise ConfigError(f"objective.{name}={folder!r} has vocab_size {model.config.vocab_size}, the policy "
                          f"{cfg.vocab_size}; the {name} must share the policy's tokenizer{_CROSS.get(name, '')}")
    graphdef, params = nnx.split(model)
    return FrozenModel(params=nnx.to_pure_dict(params), graphdef=graphdef)


def as_frozen(module: nnx.Module, policy: nnx.Module, mesh: Any, name: str = "reference") -> FrozenModel:
    """A frozen model given as a module (``DPOTrainer(ref_model=...)``, ``GKDTrainer(teacher_model=...)``),
    placed on the policy's mesh."""
    from scaletrain.models.factory import place_model

    module, _ = place_model(module, mesh)
    if module.config.vocab_size != policy.config.vocab_size:
        given = "ref_model" if name == "reference" else f"{name}_model"
        raise ConfigError(f"{given} has vocab_size {module.config.vocab_size}, the policy {policy.config.vocab_size}; "
                          f"the {name} must share the policy's tokenizer{_CROSS.get(name, '')}")
    graphdef, params = nnx.split(module)
    return FrozenModel(params=nnx.to_pure_dict(params), graphdef=graphdef)


def check_frozen(name: str, saved: dict[str, Any] | None, current: dict[str, Any] | None, checkpoint: str) -> None:
    """CheckpointError unless the checkpoint's run read the frozen model ``name`` this run reads (or neither had
    one to digest)."""
    if not saved or not current:
        return
    digest = f"{name}_sha256"
    if saved.get(digest) != current.get(digest):
        raise CheckpointError(
            f"checkpoint {checkpoint} was trained against the {name} {saved.get(name)!r} (sha256 "
            f"{str(saved.get(digest))[:12]}…), but this run's {name} {current.get(name)!r} "
            f"differs (sha256 {str(current.get(digest))[:12]}…); resume with the same "
            f"objective.{name}, or train into another output_dir")
