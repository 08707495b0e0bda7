"""Text sources: the corpus shipped with scaletrain, and the user's own text files.

Why a bundled corpus: no dataset hub is reachable where scaletrain is tested, so the
examples and tests train on public-domain Shakespeare shipped inside the package
(built by ``scripts/build_assets.py``).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from pathlib import Path

from scaletrain.errors import DataError

_ASSETS = Path(__file__).resolve().parent.parent / "assets"


def bundled_corpus_names() -> list[str]:
    """Names accepted by :func:`load_bundled_corpus` (one ``<name>.jsonl.gz`` per corpus)."""
    return sorted(p.name.removesuffix(".jsonl.gz") for p in _ASSETS.glob("*.jsonl.gz"))


def load_bundled_corpus(name: str = "shakespeare") -> list[str]:
    """Return the documents of a bundled corpus (for ``shakespeare``: one text per play)."""
    path = _ASSETS / f"{name}.jsonl.gz"
    if not path.is_file():
        raise DataError(
            f"no bundled corpus named {name!r} (looked for {path}); "
            f"available: {', '.join(bundled_corpus_names()) or 'none'}"
        )
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def bundled_tokenizer_path() -> str:
    """Folder of the bundled byte-level BPE tokenizer (vocab 4096), loadable by AutoTokenizer."""
    path = _ASSETS / "tokenizer"
    if not (path / "tokenizer.json").is_file():
        raise DataError(f"bundled tokenizer missing: {path / 'tokenizer.json'} (reinstall scaletrain)")
    return str(path)


def read_text_files(pattern: str, per_line: bool = False) -> list[str]:
    """Read plain UTF-8 text files matching ``pattern`` (a path or glob; ``**`` recurses).

    Files are read in sorted path order so the document order, and therefore the data
    split and the batches, do not depend on the file system. Each file is one document,
    or with ``per_line`` each non-blank line is one (JSONL-free corpora of short texts).
    Blank documents are skipped.
    """
    expanded = os.path.expanduser(pattern)
    paths = sorted(p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
    if not paths:
        raise DataError(f"no text files match {pattern!r}: check the path or glob")
    docs: list[str] = []
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        if per_line:
            docs.extend(line for line in text.splitlines() if line.strip())
        elif text.strip():
            docs.append(text)
    if not docs:
        raise DataError(f"the files matching {pattern!r} contain no text ({len(paths)} files, all blank)")
    return docs
