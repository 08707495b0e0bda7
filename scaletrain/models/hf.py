"""Hugging Face weights in and out: ``model*.safetensors`` next to a ``config.json``.

Why this module exists: users fine-tune checkpoints that sit in a local HF folder
and want the result back in that format. Loading builds the model abstractly
(:func:`scaletrain.models.factory.abstract_sharded_model`: shapes and shardings from
the partition rules, nothing allocated) and reads the safetensors **one tensor at a
time**, each device reading only its own slice, so no host ever holds the model
twice. Saving gathers one tensor at a time to host and streams shards to disk.

Names mirror transformers, so the mapping is mechanical: our ``Dense.kernel`` is
``[in, out]`` and HF's ``Linear.weight`` is ``[out, in]`` (transpose), our
``model.embed_tokens`` is HF's ``model.embed_tokens.weight``; norms and biases keep
their names; a mixture of experts' stacked ``[E, in, out]`` kernels are the E per-expert
tensors transformers writes (:mod:`scaletrain.models.hf_experts`). What config.json means
is :mod:`scaletrain.models.hf_config`'s job.
The caller names the module class (the registry's ``AutoModelForCausalLM`` picks it
from the folder's ``model_type``), so this module depends on no model family.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from scaletrain.errors import CheckpointError, ConfigError
from scaletrain.folders import recover, refuse_foreign, staged
from scaletrain.key_paths import dotted
from scaletrain.models.common.config import DecoderConfig, dtype_name
from scaletrain.models.factory import abstract_sharded_model, mesh_for_config
from scaletrain.models.common.mxfp4 import QUANT_METHOD, Mxfp4Source, load_mxfp4, mxfp4_source
from scaletrain.models.hf_experts import expert_tensor_names, read_stacked_block
from scaletrain.models.hf_multimodal import StoredAs, language_model_tensors
from scaletrain.models.common.scanned_layers import per_layer_names
from scaletrain.models.common.score_head import fresh_score, hf_architecture, is_sequence_classifier
from scaletrain.models.hf_config import CONFIG_FILE, config_to_hf, load_hf_config, read_hf_config
from scaletrain.parallel.host import to_host
from scaletrain.parallel.partition import PartitionAxis

logger = logging.getLogger("scaletrain")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: Written into every export; its presence is what lets a later export replace the folder.
EXPORT_MARKER = "scaletrain_export.json"
# Buffers some older exports carry; they are recomputed, never loaded.
_IGNORED_TENSORS = re.compile(r".*\.rotary_emb\.inv_freq$")


# ---------------------------------------------------------------------------------
# parameter names
# ---------------------------------------------------------------------------------
def _path_name(path: tuple[Any, ...]) -> str:
    return dotted(path)


def hf_tensor_name(name: str) -> tuple[str, bool]:
    """``(HF tensor name, transpose?)`` for one of our dotted parameter names."""
    if name == "model.embed_tokens":
        return "model.embed_tokens.weight", False
    if name.endswith(".kernel"):
        return name[: -len(".kernel")] + ".weight", True
    return name, False


def _layer_sort_key(name: str) -> tuple[Any, ...]:
    """HF's natural order: embeddings, layers by number, final norm, head."""
    m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
    if m:
        return (1, int(m.group(1)), m.group(2))
    return (0 if "embed_tokens" in name else 2 if name.startswith("model.") else 3, 0, name)


# ---------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------
def _weight_files(local_dir: str) -> dict[str, str]:
    """HF tensor name -> absolute safetensors file, from the index or the single file."""
    index = os.path.join(local_dir, INDEX_FILE)
    single = os.path.join(local_dir, SINGLE_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(f"{index}: not a safetensors index ({exc!r})") from None
        out = {}
        for tensor, fname in weight_map.items():
            path = os.path.join(local_dir, fname)
            if not os.path.isfile(path):
                raise ConfigError(f"{path}: missing (listed in {index} for {tensor})")
            out[tensor] = path
        return out
    if os.path.isfile(single):
        with open_weights(single) as f:
            return {k: single for k in f.keys()}
    if any(n.endswith((".bin", ".pt", ".pth")) for n in os.listdir(local_dir)):
        raise ConfigError(
            f"{single}: missing; only safetensors weights load (pickled .bin/.pt files are never read)"
        )
    raise ConfigError(f"{single}: missing (and no {INDEX_FILE}); the folder has no safetensors weights")


def open_weights(path: str) -> Any:
    """``safe_open(path)``, or one error naming the file when its header or data is cut short or damaged."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(path, framework="numpy")
    except SafetensorError as err:
        raise CheckpointError(f"{path}: not a complete safetensors file ({err}); it is truncated or corrupt: "
                              "copy or export the model folder again") from None


class Source(NamedTuple):
    """Where one of our parameters is in a checkpoint: its HF tensor, or one per entry of its ``stacked``
    leading axes (experts, layers of a ``scan_layers`` stack, or both), in row-major order."""

    tensors: tuple[str, ...]
    transpose: bool
    stacked: int


def hf_source(name: str, shape: tuple[int, ...], experts_whole: bool = False) -> Source:
    """The :class:`Source` of our parameter ``name`` of ``shape``. ``experts_whole``: the family stores its experts
    as the stacked tensors we hold, under our names (GPT-OSS: ``experts.gate_up_proj`` [E, in, out]), not one
    linear per expert (the config's ``experts_stored_whole``)."""
    layers = per_layer_names(name, shape[0]) if shape else None
    if layers is not None:  # model.layers.stack.<rest>: layer i's tensors are those of model.layers.<i>.<rest>
        each = [hf_source(layer, shape[1:], experts_whole) for layer in layers]
        return Source(tuple(t for s in each for t in s.tensors), each[0].transpose, each[0].stacked + 1)
    experts = expert_tensor_names(name, shape[0]) if shape and not experts_whole else None
    if experts is not None:
        return Source(experts, True, 1)
    hf, transpose = hf_tensor_name(name)
    return Source((hf,), transpose, 0)


def _slices(index: tuple[slice, ...], transpose: bool) -> tuple[slice, ...]:
    return tuple(reversed(index)) if transpose else index


def _load_sharded(handles: dict[str, Any], source: Source, target: jax.ShapeDtypeStruct) -> jax.Array:
    """Read one parameter from open safetensors files (``handles`` by tensor) into ``target``'s sharding.

    ``source.tensors`` is one HF tensor, or one per entry of the parameter's stacked leading axes
    (experts, :mod:`scaletrain.models.hf_experts`; layers, :mod:`scaletrain.models.common.scanned_layers`).
    Each addressable device asks for its own index; only that slice is read from the
    memory-mapped files (a small cache serves replicated devices).
    """
    tensors, transpose, stacked = source
    slices = [handles[t].get_slice(t) for t in tensors]
    per_tensor = tuple(target.shape[stacked:])
    expect = tuple(reversed(per_tensor)) if transpose else per_tensor
    for tensor, sl in zip(tensors, slices):
        shape = tuple(sl.get_shape())
        if shape != expect:
            raise CheckpointError(f"tensor {tensor}: shape {list(shape)} in the checkpoint, the config implies "
                                  f"{list(expect)}")
    np_dtype = np.dtype(target.dtype)
    cache: dict[tuple[Any, ...], np.ndarray] = {}

    def read(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in cache:
            if stacked:
                part = read_stacked_block(slices, index, tuple(target.shape), transpose, stacked)
            else:
                part = slices[0][_slices(index, transpose)] if index else slices[0][...]
                part = part.T if transpose else part
            cache[key] = np.ascontiguousarray(part.astype(np_dtype, copy=False))
        return cache[key]

    return jax.make_array_from_callback(tuple(target.shape), target.sharding, read)


def load_hf_checkpoint(
    local_dir: str | os.PathLike,
    module_class: type,
    *,
    dtype: Any = "float32",
    param_dtype: Any = "float32",
    mesh: Mesh | None = None,
    sharding_axis_dims: tuple[int, ...] | None = None,
    partition_axis: PartitionAxis | dict[str, Any] | None = None,
    precision: Any = None,
    scan_layers: bool = False,
) -> nnx.Module:
    """Build ``module_class`` from a local HF folder, parameters sharded on ``mesh``.

    The folder's ``model_type`` must be ``module_class._model_type`` (use
    ``AutoModelForCausalLM`` to pick the class from the folder). ``mesh`` defaults to
    the one ``sharding_axis_dims`` describes (all devices on fsdp unless given).
    Weights are cast to ``param_dtype``; ``dtype`` is the compute dtype. ``scan_layers`` reads the
    per-layer tensors into one stack per parameter (``model.scan_layers``). Raises
    ConfigError for a missing file or an unsupported model_type/option and
    CheckpointError for missing or mis-shaped tensors.
    """
    local_dir = os.fspath(local_dir)
    config = load_hf_config(local_dir, sharding_axis_dims, partition_axis)
    if scan_layers:
        try:
            config.scan_layers = True
        except ValueError as exc:
            raise ConfigError(f"{os.path.join(local_dir, CONFIG_FILE)}: {exc}") from None
    expected = getattr(module_class, "_model_type", None)
    if expected is not None and config.model_type != expected:
        raise ConfigError(
            f"{os.path.join(local_dir, CONFIG_FILE)}: model_type {config.model_type!r}, but {expected!r} was "
            "asked for; use scaletrain.AutoModelForCausalLM"
        )
    files, stored = language_model_tensors(_weight_files(local_dir), local_dir)
    mesh = mesh if mesh is not None else mesh_for_config(config)
    graphdef, targets = abstract_sharded_model(module_class, config, dtype=dtype, param_dtype=param_dtype,
                                               precision=precision, mesh=mesh)
    quantization = read_hf_config(local_dir).get("quantization_config") or {}
    mxfp4 = quantization.get("quant_method") == QUANT_METHOD  # config_from_hf let only a family that reads it by
    flat = {_path_name(p): t for p, t in jax.tree_util.tree_flatten_with_path(targets)[0]}
    fresh = fresh_score(module_class, files, flat, config.initializer_range, local_dir)  # a causal folder's head
    needed = _needed_tensors(targets, files, config, local_dir, mxfp4, is_sequence_classifier(module_class))
    needed = {name: source for name, source in needed.items() if name not in fresh}
    if mxfp4:
        logger.info("%s: MXFP4 experts dequantised to %s on load; an export writes them unquantised, without "
                    "quantization_config", local_dir, dtype_name(param_dtype))
    return nnx.merge(graphdef, _read_tensors(targets, needed, files, stored, fresh))


def _needed_tensors(targets: Any, files: dict[str, str], config: DecoderConfig, local_dir: str,
                    mxfp4: bool = False, score_head: bool = False) -> dict[str, Source | Mxfp4Source]:
    """Our parameter name -> its :class:`Source` (an :class:`Mxfp4Source` for a tensor an ``mxfp4`` folder stores
    as blocks and scales); CheckpointError if the files lack a tensor or hold one this model_type does not use."""
    flat = jax.tree_util.tree_flatten_with_path(targets)[0]
    whole = getattr(config, "experts_stored_whole", False)
    needed: dict[str, Source | Mxfp4Source] = {
        _path_name(p): hf_source(_path_name(p), tuple(t.shape), whole) for p, t in flat}
    if mxfp4:
        needed = {name: (mxfp4_source(s.tensors, s.stacked, files) or s)
                  if any(t not in files for t in s.tensors) else s for name, s in needed.items()}
    used = {hf for source in needed.values() for hf in source.tensors}
    missing = sorted(hf for hf in used if hf not in files and not (score_head and hf == "score.weight"))
    if missing:
        raise CheckpointError(f"{local_dir}: tensors missing from the checkpoint: {missing[:8]}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    extra = sorted(
        t for t in files
        if t not in used and not _IGNORED_TENSORS.match(t) and not (t == "lm_head.weight" and (config.tie_word_embeddings or score_head))
    )
    # tensors the family declares unused (DeepSeek-V3's multi-token-prediction layers), left out as transformers does
    ignored = getattr(config, "ignored_tensor", None)
    left_out = [t for t in extra if ignored is not None and ignored(t)]
    if left_out:
        logger.warning("%s: %d tensors of layers scaletrain does not compute are left out (%s ...)", local_dir,
                       len(left_out), left_out[0])
        extra = [t for t in extra if t not in set(left_out)]
    if extra:
        raise CheckpointError(
            f"{local_dir}: the checkpoint has tensors that model_type {config.model_type!r} does not use: {extra[:8]}"
        )
    return needed


def _read_tensors(targets: Any, needed: dict[str, Source | Mxfp4Source], files: dict[str, str],
                  stored: dict[str, str] | None = None, fresh: dict[str, jax.Array] | None = None) -> Any:
    """``targets`` with every ``jax.ShapeDtypeStruct`` replaced by its tensor, sharded as it says
    (``stored``: the name a tensor has in the file where it differs, a vision-language checkpoint's).

    Tensors are loaded in file order, one at a time, with the files each needs open (one,
    or the few a stacked expert kernel's experts are spread over).
    """
    by_files: dict[tuple[str, ...], list[str]] = {}
    for name, source in needed.items():
        by_files.setdefault(tuple(sorted({files[t] for t in source.tensors})), []).append(name)
    flat_targets = {_path_name(p): t for p, t in jax.tree_util.tree_flatten_with_path(targets)[0]}
    loaded: dict[str, jax.Array] = dict(fresh or {})  # parameters made here, not read (a new score head)
    for paths in sorted(by_files):
        with contextlib.ExitStack() as stack:
            handles = {path: stack.enter_context(open_weights(path)) for path in paths}
            for name in by_files[paths]:
                source = needed[name]
                by_tensor = {t: StoredAs(handles[files[t]], stored[t]) if stored and t in stored else handles[files[t]]
                             for t in source.tensors}
                loaded[name] = (load_mxfp4(by_tensor, source, flat_targets[name], files)
                                if isinstance(source, Mxfp4Source) else
                                _load_sharded(by_tensor, source, flat_targets[name]))
    return jax.tree_util.tree_map_with_path(lambda p, _: loaded[_path_name(p)], targets)


# ---------------------------------------------------------------------------------
# saving
# ---------------------------------------------------------------------------------
def parse_size(size: int | str) -> int:
    """Bytes in ``"2GB"``, ``"500MB"``, ``"1GiB"`` or an int (decimal units, as transformers)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ConfigError(f"max_shard_size {size!r}: use bytes or a size such as '2GB' or '500MB'")
    base = 1024 if m.group(3) else 1000
    power = " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * base**power)


def _plan_shards(entries: list[tuple[str, int]], limit: int) -> list[list[str]]:
    """Group tensors, in order, into shards of at most ``limit`` bytes (a larger tensor stands alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in entries:
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def prepare_destination(out_dir: str) -> None:
    """Clean up after an export to ``out_dir`` that was killed (:func:`scaletrain.folders.recover`), then
    refuse a path that is not a directory or is a non-empty folder we did not write."""
    if jax.process_index() == 0:
        recover(out_dir, EXPORT_MARKER)
    refuse_foreign(out_dir, EXPORT_MARKER)


def _iter_hf_tensors(model: nnx.Module) -> Iterator[tuple[str, jax.Array, bool]]:
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    whole = getattr(model.config, "experts_stored_whole", False)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        source = hf_source(_path_name(path), tuple(leaf.shape), whole)
        for e, hf in enumerate(source.tensors):
            yield hf, (leaf[np.unravel_index(e, leaf.shape[:source.stacked])] if source.stacked else leaf), \
                source.transpose


def save_hf_checkpoint(
    model: nnx.Module,
    out_dir: str | os.PathLike,
    tokenizer: Any = None,
    max_shard_size: int | str = "2GB",
) -> str:
    """Write ``model`` as a transformers-loadable folder; returns ``out_dir``.

    Files: config.json, generation_config.json, model.safetensors (or
    model-0000i-of-0000n.safetensors + model.safetensors.index.json above
    ``max_shard_size``), the tokenizer's files when given, and a small marker that
    lets a later export replace this one. Everything is written to a hidden sibling
    folder and swapped into place at the end (:mod:`scaletrain.folders`), so the path
    holds the previous export or the complete new one, never a half-written folder,
    and leftovers of a killed export are cleaned up here first. Files get the umask's
    modes. A non-empty folder that is not our export is refused.
    """
    from safetensors.numpy import save_file

    out_dir = os.path.abspath(os.fspath(out_dir))
    prepare_destination(out_dir)
    config: DecoderConfig = model.config
    tensors = sorted(_iter_hf_tensors(model), key=lambda t: _layer_sort_key(t[0]))
    dtypes = {jax.numpy.dtype(x.dtype).name for _, x, _ in tensors}
    save_dtype = dtype_name(dtypes.pop()) if len(dtypes) == 1 else "float32"
    hf_config = config_to_hf(config, save_dtype)
    if is_sequence_classifier(model):  # transformers' *ForSequenceClassification with one label
        hf_config.architectures, hf_config.num_labels = [hf_architecture(hf_config.architectures[0])], 1
    limit = parse_size(max_shard_size)
    by_name = {name: (x, transpose) for name, x, transpose in tensors}
    entries = [(name, int(np.prod(x.shape)) * jax.numpy.dtype(x.dtype).itemsize) for name, x, _ in tensors]
    shards = _plan_shards(entries, limit)
    writer = jax.process_index() == 0

    with staged(out_dir, EXPORT_MARKER) if writer else contextlib.nullcontext("") as tmp:
        weight_map: dict[str, str] = {}
        for i, names in enumerate(shards):
            fname = SINGLE_FILE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            arrays: dict[str, np.ndarray] = {}
            for name in names:  # gathered one tensor at a time; a shard holds at most `limit` bytes
                x, transpose = by_name[name]
                host = to_host(x)
                arrays[name] = np.ascontiguousarray(host.T if transpose else host)
                weight_map[name] = fname
            if writer:
                save_file(arrays, os.path.join(tmp, fname), metadata={"format": "pt"})
            del arrays
        if writer:
            _finish_export(tmp, config, tokenizer, hf_config, weight_map if len(shards) > 1 else None,
                           sum(n for _, n in entries))
    if jax.process_count() > 1:  # nobody reads the export before process 0 has moved it into place
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"scaletrain-hf-export:{out_dir}")
    logger.info("exported %s (%d tensor(s) in %d file(s)) to %s", config.model_type, len(tensors), len(shards), out_dir)
    return out_dir


def _finish_export(tmp: str, config: DecoderConfig, tokenizer: Any, hf_config: Any,
                   weight_map: dict[str, str] | None, total_size: int) -> None:
    """Index, configs, tokenizer and, last, the marker into ``tmp`` (then installed at the export path)."""
    if weight_map is not None:
        with open(os.path.join(tmp, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    hf_config.save_pretrained(tmp)
    _generation_config(config).save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    write_marker(tmp)


def write_marker(folder: str) -> None:
    """Mark ``folder`` as a complete scaletrain export (written last: recovery trusts only marked folders)."""
    import scaletrain

    files = sorted(os.listdir(folder))
    with open(os.path.join(folder, EXPORT_MARKER), "w") as f:
        json.dump({"exported_by": "scaletrain", "version": scaletrain.__version__, "files": files}, f, indent=2)


def _generation_config(config: DecoderConfig) -> Any:
    import transformers

    return transformers.GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
