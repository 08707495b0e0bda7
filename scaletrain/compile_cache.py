"""JAX's persistent compilation cache, on by default for training runs.

Compiling the train step, the evaluation step and the initialiser takes most of a
small run's time to first step (~7 s of ~20 s for ``examples/shakespeare.yaml`` on a
2-core CPU; minutes for large models on accelerators). Programs are cached on disk
keyed by their HLO, compile options, devices and JAX version, so a second run of the
same recipe (a resume, a restart after a crash, the next rung of a sweep with the same
shapes) loads them instead.

JAX writes only compilations that took at least ``jax_persistent_cache_min_compile_time_secs``
(1 s by default); a small run's programs mostly take less (23 of the 26 of a 2-step
``examples/shakespeare.yaml`` run, 4.6 s of compiling on a 2-core CPU: the eval step, the
sampler, eager ops), so a second run compiled them all again. When scaletrain sets the
cache it also lowers that threshold to :data:`MIN_COMPILE_SECONDS` (reading a small entry
takes milliseconds), unless it was set (``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` or
``jax.config``) to something other than JAX's default. Figures: docs/benchmarks.md.

In memory, :class:`ProgramCache` keeps what is compiled per model graph (the rollout engine's programs,
the evaluation scorer) under one key, :func:`model_key`: a rebuilt or reloaded model of the same
architecture, or a new state of the same model, reuses them.

The default folder is ``~/.cache/scaletrain/jax``, or ``$SCALETRAIN_CACHE/jax`` when that is
set (where converted models and prepared tokenizers go too). The cache is trusted code:
point it only at a directory that no one else can write.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from scaletrain.errors import ConfigError

T = TypeVar("T")

DEFAULT_DIR = "~/.cache/scaletrain/jax"
#: compilations at least this long are cached when scaletrain sets the cache (JAX's own default: 1 s)
MIN_COMPILE_SECONDS = 0.0
_JAX_DEFAULT_MIN_COMPILE_SECONDS = 1.0


def cache_dir(path: str) -> str:
    """``path`` as an absolute folder; the default follows ``$SCALETRAIN_CACHE`` (its ``jax`` folder) when set."""
    if path == DEFAULT_DIR and os.environ.get("SCALETRAIN_CACHE"):
        path = os.path.join(os.environ["SCALETRAIN_CACHE"], "jax")
    return os.path.abspath(os.path.expanduser(path))


def enable_compilation_cache(path: str | None) -> str | None:
    """Use ``path`` as JAX's compilation cache unless one is already set; returns the one in use.

    A directory already set (``JAX_COMPILATION_CACHE_DIR`` or ``jax.config``) wins, so
    an operator's choice is never overridden; ``path=None`` leaves caching as it is.
    Must run before the first compilation of the programs to be cached.
    """
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current or path is None:
        return current or None
    path = cache_dir(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"training.compilation_cache_dir: cannot create {path}: {e.strerror} "
                          "(set it to null to turn caching off)") from e
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()  # it may have been checked (and found unset) by an earlier compile
    jax.config.update("jax_compilation_cache_dir", path)
    if ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ
            and jax.config.jax_persistent_cache_min_compile_time_secs == _JAX_DEFAULT_MIN_COMPILE_SECONDS):
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return path


def model_key(model: Any) -> tuple[str, ...]:
    """What makes two models' graphs equal, and so their compiled programs: class, config, dtypes, precision
    and LoRA setup (a LoRA / QLoRA graph differs from its base's), never the weights."""
    return (
        type(model).__module__,
        type(model).__qualname__,
        json.dumps(model.config.to_dict(), sort_keys=True, default=str),
        str(getattr(model, "dtype", None)),
        str(getattr(model, "param_dtype", None)),
        str(getattr(model, "precision", None)),
        repr(getattr(model, "lora_config", None)),
    )


class ProgramCache(Generic[T]):
    """Values built once per key (jitted programs, an engine holding them), the least recently used dropped
    beyond ``max_size``: a process that builds many models (a sweep, a test session) keeps a bounded number
    of compiled programs alive."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._values: OrderedDict[Hashable, T] = OrderedDict()

    def get(self, key: Hashable, build: Callable[[], T]) -> T:
        """The value of ``key``, built by ``build()`` the first time (or after it was dropped)."""
        if key not in self._values:
            self._values[key] = build()
        self._values.move_to_end(key)
        while len(self._values) > self.max_size:
            self._values.popitem(last=False)
        return self._values[key]

    def drop(self, key: Hashable) -> None:
        """Forget ``key`` (nothing if absent)."""
        self._values.pop(key, None)

    def __len__(self) -> int:
        return len(self._values)
