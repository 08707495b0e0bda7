"""Test set-up: 8 fake CPU devices, set before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
# One persistent compilation cache per test session, shared with subprocesses: many
# tests compile the same tiny programs, and a cache hit turns ~20 s into ~1 s.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="scaletrain-test-jax-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray reads its auth mode once per process: a local ray.init() with RAY_AUTH_MODE unset
# turns token auth on, and a later in-process instance started with it "disabled" then
# rejects its own raylet's calls and kills the driver's actors (TrainController
# "cancelled before it started"). Every in-process and child Ray of the suite uses one mode.
os.environ["RAY_AUTH_MODE"] = "disabled"

import pytest  # noqa: E402


@pytest.fixture
def tiny_config_kwargs() -> dict:
    """A Llama small enough to compile in a second, with GQA."""
    return dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE is not None:
        import shutil

        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``make test`` runs ``-n 2 --dist loadgroup --no-loadscope-reorder``): a
    test file runs on one process, so its module fixtures (a reference run, a converted model)
    are built once, and every test that starts Ray (marked ``ray``, or in a ``test_ray*`` file)
    runs on the same process, first: Ray's ``address=auto`` finds any cluster on the machine, so
    two never run at once, and the longest group starts while the other process takes the rest.
    Without xdist nothing changes."""
    if not hasattr(config, "workerinput"):
        return

    def is_ray(item):
        return item.get_closest_marker("ray") is not None or item.path.name.startswith("test_ray")

    for item in items:
        item.add_marker(pytest.mark.xdist_group("ray" if is_ray(item) else item.nodeid.split("::")[0]))
    items.sort(key=lambda item: not is_ray(item))  # stable: the file order stays within each part
