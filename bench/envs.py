"""Python interpreters for the contenders, each peer in its own pinned virtualenv.

Why separate venvs: EasyDeL pins its own jax/flax versions, which must not leak into
scaletrain's environment (and vice versa). The venvs live under ``bench/.venvs/``
(gitignored) and are created on first use with pip, from PyPI only. torch is pinned to
the local CPU wheel (``torch==2.13.0``); any other version would pull CUDA.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
VENVS = os.path.join(HERE, ".venvs")

EASYDEL_VERSION = "0.3.0"
TORCH_VERSION = "2.13.0"

#: name -> pip requirements of that venv
REQUIREMENTS: dict[str, list[str]] = {
    # EasyDeL 0.3.0 imports Pillow and torch eagerly but does not declare them
    "easydel": [f"easydel=={EASYDEL_VERSION}", f"torch=={TORCH_VERSION}", "pillow"],
    "hf": ["transformers>=5.0,<6", "accelerate>=1.0", f"torch=={TORCH_VERSION}"],
    # JAX's CUDA plugin (~6 GB of CUDA wheels) or libtpu (~1.8 GB) for compiling GPU/TPU steps on a
    # CPU host (aot.py); scaletrain itself comes from the checkout on PYTHONPATH, its install only
    # brings the deps
    "aot_cuda": [f"{os.path.dirname(HERE)}[cuda12]"],
    "aot_tpu": [f"{os.path.dirname(HERE)}[tpu]"],
}


@dataclass
class Interpreter:
    """A python to run a contender with, or why there is none."""

    python: str | None
    reason: str | None = None


def _imports(python: str, modules: list[str]) -> bool:
    code = "import " + ", ".join(modules)
    return subprocess.run([python, "-c", code], capture_output=True, timeout=300).returncode == 0


def ensure_venv(name: str, log: bool = True) -> Interpreter:
    """Create ``bench/.venvs/<name>`` with its pinned requirements (once); return its python."""
    path = os.path.join(VENVS, name)
    python = os.path.join(path, "bin", "python")
    pins = hashlib.sha256("\n".join(REQUIREMENTS[name]).encode()).hexdigest()[:16]
    marker = os.path.join(path, f".installed-{pins}")
    if os.path.exists(marker):
        return Interpreter(python)
    if log:
        print(f"[bench] installing {name} venv: {' '.join(REQUIREMENTS[name])} (first run only)", flush=True)
    if not os.path.exists(python):
        made = subprocess.run([sys.executable, "-m", "venv", path], capture_output=True, text=True)
        if made.returncode != 0:
            return Interpreter(None, f"could not create venv {path}: {made.stderr[-500:]}")
    logfile = os.path.join(VENVS, f"{name}.log")
    with open(logfile, "a") as f:
        done = subprocess.run([python, "-m", "pip", "install", "-q", *REQUIREMENTS[name]], stdout=f,
                              stderr=subprocess.STDOUT)
    if done.returncode != 0:
        return Interpreter(None, f"pip install {' '.join(REQUIREMENTS[name])} failed (see {logfile})")
    open(marker, "w").close()
    return Interpreter(python)


def hf_interpreter() -> Interpreter:
    """This python if it already has torch + transformers + accelerate, else the ``hf`` venv."""
    if _imports(sys.executable, ["torch", "transformers", "accelerate"]):
        return Interpreter(sys.executable)
    return ensure_venv("hf")


def easydel_interpreter() -> Interpreter:
    """The ``easydel`` venv (pinned), or the reason it could not be made."""
    interp = ensure_venv("easydel")
    if interp.python is None:
        return interp
    probe = subprocess.run([interp.python, "-c", "import easydel"], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if probe.returncode != 0:
        return Interpreter(None, "easydel installed but does not import: " + probe.stderr.strip()[-400:])
    return interp
