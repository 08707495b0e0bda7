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
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=True
        )
        ids = list(out["input_ids"])
    else:
        ids = list(tokenizer(prompt)["input_ids"])
    if not ids:
        raise ConfigError("the prompt encodes to no tokens")
    return ids


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
) -> str:
    """Load an HF folder (and its tokenizer, if saved there) and return the generated continuation.

    Only the new text is returned (decoded without special tokens); generation
    stops at the config's or tokenizer's end-of-sequence token. With ``chat`` the
    prompt is wrapped as one user turn by the tokenizer's chat template. Without a
    tokenizer the prompt is space-separated token ids and so is the result.
    """
    import jax

    from scaletrain.generation import generate
    from scaletrain.models.registry import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=dtype,
        sharding_axis_dims=tuple(sharding_axis_dims) if sharding_axis_dims is not None else None,
    )
    tokenizer = load_local_tokenizer(model_dir)
    ids = _prompt_ids(tokenizer, prompt, chat)
    eos = model.config.eos_token_id
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    mesh = jax.tree.leaves(model)[0].sharding.mesh
    with jax.set_mesh(mesh):
        new = generate(
            model,
            [ids],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            eos_token_id=eos,
        )[0].tolist()
    if tokenizer is None:
        return " ".join(str(t) for t in new)
    return tokenizer.decode(new, skip_special_tokens=True)
