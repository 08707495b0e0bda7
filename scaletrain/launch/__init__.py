"""Launch backends: where a recipe's training runs (this process, or processes on Ray).

A recipe chooses its backend (:func:`scaletrain.launch.backends.backend_of`);
:func:`run_recipe` runs it there. Names are imported lazily: ``import scaletrain.launch``
imports neither Ray (an optional extra) nor JAX.
"""

from __future__ import annotations

from scaletrain._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "run_recipe": "scaletrain.launch.backends",
    "backend_of": "scaletrain.launch.backends",
    "BACKENDS": "scaletrain.launch.backends",
    "run_local": "scaletrain.launch.local",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports('scaletrain.launch', _EXPORTS, globals())
