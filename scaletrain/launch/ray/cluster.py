"""Reaching Ray: import it, join a cluster or start a local instance, and the workers' environment.

Why apart from the launcher: the sweep runs its members as plain Ray tasks, not as a
Ray Train worker group, and needs these three and nothing else of the launcher.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from scaletrain.errors import ConfigError
from scaletrain.launch.xla_flags import without_device_count


def make_worker_env(use_gpu: bool, use_tpu: bool, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of the Ray workers: set explicitly, never inherited from a test's fake devices. The driver's
    other XLA flags do travel (as the JAX launcher's children get them): a worker compiles as the driver does."""
    import scaletrain

    root = os.path.dirname(os.path.dirname(os.path.abspath(scaletrain.__file__)))
    path = os.environ.get("PYTHONPATH", "")
    env = {
        # the driver's XLA flags less a fake device count: one CPU device per process
        "XLA_FLAGS": without_device_count(os.environ.get("XLA_FLAGS", "")),
        "JAX_PLATFORMS": "cuda" if use_gpu else ("tpu" if use_tpu else "cpu"),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": root + (os.pathsep + path if path else ""),
    }
    from scaletrain.host_memory import hugepage_env, hugepages_supported

    if hugepages_supported() and not use_gpu and not use_tpu:  # the scratch buffer is host memory only on CPU
        env["GLIBC_TUNABLES"] = hugepage_env()["GLIBC_TUNABLES"]  # keeps this process's other tunables
    env.update(extra or {})
    return env


def import_ray() -> Any:
    """``ray``, or a ConfigError saying how to install it (it is an optional extra)."""
    try:
        import ray
        import ray.train  # noqa: F401
    except ImportError:
        raise ConfigError("Ray is not installed; install the extra: pip install 'scaletrain[ray]'") from None
    return ray


#: runs in every process of the job (:func:`quiet_ray_internals`)
QUIET_HOOK = "scaletrain.launch.ray.cluster.quiet_ray_internals"


def quiet_ray_internals() -> None:
    """Silence Ray Train's placement-group watcher, which asks the state API (the dashboard, off in a local
    instance) about the controller every health check and warns each time it cannot: 51 identical lines
    in a 20-step run. It keeps watching either way; real failures still reach the driver."""
    logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner").setLevel(logging.ERROR)


def ensure_ray(address: str | None, num_cpus: int | None) -> bool:
    """Connect to ``address`` (``"auto"``: the running cluster) or start a local instance.

    Returns True when this call started Ray (and the caller must shut it down).
    """
    ray = import_ray()
    if ray.is_initialized():
        return False
    if address is None:  # the local instance inherits this process's environment (PYTHONPATH included)
        ray.init(num_cpus=num_cpus, include_dashboard=False, configure_logging=False,
                 runtime_env={"worker_process_setup_hook": QUIET_HOOK})
    else:  # a running cluster does not: every process of this job (Ray Train's controller too) must import scaletrain
        env = {"PYTHONPATH": make_worker_env(False, False)["PYTHONPATH"]}
        try:
            ray.init(address=address, configure_logging=False,
                     runtime_env={"env_vars": env, "worker_process_setup_hook": QUIET_HOOK})
        except (ConnectionError, TimeoutError) as err:
            reason = next((x.strip() for x in str(err).splitlines() if x.strip()), type(err).__name__)
            raise ConfigError(
                f"ray.address={address!r}: no Ray cluster could be reached ({reason}); start one with "
                "`ray start --head`, or leave ray.address unset to start a local instance"
            ) from None
    return True
