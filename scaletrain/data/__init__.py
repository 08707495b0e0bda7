"""Data: sources, tokenizers, chat SFT encoding, packing and splits (offline), the grain loader (online).

Importing this package is cheap: grain, jax, pyarrow, datasets and transformers are
imported inside the functions that need them.
"""

from scaletrain._lazy import lazy_exports
from scaletrain.data.build import build_datasets
from scaletrain.data.chat import ChatEncoder, build_chat_splits, encode_chat
from scaletrain.data.collate import collate
from scaletrain.data.corpus import (
    bundled_corpus_names,
    bundled_tokenizer_path,
    load_bundled_corpus,
    read_text_files,
)
from scaletrain.data.loader import as_source_or_rows, make_batch_iterator, steps_per_epoch
from scaletrain.data.mixture import MixtureRows, mix_rows
from scaletrain.data.packing import PackedRows, first_fit, pack_documents, pack_pieces, split_into_pieces
from scaletrain.data.prepared import prepare_tokenizer, resolve_tokenizer_path
from scaletrain.data.records import ROLES, BadRows, check_messages, iter_conversations, iter_texts
from scaletrain.data.sources import SourceRow, iter_source
from scaletrain.data.splits import LMSplits, build_lm_splits
from scaletrain.data.table import FixedRows
from scaletrain.data.tokenizer import load_processor

__all__ = [
    "BadRows",
    "ChatEncoder",
    "FixedRows",
    "LMSplits",
    "MixtureRows",
    "PackedRows",
    "ROLES",
    "SourceRow",
    "as_source_or_rows",
    "build_chat_splits",
    "build_datasets",
    "build_lm_splits",
    "bundled_corpus_names",
    "bundled_tokenizer_path",
    "check_messages",
    "collate",
    "encode_chat",
    "extract_column_names",
    "first_fit",
    "iter_conversations",
    "iter_source",
    "iter_texts",
    "load_bundled_corpus",
    "load_processor",
    "make_batch_iterator",
    "mix_rows",
    "pack_documents",
    "pack_pieces",
    "prepare_tokenizer",
    "process_messages_data",
    "process_sample_data",
    "read_text_files",
    "resolve_tokenizer_path",
    "split_into_pieces",
    "steps_per_epoch",
]

# EasyDeL's per-example processing (no loss mask), kept under its old names: it lives in the compatibility layer
_COMPAT = {name: "scaletrain.compat.easydel.processing"
           for name in ("extract_column_names", "process_messages_data", "process_sample_data")}
__getattr__, __dir__ = lazy_exports("scaletrain.data", _COMPAT, globals())
