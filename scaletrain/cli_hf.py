"""Plain functions behind the Hugging Face commands of the CLI (the CLI parses, these do the work).

Kept apart from ``cli.py`` so they are callable and testable without argument
parsing, and so ``scaletrain --help`` never imports JAX or transformers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from scaletrain.errors import ConfigError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_local_tokenizer(model_dir: str) -> Any | None:
    """The tokenizer saved in ``model_dir`` (local files only, no remote code), or None if it has none."""
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES):
        return None
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)


def _prompt_ids(tokenizer: Any | None, prompt: str, chat: bool) -> list[int]:
    if tokenizer is None:
        try:
            ids = [int(t) for t in prompt.split()]
        except ValueError:
            raise ConfigError(
                "the model folder has no tokenizer: give the prompt as space-separated token ids"
            ) from None
        if not ids:
            raise ConfigError("the prompt is empty")
        return ids
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("chat=True but the model folder's tokenizer has no chat template")
        from scaletrain.data.chat_templates import apply_chat_template

        out = apply_chat_template(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_dict=True)
        ids = list(out["input_ids"])
    else:
        ids = list(tokenizer(prompt)["input_ids"])
    if not ids:
        raise ConfigError("the prompt encodes to no tokens")
    return ids


def load_adapter_model(adapter_dir: str, sharding_axis_dims: Sequence[int] | None,
                       dtype: str) -> tuple[Any, Any | None]:
    """``(model, tokenizer)`` for a PEFT adapter folder: its base, from ``base_model_name_or_path``, with the
    adapter applied unmerged (as training ran it), and the adapter's tokenizer or else the base's.

    Why: ``scaletrain export`` writes a LoRA run as such a folder, and its user points ``generate``
    at what export printed. The base must be a local folder: nothing is downloaded.
    """
    from scaletrain.peft.adapter import ADAPTER_CONFIG, load_peft_adapter, recorded_base
    from scaletrain.models.registry import AutoModelForCausalLM

    config_path = os.path.join(adapter_dir, ADAPTER_CONFIG)
    base = recorded_base(adapter_dir)
    if base is None:
        raise ConfigError(f"{config_path}: base_model_name_or_path is not set; set it to the base model's local "
                          "folder (the one the adapter was trained on)")
    if not os.path.isfile(os.path.join(base, "config.json")):
        raise ConfigError(f"{config_path}: base_model_name_or_path {base!r} is not a local Hugging Face model "
                          "folder (no config.json; nothing is downloaded); set it to the base model's folder")
    model = AutoModelForCausalLM.from_pretrained(
        base, dtype=dtype, sharding_axis_dims=tuple(sharding_axis_dims) if sharding_axis_dims is not None else None)
    model = load_peft_adapter(model, adapter_dir)
    return model, load_local_tokenizer(adapter_dir) or load_local_tokenizer(base)


def load_run_model(run_dir: str, sharding_axis_dims: Sequence[int] | None, dtype: str,
                   step: int | None = None) -> tuple[Any, Any | None]:
    """``(model, tokenizer)`` from checkpoint ``step`` (default: the newest) of a training run (or a step folder).

    Why: right after ``scaletrain train`` a user points ``generate`` at the run folder;
    loading its checkpoint directly spares an export. A folder that is neither an HF
    folder nor a run with a complete checkpoint gets one message saying what to pass.
    """
    from scaletrain.errors import CheckpointError
    from scaletrain.export import load_checkpoint_model, tokenizer_for
    from scaletrain.training.checkpoint import resolve_checkpoint

    if not os.path.isdir(run_dir):
        raise ConfigError(f"{run_dir}: not a directory; pass a Hugging Face model folder or a training run folder")
    try:
        resolve_checkpoint(run_dir)
    except CheckpointError as err:
        is_run = any(os.path.exists(os.path.join(run_dir, f)) for f in ("recipe.yaml", "metrics.jsonl", "checkpoints"))
        what = f"{run_dir} is a training run with no complete checkpoint ({err})" if is_run else (
            f"{run_dir} is neither a Hugging Face model folder (no config.json) nor a training run with checkpoints")
        raise ConfigError(f"{what}; pass a folder written by `scaletrain export RUN_DIR --out OUT`, or a run "
                          "whose training saved a checkpoint (training.save_at_end, the default)") from None
    overrides = {"sharding_axis_dims": tuple(sharding_axis_dims)} if sharding_axis_dims is not None else None
    model, meta = load_checkpoint_model(run_dir, step, config_overrides=overrides, dtype=dtype)
    # a run without a recipe (a Trainer driven from Python) does not record its tokenizer: ids in, ids out
    return model, tokenizer_for(meta) if meta.get("recipe") else None


#: a prompt of a prompts file: text, or a conversation (a list of ``{"role", "content"}`` messages)
Prompt = str | list[dict[str, Any]]


def read_prompts(path: str) -> list[Prompt]:
    """The prompts of ``path``: JSONL rows with ``prompt`` (text or messages) or ``messages`` for ``.jsonl`` /
    ``.json`` files, else one prompt a line (blank lines skipped). A bad line is one ConfigError naming it."""
    import json

    if not os.path.isfile(path):
        raise ConfigError(f"--prompts {path}: no such file")
    with open(path, encoding="utf-8") as f:
        lines = [(n, line.rstrip("\r\n")) for n, line in enumerate(f, start=1) if line.strip()]
    if not path.endswith((".jsonl", ".json")):
        prompts: list[Prompt] = [line for _, line in lines]
    else:
        prompts = []
        for n, line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path} (line {n}): not valid JSON ({exc})") from None
            value = row.get("messages", row.get("prompt")) if isinstance(row, dict) else None
            if not (isinstance(value, str) or (isinstance(value, list) and value and
                                               all(isinstance(m, dict) and "role" in m for m in value))):
                raise ConfigError(f"{path} (line {n}): give a 'prompt' (text or a list of messages) or 'messages' "
                                  "(a list of {\"role\", \"content\"})")
            prompts.append(value)
    if not prompts:
        raise ConfigError(f"--prompts {path}: holds no prompt")
    return prompts


def load_for_generation(model_dir: str, sharding_axis_dims: Sequence[int] | None = None, dtype: str = "float32",
                        step: int | None = None) -> tuple[Any, Any | None]:
    """``(model, tokenizer or None)`` of an HF folder, a PEFT adapter folder or a training run (step ``step``)."""
    from scaletrain.models.registry import AutoModelForCausalLM
    from scaletrain.peft.adapter import ADAPTER_CONFIG

    is_hf, is_adapter = (os.path.isfile(os.path.join(model_dir, f)) for f in ("config.json", ADAPTER_CONFIG))
    if step is not None and (is_hf or is_adapter):
        raise ConfigError(f"--checkpoint {step}: {model_dir} is an exported "
                          f"{'model' if is_hf else 'adapter'} folder, not a training run; drop --checkpoint")
    if is_hf:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir,
            dtype=dtype,
            sharding_axis_dims=tuple(sharding_axis_dims) if sharding_axis_dims is not None else None,
        )
        return model, load_local_tokenizer(model_dir)
    if is_adapter:
        return load_adapter_model(model_dir, sharding_axis_dims, dtype)
    return load_run_model(model_dir, sharding_axis_dims, dtype, step)


def continue_prompts(model: Any, tokenizer: Any | None, prompts: Sequence[Prompt], *, max_new_tokens: int = 64,
                     temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                     chat: bool = False, batch_size: int = 16) -> list[str]:
    """The new text of each prompt, ``batch_size`` prompts per call of the rollout engine, in order.

    A text prompt is wrapped as a user turn with ``chat``; a conversation always goes through the chat
    template (with the generation prompt). Greedy decoding gives each prompt what it gets alone; a
    sampled prompt's draws depend on ``seed`` and its row in its batch.
    """
    import jax

    from scaletrain.generation import generate, stop_token_ids, until_stop

    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size}: must be >= 1")
    ids = [_conversation_ids(tokenizer, p) if isinstance(p, list) else _prompt_ids(tokenizer, p, chat)
           for p in prompts]
    eos = stop_token_ids(tokenizer, model.config.eos_token_id)
    mesh = jax.tree.leaves(model)[0].sharding.mesh
    out: list[str] = []
    with jax.set_mesh(mesh):
        for lo in range(0, len(ids), batch_size):
            rows = generate(model, ids[lo: lo + batch_size], max_new_tokens=max_new_tokens, temperature=temperature,
                            top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos)
            for new in rows.tolist():
                if tokenizer is None:  # ids out, through the stop id (the padding after it dropped)
                    kept = until_stop(new, eos)
                    out.append(" ".join(str(t) for t in new[: len(kept) + 1]))
                else:
                    out.append(tokenizer.decode(until_stop(new, eos), skip_special_tokens=True))
    return out


def _conversation_ids(tokenizer: Any | None, messages: list[dict[str, Any]]) -> list[int]:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ConfigError("a prompt given as messages needs a tokenizer with a chat template beside the model")
    from scaletrain.data.chat_templates import apply_chat_template

    return list(apply_chat_template(tokenizer, messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def generate_main(
    model_dir: str,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    chat: bool = False,
    sharding_axis_dims: Sequence[int] | None = None,
    dtype: str = "float32",
    step: int | None = None,
) -> str:
    """Load an HF folder (and its tokenizer, if saved there) and return the generated continuation.

    ``model_dir`` may also be a PEFT adapter folder (its base with the adapter unmerged,
    :func:`load_adapter_model`) or a training run folder (or one checkpoint step folder):
    checkpoint ``step`` (default: the newest) and the run's tokenizer are loaded
    (:func:`load_run_model`).

    Only the new text is returned (decoded without special tokens); generation
    stops at the config's or tokenizer's end-of-sequence token or the chat template's
    end-of-turn token (:func:`scaletrain.generation.stop_token_ids`). With ``chat`` the
    prompt is wrapped as one user turn by the tokenizer's chat template. Without a
    tokenizer the prompt is space-separated token ids and so is the result. Several
    prompts, the model loaded once: :func:`load_for_generation` then :func:`continue_prompts`.
    """
    model, tokenizer = load_for_generation(model_dir, sharding_axis_dims, dtype, step)
    return continue_prompts(model, tokenizer, [prompt], max_new_tokens=max_new_tokens, temperature=temperature,
                            top_k=top_k, top_p=top_p, seed=seed, chat=chat)[0]
