"""Loading a Hugging Face tokenizer ("processor") from a local folder.

Why a wrapper: runs must work offline and must never execute code shipped with a
checkpoint, so we load only local files with ``trust_remote_code=False``, and turn the
usual failures into a :class:`DataError` that names the folder. ``transformers`` is
imported here, lazily, because it takes seconds to import.

A folder that names no model (no ``config.json``) and whose ``tokenizer_config.json`` names the
plain fast class (``TokenizersBackend``, alias ``PreTrainedTokenizerFast``), as the bundled
tokenizer and every tokenizer trained with the ``tokenizers`` library and saved by transformers
do, is loaded with that class directly: it is the class and the call ``AutoTokenizer`` ends in for
such a folder, and it skips ``AutoTokenizer``'s import of the model configurations, which imports
torch (~1.7 s of CPU in every process that starts a run, measured; tests/test_tokenizer_loading.py).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from scaletrain.errors import DataError

logger = logging.getLogger(__name__)


def load_processor(path: str) -> Any:
    """Load the fast tokenizer in ``path``; use eos as pad when it has no pad token.

    The eos fallback is what EasyDeL and the HF Trainer recipes do; it is logged as a
    warning because padding positions then look like document ends to the model
    (scaletrain masks them by segment id, so training is unaffected).
    """
    if not os.path.isdir(path):
        raise DataError(f"tokenizer folder not found: {path}")
    try:
        if names_the_plain_fast_class(path):
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot load a tokenizer from {path}: {exc}") from exc
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise DataError(f"the tokenizer in {path} has neither a pad nor an eos token; add one")
        logger.warning("tokenizer in %s has no pad token; using eos %r as pad", path, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


#: what ``tokenizer_class`` says in a folder saved from transformers' plain fast tokenizer (5.x; 4.x)
PLAIN_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def names_the_plain_fast_class(path: str) -> bool:
    """True when ``AutoTokenizer`` would load ``path`` as the plain fast class: no model config to take a
    tokenizer class or a family's correction from, a ``tokenizer.json``, and a tokenizer config that names
    the plain class and no remote code (``auto_map``). Anything else goes through ``AutoTokenizer``."""
    if os.path.exists(os.path.join(path, "config.json")) or not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return False
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("tokenizer_class") in PLAIN_FAST_CLASSES and "auto_map" not in config


def plain_backend(tokenizer: Any) -> Any:
    """The Rust ``tokenizers.Tokenizer`` behind a fast tokenizer, without truncation or padding.

    Why: calling the backend's ``encode_batch`` directly runs on all cores and skips
    the per-token Python conversions of ``__call__``. A backend left configured by an
    earlier padded call (``padding="max_length"``) is copied and reset rather than
    changed in place. Returns None for a slow (pure Python) tokenizer.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    if backend.truncation is not None or backend.padding is not None:
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(backend.to_str())
        backend.no_truncation()
        backend.no_padding()
    return backend


def pad_id_of(tokenizer: Any) -> int:
    """The id that fills padding slots of packed rows: the tokenizer's pad, else its eos, else 0.

    One rule for pre-training and chat rows alike. The value never reaches the loss
    (padding has segment id 0); it only has to be a valid token id, and matching the
    tokenizer's own pad keeps exported batches readable.
    """
    pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None:
        pad_id = getattr(tokenizer, "eos_token_id", None)
    return int(pad_id if pad_id is not None else 0)
