"""Test set-up: 8 fake CPU devices, set before JAX is imported anywhere."""

import os

from xla_testing import CHEAP_COMPILE  # noqa: E402  (no jax: only the flags' text)

# XLA's cheapest CPU compile for this process and every child that inherits its environment: the suite's
# programs are tiny, so its CPU goes to compiling them, not to running them (tests/xla_testing.py).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 " + CHEAP_COMPILE
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
# Ray Train's controller polls its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by
# default): the end of every tiny Ray run of the suite, its last report, and a dead worker were
# each seen up to 2 s late. Ray passes the variable from the driver to the controller and workers,
# for a local instance or a cluster.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")

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


@pytest.fixture(scope="session")
def ray_instance() -> None:
    """A local Ray instance (2 logical CPUs) in this process, for in-process launches.

    Started and stopped by the two hooks below rather than by this fixture, so that a run of
    consecutive tests asking for it (tests/test_ray_launch.py, then the first tests of
    tests/test_ray_signals.py) shares one instance, ~10 s of Ray start-up fewer per module,
    while every other test runs with no in-process instance: Ray's ``address=auto`` would find
    it, and the seed example's own ``ray.init()`` would refuse a second one.
    """


def _wants_ray(item: pytest.Item) -> bool:
    return "ray_instance" in getattr(item, "fixturenames", ())


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _wants_ray(item):
        import ray

        if not ray.is_initialized():
            ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the in-process Ray instance after the last of a run of tests that ask for it."""
    if _wants_ray(item) and (nextitem is None or not _wants_ray(nextitem)):
        import ray

        if ray.is_initialized():
            ray.shutdown()


def pytest_configure(config):
    """``SCALETRAIN_TEST_TIMELINE=DIR`` records each test file's wall and CPU per worker (tests/suite_timeline.py)."""
    from suite_timeline import install

    install(config)


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE is not None:
        import shutil

        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_xdist_make_scheduler(config, log):
    """``make test`` runs ``-n 2 --dist loadfile``: a test file runs on one process, so its module
    fixtures (a reference run, a converted model) are built once, and every test that starts Ray
    runs on the same process, first: Ray's ``address=auto`` finds any cluster on the machine, so
    two must never run at once, and the longest group starts while the other process takes the
    rest. (xdist's ``loadgroup`` markers do not work with pytest 9.2, whose node ids xdist 3.8
    cannot rename, so the grouping is this scheduler's.) A worker that dies (killed for memory, an abort in
    XLA) has its files handed to another worker, and the run ends failed: see tests/xdist_scheduling.py."""
    from xdist_scheduling import RayFirstFileScheduling

    return RayFirstFileScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist the Ray tests come first (see above). Without xdist the order is the files' own."""
    if hasattr(config, "workerinput"):
        from xdist_scheduling import runs_ray

        items.sort(key=lambda item: not runs_ray(item.nodeid))  # stable: file order kept within each part
