"""The XLA flags a launched process inherits from the one that launched it.

Why: a test (or a user trying a mesh on CPU) runs the launcher with ``--xla_force_host_platform_device_count``;
every process it starts must see one CPU device (several local CPU devices per process can hang the gloo
collectives later), yet keep every other flag the user chose (compile settings, dumps), so that a process
compiles as its launcher does. The JAX launcher and the Ray launcher both use this one rule.
"""

from __future__ import annotations

import re

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S+")


def without_device_count(flags: str) -> str:
    """``flags`` less the fake CPU device count, whitespace tidied."""
    return " ".join(_DEVICE_COUNT_FLAG.sub("", flags).split())
