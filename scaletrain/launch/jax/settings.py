"""Where this process stands in a ``jax.distributed`` job: coordinator, process count, process id.

Why one resolver: a process learns its place from several sources and they must be read
in one order everywhere, or two processes of one job could disagree about it. The order,
first found wins per key: the recipe's ``launch`` section (which the command line's
``--coordinator``/``--num-processes``/``--process-id`` set), EasyDeL's
``training.jax_distributed_config``, the ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES``
/ ``JAX_PROCESS_ID`` environment variables, then JAX's own cluster detection (Slurm,
Cloud TPU, Open MPI), which is also what ``jax.distributed.initialize()`` without
arguments would do. Nothing here imports JAX at module level: :func:`wants_jax` runs
while the backend is chosen, before anything touches a device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scaletrain.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from scaletrain.recipe import Recipe

#: ``training.jax_distributed_config``'s keys that mean what the ``launch`` section's keys mean
DISTRIBUTED_CONFIG_KEYS = {"coordinator_address": "coordinator_address", "num_processes": "num_processes",
                           "process_id": "process_id", "initialization_timeout": "initialization_timeout",
                           "heartbeat_timeout_seconds": "heartbeat_timeout", "heartbeat_timeout": "heartbeat_timeout"}
ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}
#: environment variables of a scheduler that starts several processes (Slurm, Open MPI)
_MULTI = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


@dataclass(frozen=True)
class JaxJob:
    """This process's place in the job, and where each value came from (said in the plan and errors)."""

    coordinator_address: str
    num_processes: int
    process_id: int
    initialization_timeout: int
    heartbeat_timeout: int
    source: str
    bind_host: str = ""  # launch.coordinator_bind_address; "" means the coordinator's own host

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.coordinator_address.rpartition(":")
        return host.strip("[]"), int(port)

    @property
    def listen_host(self) -> str:
        """Where process 0 listens (our rendezvous and JAX's coordination service): the address the others
        were told to reach, so a loopback coordinator is reachable from this host only. Listening on every
        interface (JAX's default) lets anyone who reaches the host join or disturb the job; it takes an
        explicit ``launch.coordinator_bind_address`` of ``0.0.0.0`` or ``::``."""
        return self.bind_host.strip("[]") or self.host_port[0]

    @property
    def bind_address(self) -> str:
        """:attr:`listen_host` with the coordinator's port, as ``jax.distributed.initialize`` takes it."""
        host = self.listen_host
        return f"[{host}]:{self.host_port[1]}" if ":" in host else f"{host}:{self.host_port[1]}"

    def describe(self) -> str:
        return (f"jax.distributed: process {self.process_id} of {self.num_processes}, coordinator "
                f"{self.coordinator_address} ({self.source})")


def distributed_config(recipe: Recipe) -> dict[str, Any]:
    """``training.jax_distributed_config`` in the launch section's names; an unknown key is a ConfigError."""
    given = recipe.training.jax_distributed_config or {}
    unknown = sorted(set(given) - set(DISTRIBUTED_CONFIG_KEYS) - {"local_device_ids"})
    if unknown:
        raise ConfigError(f"training.jax_distributed_config: unknown key(s) {unknown}; known: "
                          f"{sorted(DISTRIBUTED_CONFIG_KEYS)} (the same as the recipe's launch section)")
    return {DISTRIBUTED_CONFIG_KEYS[k]: v for k, v in given.items()
            if k in DISTRIBUTED_CONFIG_KEYS and v is not None}


def _explicit(recipe: Recipe) -> dict[str, tuple[Any, str]]:
    """Each key given outside JAX's detection, with where it came from (first source wins)."""
    launch = recipe.launch
    found: dict[str, tuple[Any, str]] = {}
    sources = [
        ({k: getattr(launch, k) for k in ENV}, "launch section"),
        (distributed_config(recipe), "training.jax_distributed_config"),
        ({k: os.environ.get(v) for k, v in ENV.items()}, "environment"),
    ]
    for values, where in sources:
        for key in ENV:
            if found.get(key) is None and values.get(key) not in (None, ""):
                found[key] = (values[key], where)
    return found


def wants_jax(recipe: Recipe) -> bool:
    """Whether ``backend: auto`` means ``jax``: a coordinator or process count was given, or a scheduler
    started several processes (Slurm's ``SLURM_NTASKS`` > 1, Open MPI's world size > 1)."""
    if recipe.launch.backend != "auto":
        return recipe.launch.backend == "jax"
    given = _explicit(recipe)
    if "coordinator_address" in given or _int(given.get("num_processes", (1, ""))[0]) > 1:
        return True
    return any(_int(os.environ.get(var)) > 1 for var in _MULTI)


def _int(value: Any, name: str = "", where: str = "") -> int:
    if value is None:
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        if not name:
            return 0
        raise ConfigError(f"{name}={value!r} ({where}) must be an integer") from None


def resolve_job(recipe: Recipe) -> JaxJob:
    """This process's :class:`JaxJob`; what no source gives is a ConfigError naming what to set."""
    given = _explicit(recipe)
    values = {k: v for k, (v, _) in given.items()}
    sources = sorted({where for _, where in given.values()})
    if len(values) < 3:
        detected, name = _detect(recipe, values)
        for key, value in detected.items():
            if values.get(key) is None and value is not None:
                values[key] = value
                if name not in sources:
                    sources.append(name)
    missing = [k for k in ENV if values.get(k) in (None, "")]
    if missing:
        flags = {"coordinator_address": "--coordinator HOST:PORT", "num_processes": "--num-processes N",
                 "process_id": "--process-id I"}
        raise ConfigError(
            "launch.backend=jax: this process does not know its " + ", ".join(m.replace("_", " ") for m in missing)
            + "; pass " + " ".join(flags[m] for m in missing) + " to `scaletrain train` (or set launch."
            + ", launch.".join(missing) + ", or " + ", ".join(ENV[m] for m in missing)
            + "), or start it under Slurm (srun), Open MPI or on a Cloud TPU VM, where JAX finds them"
        )
    where = " + ".join(sources)
    count = _int(values["num_processes"], "launch.num_processes", where)
    pid = _int(values["process_id"], "launch.process_id", where)
    address = str(values["coordinator_address"])
    if ":" not in address or not address.rpartition(":")[2].isdigit():
        raise ConfigError(f"launch.coordinator_address={address!r} ({where}) must be HOST:PORT")
    if count < 1:
        raise ConfigError(f"launch.num_processes={count} ({where}) must be >= 1")
    if not 0 <= pid < count:
        raise ConfigError(f"launch.process_id={pid} ({where}) is out of range for num_processes={count}: "
                          f"ids run from 0 to {count - 1}, one per process, process 0 on the coordinator's host")
    launch, given = recipe.launch, distributed_config(recipe)

    def timeout(key: str) -> int:  # the launch section's when set there, else jax_distributed_config's, else default
        return int(given[key] if key in given and key not in launch.model_fields_set else getattr(launch, key))

    init_timeout, beat = timeout("initialization_timeout"), timeout("heartbeat_timeout")
    return JaxJob(address, count, pid, init_timeout, beat, where, launch.coordinator_bind_address or "")


def _detect(recipe: Recipe, values: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """What JAX's cluster detection (Slurm, Cloud TPU, Open MPI, ...) says for the keys not given."""
    try:
        from jax._src.clusters import ClusterEnv
    except ImportError:  # pragma: no cover - JAX moved its detection: only explicit settings work
        return {}, "JAX's cluster detection"
    env = next((e for e in ClusterEnv._cluster_types if not e.opt_in_only_method and e.is_env_present()), None)
    if env is None:
        return {}, "JAX's cluster detection"
    address, count, pid, _ = ClusterEnv.auto_detect_unset_distributed_params(
        values.get("coordinator_address"), _int(values.get("num_processes")) or None,
        None if values.get("process_id") is None else _int(values["process_id"]), None, None,
        recipe.launch.initialization_timeout,
    )
    return {"coordinator_address": address, "num_processes": count, "process_id": pid}, f"{env.name} detected by JAX"
