"""Lazy attribute exports for packages whose public names live in heavy modules."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any],
                 fallback: Callable[[str], Any] | None = None) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` that import ``exports[name]`` on first access and cache it; a name not in
    ``exports`` is asked of ``fallback`` (None from it: no such attribute)."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
            namespace[name] = value
            return value
        value = None if fallback is None or name.startswith("__") else fallback(name)
        if value is not None:
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
