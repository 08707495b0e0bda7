"""Scaling ladders (``scaletrain sweep``): one training per ``scaling_index``, in parallel on Ray.

:mod:`.ladder` builds the members, runs them and writes the report and the power-law
fit; :mod:`.keys` keys each member folder by its resolved recipe so a re-run reuses,
resumes or refuses it. Names are imported lazily (no Ray, no JAX on import).
"""

from __future__ import annotations

from scaletrain._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "run_sweep": "scaletrain.sweep.ladder",
    "fit_power_law": "scaletrain.sweep.ladder",
    "member_recipe": "scaletrain.sweep.ladder",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports('scaletrain.sweep', _EXPORTS, globals())
