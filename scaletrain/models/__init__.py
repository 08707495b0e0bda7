"""Model configs, modules and the (model_type, task) registry.

Importing this package imports every family package (each folder under ``models/`` but the
shared ``common/`` and ``kernels/``), whose ``register(...)`` call fills the registry, the
config.json tables and the conformance suite's table. The family classes registered there (config
and modules) are exported here by name, so a new family is one folder: nothing outside it lists it.
"""

from __future__ import annotations

import importlib
import pkgutil

from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.common.family import family_classes
from scaletrain.models.factory import create_sharded_model, mesh_for_config
from scaletrain.models.registry import get_modules_by_type, register_module, registered_model_types

#: folders under models/ that hold shared code, not a family
SHARED_PACKAGES = ("common", "kernels")


def family_packages() -> list[str]:
    """The names of the family packages under ``models/`` (found on disk, in name order)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg and m.name not in SHARED_PACKAGES)


for _name in family_packages():
    importlib.import_module(f"{__name__}.{_name}")
globals().update(family_classes())

__all__ = sorted({
    *family_classes(),
    "DecoderConfig",
    "create_sharded_model",
    "family_packages",
    "get_modules_by_type",
    "mesh_for_config",
    "register_module",
    "registered_model_types",
})
