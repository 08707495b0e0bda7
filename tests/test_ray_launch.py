"""Real multi-process training on Ray Train (CPU): parity with one process, and a SIGKILLed worker.

One local Ray instance (2 logical CPUs) serves the module; each run starts two JAX
processes with one CPU device each (the test process's 8 fake devices are not
inherited: the launcher sets the workers' XLA_FLAGS).
"""

import json
import os
import time

import numpy as np
import pytest

pytest.importorskip("ray")

from ray import cloudpickle  # noqa: E402  (Ray vendors its own copy)

import ray_helpers  # noqa: E402
from ray_helpers import RecordPlacement, lm_data, tiny_arguments, tiny_trainer  # noqa: E402

from scaletrain.data import bundled_tokenizer_path  # noqa: E402
from scaletrain.distributed import KillWorkerOnce  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]
cloudpickle.register_pickle_by_value(ray_helpers)


@pytest.fixture(scope="module")
def ray_instance():
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def two_worker_run(ray_instance, tmp_path_factory):
    out = tmp_path_factory.mktemp("ray2")
    trainer = tiny_trainer(bundled_tokenizer_path())
    t0 = time.perf_counter()
    result = trainer.launch(2, tiny_arguments(str(out)), lm_data(), lm_data(16, seed=1),
                            callbacks=[RecordPlacement(str(out))])
    result.wall_s = time.perf_counter() - t0
    return result


def _losses(folder) -> dict[int, float]:
    lines = [json.loads(x) for x in open(os.path.join(folder, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in lines if r["split"] == "train"}


def test_two_workers_match_one_process(two_worker_run, tmp_path):
    out = two_worker_run.output_dir
    assert two_worker_run.summary["process_count"] == 2
    assert two_worker_run.summary["final_step"] == 8
    placements = [json.load(open(os.path.join(out, f"placement-{i}.json"))) for i in range(2)]
    for i, p in enumerate(placements):
        assert p["process_index"] == i and p["process_count"] == 2
        assert p["local_devices"] == 1 and p["global_devices"] == 2
        assert p["mesh_processes"] == [0, 1]  # one mesh over both processes
        sharded = [a for a, s in zip(p["fully_addressable"], p["sharded"]) if s]
        assert sharded and not any(sharded)  # sharded parameters live partly on the other process

    # the same training in this process (8 fake devices, one process), same global batches
    reference = tiny_trainer(bundled_tokenizer_path())
    reference.train(1, tiny_arguments(str(tmp_path)), lm_data(), lm_data(16, seed=1))
    ours, ref = _losses(out), _losses(tmp_path)
    assert sorted(ours) == sorted(ref) == list(range(1, 9))
    diffs = [abs(ours[s] - ref[s]) for s in ref]
    print(f"max |loss(2 workers) - loss(1 process)| = {max(diffs):.3g}; wall {two_worker_run.wall_s:.1f}s")
    np.testing.assert_allclose([ours[s] for s in ref], [ref[s] for s in ref], rtol=2e-5, atol=2e-5)
    ref_summary = json.load(open(tmp_path / "summary.json"))
    assert two_worker_run.summary["final_eval_loss"] == pytest.approx(ref_summary["final_eval_loss"], rel=2e-5)


def test_killed_worker_restarts_from_checkpoint(two_worker_run, tmp_path):
    marker = str(tmp_path / "killed.txt")
    trainer = tiny_trainer(bundled_tokenizer_path())
    result = trainer.launch(2, tiny_arguments(str(tmp_path / "run")), lm_data(), lm_data(16, seed=1),
                            max_failures=1, callbacks=[KillWorkerOnce(step=5, marker=marker, rank=1)])
    assert os.path.exists(marker)
    assert result.restarts == 1
    summary = result.summary
    assert summary["final_step"] == 8
    assert summary["resumed_from"] is not None and summary["resumed_from"].endswith(("/4", "/2"))
    assert summary["params_sha256"] == two_worker_run.summary["params_sha256"]
    restart_s = result.attempts[1]["jax_ready"] - os.path.getmtime(marker)
    print(f"worker killed -> new worker group joined jax.distributed in {restart_s:.1f}s; "
          f"resumed from {summary['resumed_from']}")
