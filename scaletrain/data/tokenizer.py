"""Loading a Hugging Face tokenizer ("processor") from a local folder.

Why a wrapper: runs must work offline and must never execute code shipped with a
checkpoint, so we load only local files with ``trust_remote_code=False``, and turn the
usual failures into a :class:`DataError` that names the folder. ``transformers`` is
imported here, lazily, because it takes seconds to import.
"""

from __future__ import annotations

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
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot load a tokenizer from {path}: {exc}") from exc
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise DataError(f"the tokenizer in {path} has neither a pad nor an eos token; add one")
        logger.warning("tokenizer in %s has no pad token; using eos %r as pad", path, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


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
