"""Real multi-process training on Ray Train (CPU), driven by the examples of docs/distributed.md.

One local Ray instance (2 logical CPUs, tests/conftest.py's ``ray_instance``) serves the
module and the in-process launches of tests/test_ray_signals.py; each launch starts two JAX
processes with one CPU device each (the test process's 8 fake devices are not
inherited: the launcher sets the workers' XLA_FLAGS).
"""

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("ray")

from docs_testing import doc_blocks, python_blocks  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]
DOC = "docs/distributed.md"


@pytest.fixture(scope="module")
def docs_run(ray_instance, tmp_path_factory):
    """The doc's API and 2-worker launch examples, run in a fresh folder."""
    folder = tmp_path_factory.mktemp("docs")
    old = os.getcwd()
    os.chdir(folder)
    namespace: dict = {}
    try:
        blocks = doc_blocks(DOC)
        assert set(blocks) == {"api", "ray-launch", "ray-restart"}
        assert len(python_blocks(DOC)) == 3  # every python example is one of the tested ones
        exec(blocks["api"], namespace)
        exec(blocks["ray-launch"], namespace)
        yield folder, namespace
    finally:
        os.chdir(old)


HOLDER = (  # another launch's driver: it holds the folder's lock as launch_on_ray does, and sleeps
    "import sys, time\n"
    "from scaletrain.training.run_lock import acquire_run_lock\n"
    "acquire_run_lock(sys.argv[1])\n"
    "print('locked', flush=True)\n"
    "time.sleep(600)\n"
)


def _snapshot(folder) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_second_launch_on_a_locked_folder_is_refused_before_writing(tmp_path):
    """The driver takes output_dir's run lock before it writes there: a second launch changes nothing."""
    import ray

    from scaletrain.launch.ray.launcher import RAY_DIR, launch_on_ray
    from scaletrain.errors import ConfigError

    out = tmp_path / "run"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": root})
    try:
        assert child.stdout.readline().strip() == "locked"
        # what the running launch has written; a stop request the second launch would have cleared
        (out / RAY_DIR).mkdir()
        (out / RAY_DIR / "stop-request.json").write_text('{"signal": "SIGTERM"}')
        (out / "ray_attempts.jsonl").write_text('{"attempt": 1}\n')
        before, ray_was_up = _snapshot(out), ray.is_initialized()
        with pytest.raises(ConfigError) as err:
            launch_on_ray(lambda callbacks: {}, num_workers=2, output_dir=str(out))
        assert f"pid {child.pid}" in str(err.value) and "in use by another run" in str(err.value)
        assert _snapshot(out) == before  # nothing written, removed or touched
        assert ray.is_initialized() == ray_was_up  # refused before Ray was started
    finally:
        child.kill()
        child.wait()


def _losses(folder) -> dict[int, float]:
    lines = [json.loads(x) for x in open(os.path.join(folder, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in lines if r["split"] == "train"}


def test_two_workers_match_one_process(docs_run, tmp_path):
    folder, ns = docs_run
    result = ns["result"]
    assert result.summary["process_count"] == 2 and result.summary["final_step"] == 6
    assert result.restarts == 0
    for rank, p in enumerate(result.placement):
        assert p["process_index"] == rank and p["process_count"] == 2
        assert p["local_devices"] == 1 and p["global_devices"] == 2
        assert p["mesh"]["fsdp"] == 2 and p["mesh_processes"] == [0, 1]  # one mesh over both processes
        assert p["sharded_params"] > 0
        assert p["fully_addressable_sharded_params"] == 0  # each holds half of every sharded parameter

    # the same training in this one process (8 fake devices), same data and global batches
    arguments = ns["arguments"].model_copy(update={"output_dir": str(tmp_path)})
    ns["trainer"].train(1, arguments, ns["train_rows"], ns["eval_rows"])
    ours, ref = _losses(result.output_dir), _losses(tmp_path)
    assert sorted(ours) == sorted(ref) == list(range(1, 7))
    diffs = [abs(ours[s] - ref[s]) for s in ref]
    print(f"\nmax |loss(2 workers) - loss(1 process)| over {len(ref)} steps = {max(diffs):.3g}; "
          f"launch took {result.elapsed_s:.1f}s")
    np.testing.assert_allclose([ours[s] for s in ref], [ref[s] for s in ref], rtol=2e-5, atol=2e-5)
    ref_summary = json.load(open(tmp_path / "summary.json"))
    assert result.summary["final_eval_loss"] == pytest.approx(ref_summary["final_eval_loss"], rel=2e-5)


def test_a_two_worker_checkpoint_resumes_in_one_process(docs_run, tmp_path):
    """2 -> 1: the Ray run's step-4 checkpoint, resumed by this one process, trains steps 5 and 6 on the same
    global batches (the data position counts global batches, whatever the process count): the same losses as
    the Ray run within the tolerance of test_two_workers_match_one_process (summation order only)."""
    import shutil

    folder, ns = docs_run
    source = os.path.join(ns["result"].output_dir, "checkpoints", "4")
    shutil.copytree(source, tmp_path / "checkpoints" / "4")
    arguments = ns["arguments"].model_copy(update={"output_dir": str(tmp_path), "resume_if_possible": True})
    ns["trainer"].train(1, arguments, ns["train_rows"], ns["eval_rows"])
    ours, ray = _losses(tmp_path), _losses(ns["result"].output_dir)
    assert sorted(ours) == [5, 6]
    np.testing.assert_allclose([ours[s] for s in (5, 6)], [ray[s] for s in (5, 6)], rtol=2e-5, atol=2e-5)


@pytest.fixture(scope="module")
def preempted_then_killed(docs_run):
    """One run that a SIGTERMed worker stops, then resumed by the doc's restart example, whose worker is SIGKILLed.

    The doc's `ray-restart` block runs on the folder the preempted run left (with
    ``resume_if_possible``), so one resumed launch shows both that a preempted run continues
    from its stop checkpoint and that a killed worker's group restarts from a checkpoint, each
    ending at the uninterrupted run's ``params_sha256``: one launch fewer than resuming the
    preempted run on its own. The SIGTERM lands after step 1 or 2 (drawn per chaos seed), so
    the stop (at that step or the next) comes before the kill after step 5.
    """
    from scaletrain.launch.ray import SignalWorkerOnce

    folder, ns = docs_run
    seed = int(os.environ.get("SCALETRAIN_CHAOS_SEED", "1616"))  # as tests/test_chaos.py: a moment drawn per seed
    step, rank = random.Random(seed).randint(1, 2), random.Random(seed + 1).randint(0, 1)
    arguments = ns["arguments"].model_copy(update={"output_dir": str(folder / "runs" / "ray-demo-killed")})
    stopped = ns["trainer"].launch(num_workers=2, arguments=arguments, dataset_train=ns["train_rows"],
                                   dataset_eval=ns["eval_rows"], callbacks=[SignalWorkerOnce(step=step, rank=rank)])
    print(f"\nchaos seed {seed}: SIGTERM to worker {rank} after step {step} -> {stopped.summary['stop_reason']!r}")
    lines_before = len(_metric_lines(stopped.output_dir))
    old = os.getcwd()
    os.chdir(folder)
    try:
        resumable = {**ns, "arguments": ns["arguments"].model_copy(update={"resume_if_possible": True})}
        exec(doc_blocks(DOC)["ray-restart"], resumable)  # asserts restarts == 1 and the same params_sha256
    finally:
        os.chdir(old)
    return {"step": step, "stopped": stopped, "killed": resumable["killed"], "lines_before": lines_before}


def _metric_lines(folder) -> list[dict]:
    return [json.loads(x) for x in open(os.path.join(folder, "metrics.jsonl"))]


def test_killed_worker_restarts_from_checkpoint(docs_run, preempted_then_killed):
    folder, _ = docs_run
    killed = preempted_then_killed["killed"]
    marker = folder / "runs" / "killed-once.txt"
    restart_s = killed.attempts[1]["jax_ready"] - os.path.getmtime(marker)
    print(f"\nworker SIGKILLed after step 5 -> new group in jax.distributed after {restart_s:.1f}s; "
          f"resumed from {killed.summary['resumed_from']}; launch took {killed.elapsed_s:.1f}s")
    assert killed.restarts == 1 and killed.summary["resumed_from"].endswith("checkpoints/4")  # as the doc asserts
    lines = _metric_lines(killed.output_dir)
    assert [r["step"] for r in lines if r["split"] == "train"][-2:] == [5, 6]  # steps 5-6 ran again
    # one marker where the restarted group resumed, before the steps it redoes (issue 16 item 12)
    marks = [i for i, r in enumerate(lines) if r["split"] == "restart"]
    resumed = int(os.path.basename(killed.summary["resumed_from"]))
    assert len(marks) == 1 and lines[marks[0]]["attempt"] == 2
    assert lines[marks[0]]["step"] == lines[marks[0]]["resumed_from_step"] == resumed
    from scaletrain.plot import read_metrics

    steps = [r["step"] for r in read_metrics(killed.output_dir)[0]]
    assert steps == sorted(set(steps))  # the reader keeps one record per step


def test_sigterm_to_a_worker_stops_with_a_checkpoint_and_resumes_exactly(docs_run, preempted_then_killed):
    """Issue 16 item 4: a preempted worker (SIGTERM) stops every process at one step, with a checkpoint."""
    from scaletrain.training.checkpoint import step_folders

    _, ns = docs_run
    step, stopped = preempted_then_killed["step"], preempted_then_killed["stopped"]
    summary = stopped.summary
    assert stopped.restarts == 0  # a clean stop, not a failure
    assert "SIGTERM (JAX preemption notice)" in summary["stop_reason"]
    assert step <= summary["final_step"] < 5  # before the resumed run's kill after step 5
    assert summary["final_step"] in step_folders(os.path.join(stopped.output_dir, "checkpoints"))
    # the resumed launch continued from the stop checkpoint: its first logged step is the next one
    resumed = [r for r in _metric_lines(stopped.output_dir)[preempted_then_killed["lines_before"]:]
               if r["split"] == "train"]
    assert resumed[0]["step"] == summary["final_step"] + 1
    killed = preempted_then_killed["killed"]
    assert killed.summary["final_step"] == 6
    assert killed.summary["params_sha256"] == ns["result"].summary["params_sha256"]
