"""The reference model of a preference run: which one, built how, recorded and checked on resume.

Choices, by memory cost (the policy's weights counted once):

- a frozen **copy of the starting policy** (default for full fine-tuning): one more copy of the
  weights, no gradients or optimizer moments;
- **another model folder** (``reference: DIR``): loaded like the policy (same mesh, partition
  rules, dtypes), its path and a digest of its weights recorded in every checkpoint and checked
  when the run resumes;
- **LoRA/QLoRA adapters off** (default with LoRA, unless embeddings or norms are trained too):
  the frozen base itself, so no second copy at all;
- **precomputed log-probabilities** (``precompute_ref_log_probs``, ``training/precompute.py``):
  one pass before training, after which no reference model is held.

Reference models live in ``TrainState.frozen_models["reference"]``: passed through the step,
never differentiated, never given optimizer moments, never checkpointed.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from scaletrain.errors import CheckpointError, ConfigError
from scaletrain.peft.lora import lora_config_of
from scaletrain.training.state import FrozenModel, params_sha256

POLICY_COPY = "starting policy (copy)"


def needs_reference(objective: Any) -> bool:
    """Whether ``objective`` reads reference log-probabilities (DPO, KTO; not ORPO or CPO/SimPO)."""
    return hasattr(objective, "reference_source")


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


def load_reference_folder(folder: str, policy: nnx.Module, mesh: Any) -> FrozenModel:
    """The Hugging Face model in ``folder``, on the policy's mesh with its partition rules and dtypes.

    It must score the policy's tokens: a different vocabulary size is refused, naming the folder."""
    from scaletrain.models.registry import AutoModelForCausalLM

    if not os.path.isdir(folder):
        raise ConfigError(f"objective.reference={folder!r} is not a folder; give a Hugging Face model folder "
                          "(config.json + safetensors) or leave it unset for a copy of the starting policy")
    cfg = policy.config
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=policy.dtype, param_dtype=policy.param_dtype, mesh=mesh,
        partition_axis=cfg.partition_axis, scan_layers=bool(getattr(cfg, "scan_layers", False)))
    if model.config.vocab_size != cfg.vocab_size:
        raise ConfigError(f"objective.reference={folder!r} has vocab_size {model.config.vocab_size}, the policy "
                          f"{cfg.vocab_size}; the reference must share the policy's tokenizer")
    graphdef, params = nnx.split(model)
    return FrozenModel(params=nnx.to_pure_dict(params), graphdef=graphdef)


def as_frozen(module: nnx.Module, policy: nnx.Module, mesh: Any) -> FrozenModel:
    """A reference given as a module (``DPOTrainer(ref_model=...)``), placed on the policy's mesh."""
    from scaletrain.models.factory import place_model

    module, _ = place_model(module, mesh)
    if module.config.vocab_size != policy.config.vocab_size:
        raise ConfigError(f"ref_model has vocab_size {module.config.vocab_size}, the policy "
                          f"{policy.config.vocab_size}; the reference must share the policy's tokenizer")
    graphdef, params = nnx.split(module)
    return FrozenModel(params=nnx.to_pure_dict(params), graphdef=graphdef)


def reference_record(name: str, frozen: FrozenModel) -> dict[str, Any]:
    """``{"reference", "reference_sha256"}``: what checkpoints record (every process must call it: a gather)."""
    return {"reference": name, "reference_sha256": params_sha256(frozen.params)}


def check_reference(saved: dict[str, Any] | None, current: dict[str, Any] | None, checkpoint: str) -> None:
    """CheckpointError unless the checkpoint's run read the reference this run reads (or neither had one)."""
    if not saved or not current:
        return
    if saved.get("reference_sha256") != current.get("reference_sha256"):
        raise CheckpointError(
            f"checkpoint {checkpoint} was trained against the reference {saved.get('reference')!r} (sha256 "
            f"{str(saved.get('reference_sha256'))[:12]}…), but this run's reference {current.get('reference')!r} "
            f"differs (sha256 {str(current.get('reference_sha256'))[:12]}…); resume with the same "
            "objective.reference, or train into another output_dir")
