"""Hugging Face checkpoints in and out: ``config.json`` + ``model*.safetensors``.

Why this module exists: users fine-tune checkpoints that sit in a local HF folder
and want the result back in that format. Loading builds the model abstractly
(``nnx.eval_shape``), computes every parameter's sharding from the partition rules
and reads the safetensors **one tensor at a time**, each device reading only its
own slice, so no host ever holds the model twice. Saving gathers one tensor at a
time to host and streams shards to disk.

Names mirror transformers, so the mapping is mechanical: our ``Dense.kernel`` is
``[in, out]`` and HF's ``Linear.weight`` is ``[out, in]`` (transpose), our
``model.embed_tokens`` is HF's ``model.embed_tokens.weight``; norms and biases keep
their names. The transformers config classes (a runtime dependency anyway) resolve
defaults and legacy keys (``rope_scaling``/``rope_theta`` vs ``rope_parameters``),
so a config.json means here exactly what it means to transformers.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from scaletrain.errors import CheckpointError, ConfigError
from scaletrain.models.config import LlamaConfig, MistralConfig, Qwen2Config, dtype_name, to_dtype
from scaletrain.parallel.partition import PartitionAxis, shardings_for_state

logger = logging.getLogger("scaletrain")

#: HF ``model_type`` -> HF architecture class name, for the families we implement.
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
ROPE_TYPES = ("default", "linear", "llama3")
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: Written into every export; its presence is what lets a later export replace the folder.
EXPORT_MARKER = "scaletrain_export.json"
# Buffers some older exports carry; they are recomputed, never loaded.
_IGNORED_TENSORS = re.compile(r".*\.rotary_emb\.inv_freq$")


# ---------------------------------------------------------------------------------
# config.json <-> LlamaConfig
# ---------------------------------------------------------------------------------
def read_hf_config(local_dir: str | os.PathLike) -> dict[str, Any]:
    """The raw ``config.json`` of a local HF folder (ConfigError naming the path if unusable)."""
    path = os.path.join(os.fspath(local_dir), CONFIG_FILE)
    if not os.path.isdir(local_dir):
        raise ConfigError(f"{os.fspath(local_dir)}: not a directory; pass a local Hugging Face model folder")
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: missing; a Hugging Face model folder needs config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return raw


def _hf_config_class(model_type: str) -> type:
    import transformers

    return {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
    }[model_type]


def _rope_from_hf(rope: Any, where: str) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from transformers' standardized ``rope_parameters``."""
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        raise ConfigError(f"{where}: rope_parameters {rope!r} (per-layer RoPE) is not supported")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(
            f"{where}: rope type {kind!r} is not supported; supported rope types: {list(ROPE_TYPES)}"
        )
    factor = rope.get("partial_rotary_factor", 1.0)
    if factor not in (None, 1, 1.0):
        raise ConfigError(f"{where}: partial_rotary_factor {factor} is not supported (only 1.0)")
    theta = float(rope["rope_theta"])
    if kind == "default":
        return theta, None
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    scaling["rope_type"] = kind
    return theta, scaling


def config_from_hf(raw: dict[str, Any], where: str = CONFIG_FILE, **runtime: Any) -> LlamaConfig:
    """Our config for an HF ``config.json`` dict; ``runtime`` sets placement fields.

    Raises ConfigError naming the model_type or option we do not implement, rather
    than building a model that would silently compute something else.
    """
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConfigError(
            f"{where}: model_type {model_type!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    if raw.get("quantization_config"):
        raise ConfigError(f"{where}: quantized checkpoints (quantization_config) are not supported; dequantize first")
    hf = _hf_config_class(model_type).from_dict(dict(raw))
    if hf.hidden_act not in ("silu", "swish"):
        raise ConfigError(f"{where}: hidden_act {hf.hidden_act!r} is not supported (only silu)")
    if getattr(hf, "attention_dropout", 0.0):
        logger.warning("%s: attention_dropout=%s is ignored (scaletrain has no dropout)", where, hf.attention_dropout)
    rope_theta, rope_scaling = _rope_from_hf(hf.rope_parameters, where)
    fields: dict[str, Any] = dict(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads or hf.num_attention_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        hidden_act="silu",
        max_position_embeddings=hf.max_position_embeddings,
        initializer_range=hf.initializer_range,
        rms_norm_eps=hf.rms_norm_eps,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        bos_token_id=hf.bos_token_id,
        eos_token_id=hf.eos_token_id,
        pad_token_id=hf.pad_token_id,
    )
    if model_type == "llama":
        fields.update(
            attention_bias=bool(hf.attention_bias), qkv_bias=False, mlp_bias=bool(hf.mlp_bias), sliding_window=None
        )
        config_class: type[LlamaConfig] = LlamaConfig
    elif model_type == "mistral":
        fields.update(attention_bias=False, qkv_bias=False, mlp_bias=False, sliding_window=hf.sliding_window)
        config_class = MistralConfig
    else:
        kinds = set(hf.layer_types or ["full_attention"])
        if not kinds <= {"full_attention", "sliding_attention"} or len(kinds) > 1:
            raise ConfigError(
                f"{where}: per-layer attention types {sorted(kinds)} (use_sliding_window with "
                f"max_window_layers={getattr(hf, 'max_window_layers', None)}) are not supported; "
                "only all-full or all-sliding layers"
            )
        sliding = kinds == {"sliding_attention"} and hf.sliding_window is not None
        fields.update(
            attention_bias=False,
            qkv_bias=True,
            mlp_bias=False,
            use_sliding_window=sliding,
            sliding_window=hf.sliding_window if sliding else None,
        )
        config_class = Qwen2Config
    fields.update({k: v for k, v in runtime.items() if v is not None})
    try:
        return config_class(**fields)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise ConfigError(f"{where}: {exc}") from None


def config_to_hf(config: LlamaConfig, dtype: str) -> Any:
    """A transformers config object for ``config``; ConfigError if HF cannot express it.

    Only architecture keys travel; placement fields (mesh, partition axes, remat,
    attention implementation) are runtime choices of this library.
    """
    model_type = config.model_type
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"model_type {model_type!r} cannot be exported; supported: {sorted(ARCHITECTURES)}")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(config.rope_theta)}
    if config.rope_scaling:
        scaling = dict(config.rope_scaling)
        scaling["rope_type"] = scaling.pop("type", None) or scaling.get("rope_type", "default")
        rope.update(scaling)
    kwargs: dict[str, Any] = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )

    def refuse(what: str) -> ConfigError:
        return ConfigError(f"model_type {model_type!r} with {what} has no Hugging Face equivalent; cannot export")

    if model_type == "llama":
        if config.qkv_bias and not config.attention_bias:
            raise refuse("qkv_bias=True but attention_bias=False")
        if config.sliding_window is not None:
            raise refuse(f"sliding_window={config.sliding_window} (use model_type mistral)")
        kwargs.update(attention_bias=config.attention_bias, mlp_bias=config.mlp_bias)
    elif model_type == "mistral":
        if config.attention_bias or config.qkv_bias or config.mlp_bias:
            raise refuse("attention/qkv/mlp biases")
        kwargs.update(sliding_window=config.sliding_window)
    else:
        if not config.qkv_bias or config.attention_bias or config.mlp_bias:
            raise refuse("biases other than q/k/v")
        sliding = bool(getattr(config, "use_sliding_window", False)) and config.sliding_window is not None
        n = config.num_hidden_layers
        kwargs.update(
            use_sliding_window=sliding,
            sliding_window=config.sliding_window if sliding else None,
            max_window_layers=0 if sliding else n,
            layer_types=["sliding_attention" if sliding else "full_attention"] * n,
        )
    hf = _hf_config_class(model_type)(**kwargs)
    hf.architectures = [ARCHITECTURES[model_type]]
    hf.dtype = dtype
    return hf


# ---------------------------------------------------------------------------------
# parameter names
# ---------------------------------------------------------------------------------
def _path_name(path: tuple[Any, ...]) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


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
        from safetensors import safe_open

        with safe_open(single, framework="numpy") as f:
            return {k: single for k in f.keys()}
    if any(n.endswith((".bin", ".pt", ".pth")) for n in os.listdir(local_dir)):
        raise ConfigError(
            f"{single}: missing; only safetensors weights load (pickled .bin/.pt files are never read)"
        )
    raise ConfigError(f"{single}: missing (and no {INDEX_FILE}); the folder has no safetensors weights")


def _slices(index: tuple[slice, ...], transpose: bool) -> tuple[slice, ...]:
    return tuple(reversed(index)) if transpose else index


def _load_sharded(handle: Any, tensor: str, transpose: bool, target: jax.ShapeDtypeStruct,
                  sharding: NamedSharding) -> jax.Array:
    """Read one tensor from an open safetensors file straight into a sharded array.

    Each addressable device asks for its own index; only that slice is read from
    the memory-mapped file (a small cache serves replicated devices).
    """
    sl = handle.get_slice(tensor)
    shape = tuple(sl.get_shape())
    expect = tuple(reversed(target.shape)) if transpose else tuple(target.shape)
    if shape != expect:
        raise CheckpointError(f"tensor {tensor}: shape {list(shape)} in the checkpoint, the config implies {list(expect)}")
    np_dtype = np.dtype(target.dtype)
    cache: dict[tuple[Any, ...], np.ndarray] = {}

    def read(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in cache:
            part = sl[_slices(index, transpose)] if index else sl[...]
            part = part.T if transpose else part
            cache[key] = np.ascontiguousarray(part.astype(np_dtype, copy=False))
        return cache[key]

    return jax.make_array_from_callback(tuple(target.shape), sharding, read)


def load_hf_checkpoint(
    local_dir: str | os.PathLike,
    *,
    dtype: Any = "float32",
    param_dtype: Any = "float32",
    mesh: Mesh | None = None,
    sharding_axis_dims: tuple[int, ...] | None = None,
    partition_axis: PartitionAxis | dict[str, Any] | None = None,
    precision: Any = None,
    expected_model_type: str | None = None,
) -> nnx.Module:
    """Build our model from a local HF folder, parameters sharded on ``mesh``.

    ``mesh`` defaults to the one ``sharding_axis_dims`` describes (all devices on
    fsdp unless given). Weights are cast to ``param_dtype``; ``dtype`` is the
    compute dtype. Raises ConfigError for a missing file or an unsupported
    model_type/option and CheckpointError for missing or mis-shaped tensors.
    """
    from safetensors import safe_open

    from scaletrain.models.factory import mesh_for_config
    from scaletrain.models.registry import get_modules_by_type

    local_dir = os.fspath(local_dir)
    raw = read_hf_config(local_dir)
    where = os.path.join(local_dir, CONFIG_FILE)
    runtime: dict[str, Any] = {}
    if sharding_axis_dims is not None:
        runtime["sharding_axis_dims"] = tuple(sharding_axis_dims)
    if partition_axis is not None:
        runtime["partition_axis"] = partition_axis
    config = config_from_hf(raw, where, **runtime)
    if expected_model_type is not None and config.model_type != expected_model_type:
        raise ConfigError(
            f"{where}: model_type {config.model_type!r}, but {expected_model_type!r} was asked for; "
            "use scaletrain.AutoModelForCausalLM"
        )
    files = _weight_files(local_dir)
    _, module_class = get_modules_by_type(config.model_type)
    mesh = mesh if mesh is not None else mesh_for_config(config)
    dtype_j, param_dtype_j = to_dtype(dtype), to_dtype(param_dtype)

    def make() -> nnx.Module:
        return module_class(config, dtype=dtype_j, param_dtype=param_dtype_j, precision=precision, rngs=nnx.Rngs(0))

    with jax.set_mesh(mesh):
        graphdef, abstract_state = nnx.split(nnx.eval_shape(make))
    shardings = shardings_for_state(abstract_state, config.partition_axis, mesh)
    targets = nnx.to_pure_dict(abstract_state)

    flat_targets = jax.tree_util.tree_flatten_with_path(targets)[0]
    needed = {_path_name(p): hf_tensor_name(_path_name(p)) for p, _ in flat_targets}
    missing = sorted(hf for hf, _ in needed.values() if hf not in files)
    if missing:
        raise CheckpointError(f"{local_dir}: tensors missing from the checkpoint: {missing[:8]}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    used = {hf for hf, _ in needed.values()}
    extra = sorted(
        t for t in files
        if t not in used and not _IGNORED_TENSORS.match(t) and not (t == "lm_head.weight" and config.tie_word_embeddings)
    )
    if extra:
        raise CheckpointError(
            f"{local_dir}: the checkpoint has tensors that model_type {config.model_type!r} does not use: {extra[:8]}"
        )

    # one file open at a time; tensors are loaded in file order, one at a time
    by_file: dict[str, list[str]] = {}
    for name, (hf, _) in needed.items():
        by_file.setdefault(files[hf], []).append(name)
    flat_shardings = {_path_name(p): s for p, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}
    flat_shapes = {_path_name(p): t for p, t in flat_targets}
    loaded: dict[str, jax.Array] = {}
    for path in sorted(by_file):
        with safe_open(path, framework="numpy") as handle:
            for name in by_file[path]:
                hf, transpose = needed[name]
                loaded[name] = _load_sharded(handle, hf, transpose, flat_shapes[name], flat_shardings[name])
    params = jax.tree_util.tree_map_with_path(lambda p, _: loaded[_path_name(p)], targets)
    return nnx.merge(graphdef, params)


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


def _to_host(x: jax.Array) -> np.ndarray:
    """One tensor on this host (an all-gather when other hosts own parts of it)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _check_destination(out_dir: str) -> None:
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"{out_dir}: exists and is not a directory; choose another export path")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not os.path.isfile(os.path.join(out_dir, EXPORT_MARKER)):
        raise ConfigError(
            f"{out_dir}: not empty and not a previous scaletrain export; refusing to overwrite it. "
            "Choose an empty or new directory."
        )


def _iter_hf_tensors(model: nnx.Module) -> Iterator[tuple[str, jax.Array, bool]]:
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        hf, transpose = hf_tensor_name(_path_name(path))
        yield hf, leaf, transpose


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
    lets a later export replace this one. Everything is written to a sibling
    temporary folder and moved into place at the end, so an interrupted export
    never leaves a half-written checkpoint and a previous export survives until
    the new one is complete. A non-empty folder that is not our export is refused.
    """
    from safetensors.numpy import save_file

    out_dir = os.path.abspath(os.fspath(out_dir))
    _check_destination(out_dir)
    config: LlamaConfig = model.config
    tensors = sorted(_iter_hf_tensors(model), key=lambda t: _layer_sort_key(t[0]))
    dtypes = {jax.numpy.dtype(x.dtype).name for _, x, _ in tensors}
    save_dtype = dtype_name(dtypes.pop()) if len(dtypes) == 1 else "float32"
    hf_config = config_to_hf(config, save_dtype)
    limit = parse_size(max_shard_size)
    by_name = {name: (x, transpose) for name, x, transpose in tensors}
    entries = [(name, int(np.prod(x.shape)) * jax.numpy.dtype(x.dtype).itemsize) for name, x, _ in tensors]
    shards = _plan_shards(entries, limit)
    writer = jax.process_index() == 0

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent) if writer else ""
    try:
        weight_map: dict[str, str] = {}
        for i, names in enumerate(shards):
            fname = SINGLE_FILE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            arrays: dict[str, np.ndarray] = {}
            for name in names:  # gathered one tensor at a time; a shard holds at most `limit` bytes
                x, transpose = by_name[name]
                host = _to_host(x)
                arrays[name] = np.ascontiguousarray(host.T if transpose else host)
                weight_map[name] = fname
            if writer:
                save_file(arrays, os.path.join(tmp, fname), metadata={"format": "pt"})
            del arrays
        if writer:
            _finish_export(tmp, out_dir, config, tokenizer, hf_config, weight_map if len(shards) > 1 else None,
                           sum(n for _, n in entries))
    except BaseException:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if jax.process_count() > 1:  # nobody reads the export before process 0 has moved it into place
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"scaletrain-hf-export:{out_dir}")
    logger.info("exported %s (%d tensor(s) in %d file(s)) to %s", config.model_type, len(tensors), len(shards), out_dir)
    return out_dir


def _finish_export(tmp: str, out_dir: str, config: LlamaConfig, tokenizer: Any, hf_config: Any,
                   weight_map: dict[str, str] | None, total_size: int) -> None:
    """Index, configs, tokenizer and marker into ``tmp``, then move it to ``out_dir``."""
    import scaletrain

    if weight_map is not None:
        with open(os.path.join(tmp, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    hf_config.save_pretrained(tmp)
    _generation_config(config).save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    files = sorted(os.listdir(tmp))
    with open(os.path.join(tmp, EXPORT_MARKER), "w") as f:
        json.dump({"exported_by": "scaletrain", "version": scaletrain.__version__, "files": files}, f, indent=2)
    _replace_dir(tmp, out_dir)


def _generation_config(config: LlamaConfig) -> Any:
    import transformers

    return transformers.GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )


def _replace_dir(new: str, out_dir: str) -> None:
    """Move the finished export into place; a previous export is removed only afterwards."""
    old = None
    if os.path.isdir(out_dir):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=os.path.dirname(out_dir))
        os.rmdir(old)
        os.rename(out_dir, old)
    os.rename(new, out_dir)
    if old is not None:
        shutil.rmtree(old)


# ---------------------------------------------------------------------------------
# the transformers-style entry point
# ---------------------------------------------------------------------------------
class AutoModelForCausalLM:
    """``AutoModelForCausalLM.from_pretrained(local_dir)`` picks the class from config.json's model_type."""

    def __init__(self) -> None:
        raise TypeError("use AutoModelForCausalLM.from_pretrained(local_dir)")

    @staticmethod
    def from_pretrained(
        local_dir: str | os.PathLike,
        *,
        dtype: Any = "float32",
        param_dtype: Any = "float32",
        mesh: Mesh | None = None,
        sharding_axis_dims: tuple[int, ...] | None = None,
        partition_axis: PartitionAxis | dict[str, Any] | None = None,
        precision: Any = None,
    ) -> nnx.Module:
        """Load a local HF folder (no hub access); see :func:`load_hf_checkpoint`."""
        return load_hf_checkpoint(
            local_dir,
            dtype=dtype,
            param_dtype=param_dtype,
            mesh=mesh,
            sharding_axis_dims=sharding_axis_dims,
            partition_axis=partition_axis,
            precision=precision,
        )
