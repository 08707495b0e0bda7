"""The persistent compilation cache: on by default, never overriding an operator's choice, bad paths named."""

import json
import os
import subprocess
import sys

import pytest

from scaletrain.arguments import TrainingArguments
from scaletrain.compile_cache import DEFAULT_DIR
from scaletrain.errors import ConfigError

SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
from scaletrain.compile_cache import enable_compilation_cache
jnp.ones(3).block_until_ready()  # something compiled before the cache was set, like a model's initialiser
used = enable_compilation_cache(sys.argv[1] if sys.argv[1] != "-" else None)
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
f(jnp.ones((64, 64))).block_until_ready()
print(json.dumps({"used": used}))
"""


def _run(arg, env_dir=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env |= {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    if env_dir:
        env["JAX_COMPILATION_CACHE_DIR"] = str(env_dir)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(arg)], env=env, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip().splitlines()[-1]


def test_cache_written_after_an_earlier_compile_and_env_wins(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    assert str(ours) in _run(ours)
    assert any(p.name.startswith("jit_") for p in ours.iterdir())  # the jitted program is on disk
    assert str(theirs) in _run(ours / "other", env_dir=theirs)  # the operator's directory wins
    assert not (ours / "other").exists() and any(theirs.iterdir())
    assert '"used": null' in _run("-")


def test_default_and_bad_directory(tmp_path):
    assert TrainingArguments().compilation_cache_dir == DEFAULT_DIR
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    import jax

    from scaletrain.compile_cache import enable_compilation_cache

    saved = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        with pytest.raises(ConfigError, match="training.compilation_cache_dir: cannot create"):
            enable_compilation_cache(str(blocker / "cache"))
    finally:
        jax.config.update("jax_compilation_cache_dir", saved)


COUNTING = """
import json, sys
import jax, jax.numpy as jnp
from scaletrain.compile_cache import enable_compilation_cache
hits, compiles = [], []
jax.monitoring.register_event_listener(lambda e, **_: hits.append(e) if e.endswith("/cache_hits") else None)
jax.monitoring.register_event_duration_secs_listener(
    lambda e, d, **_: compiles.append(d) if e.endswith("backend_compile_duration") else None)
enable_compilation_cache(sys.argv[1])
x = jnp.arange(8.0)                                     # eager ops: programs that compile in milliseconds
y = jax.jit(lambda v: jnp.cumsum(jnp.sin(v) * 2))(x)
float((x * y).sum())
print(json.dumps({"compiles": len(compiles), "hits": len(hits)}))
"""


def _counting_run(cache, **env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    out = subprocess.run([sys.executable, "-c", COUNTING, str(cache)], env=env | env_extra, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_run_loads_every_program_the_first_compiled_fast_ones_included(tmp_path):
    """JAX caches only compilations of 1 s or more by default; most of a small run's take less. With the cache
    scaletrain sets, the second run of the same programs loads every one of them; an operator's threshold wins."""
    first = _counting_run(tmp_path / "ours")
    assert first["hits"] == 0 and first["compiles"] >= 3
    second = _counting_run(tmp_path / "ours")
    assert second["hits"] == second["compiles"] == first["compiles"]
    theirs = tmp_path / "theirs"
    _counting_run(theirs, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="60")
    assert not [p for p in theirs.iterdir() if not p.name.endswith("-atime")]  # nothing took 60 s: nothing written


def test_program_cache_builds_once_per_key_and_keeps_the_most_recent():
    """The rollout engines and the evaluation scorers share one bounded cache: a key is built once while it
    stays, and past ``max_size`` the least recently used goes (a sweep does not keep every model's programs)."""
    from scaletrain.compile_cache import ProgramCache

    builds = []
    cache = ProgramCache(2)

    def get(key):
        return cache.get(key, lambda: builds.append(key) or f"program {key}")

    assert [get("a"), get("b"), get("a")] == ["program a", "program b", "program a"]
    get("c")  # "b" is the least recently used now
    get("a")
    get("b")
    assert builds == ["a", "b", "c", "b"] and len(cache) == 2
