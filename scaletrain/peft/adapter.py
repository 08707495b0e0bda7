"""PEFT adapter folders in and out: ``adapter_config.json`` + ``adapter_model.safetensors``.

Why: a LoRA adapter trained here should load with ``peft.PeftModel.from_pretrained(base,
folder)`` onto the transformers base, and an adapter trained with PEFT should continue
training here. The mapping is mechanical: our ``lora_a`` [in, r] is PEFT's
``base_model.model.<path>.lora_A.weight`` [r, in], ``lora_b`` [r, out] its
``lora_B.weight`` [out, r]; embeddings / norms trained in full are PEFT's
``modules_to_save`` and saved under their HF names (``base_model.model.<hf name>``).
A ``scan_layers`` model's stacked adapters ([L, in, r]) are the L per-layer tensors PEFT
names ``model.layers.<i>.…``, split on the way out and stacked on the way in.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scaletrain.errors import CheckpointError, ConfigError
from scaletrain.key_paths import dotted
from scaletrain.folders import staged
from scaletrain.models.hf import EXPORT_MARKER, hf_tensor_name, prepare_destination, write_marker
from scaletrain.peft.lora import (
    LoRAConfig,
    apply_lora,
    linear_paths,
    lora_config_of,
    split_trainable,
    target_paths,
)
from scaletrain.models.common.scanned_layers import per_layer_names
from scaletrain.parallel.host import to_host

logger = logging.getLogger("scaletrain")

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def peft_target_modules(model: nnx.Module, config: LoRAConfig) -> list[str]:
    """Short names (``q_proj``) when they pick exactly our targets in PEFT too, else the full paths."""
    chosen = target_paths(model, config)
    names = {p.rsplit(".", 1)[-1] for p in chosen}
    same_names = [p for p in linear_paths(model) if p.rsplit(".", 1)[-1] in names]
    return sorted(names) if sorted(same_names) == sorted(chosen) else chosen


def _full_modules(trainable: Any) -> list[str]:
    """The module names (``embed_tokens``, ``norm``, …) whose parameters are trained in full."""
    names = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(trainable)[0]:
        for name, _, _ in _peft_tensors(dotted(path), tuple(leaf.shape)):
            if not name.endswith((".lora_A.weight", ".lora_B.weight")):
                names.add(name.rsplit(".", 2)[-2])
    return sorted(names)


def _peft_tensors(param: str, shape: tuple[int, ...]) -> list[tuple[str, bool, int | None]]:
    """``(PEFT tensor name, transpose?, layer)`` for each tensor our parameter ``param`` holds: one
    (layer None), or one per layer of a ``scan_layers`` stack (layer ``i``: the parameter's ``[i]``)."""
    layers = per_layer_names(param, shape[0]) if shape else None
    if layers is None:
        return [(*expected_name(param), None)]
    return [(*expected_name(name), i) for i, name in enumerate(layers)]


def adapter_tensors(model: nnx.Module) -> dict[str, np.ndarray]:
    """The adapter's tensors under the names PEFT saves, gathered to host, float32."""
    _, trainable, _ = split_trainable(model)
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(trainable)[0]:
        host = np.asarray(to_host(leaf), np.float32)
        for name, transpose, layer in _peft_tensors(dotted(path), tuple(leaf.shape)):
            part = host if layer is None else host[layer]
            out[name] = np.ascontiguousarray(part.T if transpose else part)
    return out


def save_peft_adapter(model: nnx.Module, out_dir: str | os.PathLike, base_model_name_or_path: str | None = None) -> str:
    """Write ``model``'s adapter as a PEFT folder (process 0 writes); returns its path.

    Written as :func:`~scaletrain.models.hf.save_hf_checkpoint` writes a model: in a hidden
    sibling swapped into place when complete, files with the umask's modes, a folder we did
    not write refused, a previous export replaced.
    """
    from safetensors.numpy import save_file

    config = lora_config_of(model)
    if config is None:
        raise ConfigError("this model has no LoRA adapters to export; apply_lora first, or export the full model")
    out_dir = os.path.abspath(os.fspath(out_dir))
    tensors = adapter_tensors(model)  # every process takes part in the gathers
    _, trainable, _ = split_trainable(model)
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.rank, "lora_alpha": config.alpha,
        "lora_dropout": config.dropout, "target_modules": peft_target_modules(model, config),
        "use_rslora": config.rslora, "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True,
        "inference_mode": True, "use_dora": False, "modules_to_save": _full_modules(trainable) or None,
        "base_model_name_or_path": _base_name(base_model_name_or_path or config.base_model),
    }
    prepare_destination(out_dir)
    if jax.process_index() == 0:
        with staged(out_dir, EXPORT_MARKER) as tmp:
            save_file(tensors, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
            with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
                json.dump(adapter_config, f, indent=2, sort_keys=True)
            write_marker(tmp)
    logger.info("wrote a LoRA adapter (%d tensors, rank %d) to %s", len(tensors), config.rank, out_dir)
    return out_dir


def recorded_base(folder: str) -> str | None:
    """The adapter's ``base_model_name_or_path`` (a local folder or a hub name), None if it names none."""
    path = os.path.join(folder, ADAPTER_CONFIG)
    try:
        with open(path) as f:
            return json.load(f).get("base_model_name_or_path") or None
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError(f"{path}: cannot read it as a PEFT adapter config ({err})") from None


def _base_name(base: str | None) -> str | None:
    """A local base folder as an absolute path (the adapter is loaded from anywhere), a hub name as it is."""
    return os.path.abspath(base) if base and os.path.isdir(base) else base


def read_adapter_config(folder: str) -> LoRAConfig:
    """Our LoRAConfig for a PEFT ``adapter_config.json`` (ConfigError for what we cannot train)."""
    path = os.path.join(folder, ADAPTER_CONFIG)
    if not os.path.isfile(path):
        raise ConfigError(f"{path} does not exist; point at a PEFT adapter folder (adapter_config.json + "
                          f"{ADAPTER_WEIGHTS})")
    with open(path) as f:
        raw = json.load(f)
    unsupported = {"peft_type": (raw.get("peft_type", "LORA"), "LORA"), "bias": (raw.get("bias", "none"), "none"),
                   "use_dora": (bool(raw.get("use_dora")), False),
                   "fan_in_fan_out": (bool(raw.get("fan_in_fan_out")), False),
                   "layers_to_transform": (raw.get("layers_to_transform"), None),
                   "rank_pattern": (raw.get("rank_pattern") or None, None),
                   "alpha_pattern": (raw.get("alpha_pattern") or None, None)}
    for key, (have, want) in unsupported.items():
        if have != want:
            raise ConfigError(f"{path}: {key}={have!r} is not supported (only {want!r}); convert the adapter "
                              "with peft first or train a new one")
    if raw.get("lora_dropout"):
        logger.warning("%s: lora_dropout=%s is not applied here (LoRA dropout is not supported yet)", path,
                       raw["lora_dropout"])
    full = set(raw.get("modules_to_save") or ())
    embeddings, norms = {"embed_tokens", "lm_head"}, {n for n in full if n.endswith("norm")}
    if full - embeddings - norms:
        raise ConfigError(f"{path}: modules_to_save {sorted(full - embeddings - norms)} are not supported; only "
                          "embed_tokens, lm_head and norms can be trained in full")
    return LoRAConfig(rank=raw["r"], alpha=raw.get("lora_alpha", 8), target_modules=raw["target_modules"],
                      rslora=bool(raw.get("use_rslora")), train_embeddings=bool(full & embeddings),
                      train_norms=bool(norms), base_model=raw.get("base_model_name_or_path"))


def load_peft_adapter(model: nnx.Module, folder: str | os.PathLike, **overrides: Any) -> nnx.Module:
    """Put the PEFT adapter in ``folder`` onto ``model`` (its base, in place) and return it.

    ``overrides`` are LoRAConfig fields to set on top of the adapter's (``quantize``,
    ``base_dtype``, ``seed``).
    """
    config = read_adapter_config(os.fspath(folder))
    if overrides:
        config = LoRAConfig(**{**config.model_dump(), **overrides})
    apply_lora(model, config)
    return load_adapter_weights(model, folder)


def check_adapter_matches(config: LoRAConfig, folder: str | os.PathLike) -> None:
    """ConfigError unless the adapter in ``folder`` has ``config``'s rank, alpha, targets and full modules."""
    saved = read_adapter_config(os.fspath(folder))
    fields = ("rank", "alpha", "rslora", "train_embeddings", "train_norms")
    differ = [f"{f}={getattr(config, f)!r} (the adapter has {getattr(saved, f)!r})" for f in fields
              if getattr(config, f) != getattr(saved, f)]
    if differ:
        raise ConfigError(f"lora.init_from={folder}: lora.{', lora.'.join(differ)}; set them as the adapter has")


def load_adapter_weights(model: nnx.Module, folder: str | os.PathLike) -> nnx.Module:
    """Copy ``folder``'s adapter tensors into ``model``'s adapters (already applied); returns ``model``.

    Every tensor of the file must find its place and every adapter variable must be in
    the file (so differing targets are caught); a mismatch names the tensor.
    """
    from safetensors.numpy import load_file

    weights_path = os.path.join(os.fspath(folder), ADAPTER_WEIGHTS)
    if not os.path.isfile(weights_path):
        raise ConfigError(f"{weights_path} does not exist (a .bin adapter must be converted to safetensors first)")
    tensors = load_file(weights_path)
    _, trainable, _ = split_trainable(model)
    expected = adapter_tensors_shapes(trainable)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise CheckpointError(f"{weights_path} does not fit this model's adapters: missing {missing[:3]}, "
                              f"unexpected {extra[:3]} (are lora.target_modules the adapter's?)")
    flat, treedef = jax.tree_util.tree_flatten_with_path(trainable)
    leaves = []
    for path, leaf in flat:
        entries = _peft_tensors(dotted(path), tuple(leaf.shape))
        want = tuple(leaf.shape[1:] if entries[0][2] is not None else leaf.shape)  # one layer's shape if stacked
        parts = []
        for name, transpose, _ in entries:
            value = tensors[name].T if transpose else tensors[name]
            if value.shape != want:
                raise CheckpointError(f"{weights_path}: {name} has shape "
                                      f"{value.shape[::-1] if transpose else value.shape}, this model needs "
                                      f"{want[::-1] if transpose else want}")
            parts.append(value)
        value = parts[0] if entries[0][2] is None else np.stack(parts)
        leaves.append(jax.device_put(jnp.asarray(value, leaf.dtype), leaf.sharding))
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, leaves))
    return model


def expected_name(param: str) -> tuple[str, bool]:
    """``(PEFT tensor name, transpose?)`` for one of our trainable parameter paths."""
    if param.endswith((".lora_a", ".lora_b")):
        module, which = param.rsplit(".", 1)
        return f"{PREFIX}{module}.lora_{which[-1].upper()}.weight", True
    hf_name, transpose = hf_tensor_name(param)
    return PREFIX + hf_name, transpose


def adapter_tensors_shapes(trainable: Any) -> dict[str, tuple[int, ...]]:
    """Every PEFT tensor name the adapters ``trainable`` fill, with our (one layer's) shape for it."""
    return {name: tuple(x.shape[0 if layer is None else 1:])
            for p, x in jax.tree_util.tree_flatten_with_path(trainable)[0]
            for name, _, layer in _peft_tensors(dotted(p), tuple(x.shape))}
