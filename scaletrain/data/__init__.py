"""Data: bundled corpus and tokenizer, text files, packing, and the grain batch pipeline.

Importing this package is cheap: grain, jax and transformers are imported inside the
functions that need them.
"""

from scaletrain.data.corpus import (
    bundled_corpus_names,
    bundled_tokenizer_path,
    load_bundled_corpus,
    read_text_files,
)
from scaletrain.data.collate import collate
from scaletrain.data.packing import PackedRows, first_fit, pack_documents, pack_pieces, split_into_pieces
from scaletrain.data.pipeline import LMSplits, build_lm_splits, make_batch_iterator, steps_per_epoch
from scaletrain.data.tokenizer import load_processor

__all__ = [
    "LMSplits",
    "PackedRows",
    "build_lm_splits",
    "collate",
    "bundled_corpus_names",
    "bundled_tokenizer_path",
    "first_fit",
    "load_bundled_corpus",
    "load_processor",
    "make_batch_iterator",
    "pack_documents",
    "pack_pieces",
    "read_text_files",
    "split_into_pieces",
    "steps_per_epoch",
]
