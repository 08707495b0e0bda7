"""Chaos: kill, signal or fill the disk of a run at seeded moments, then resume; nothing may be lost.

Single process: the run of tests/resume_worker.py (a subprocess, so it can be killed)
goes through one round per event — ``kill -9``, SIGTERM and a full disk, in an order
and at steps drawn from ``SCALETRAIN_CHAOS_SEED`` (printed) — and then resumes to its
horizon. After each round every checkpoint that was complete before the event must
still be there; at the end the run's ``params_sha256`` and logged losses must equal an
uninterrupted run's, and every checkpoint it kept must load and hold the reference's
parameters at that step.

The triggers are deterministic: the test waits for the run to log a chosen step in
``metrics.jsonl`` and only then strikes; where exactly the blow lands relative to the
asynchronous checkpoint writes varies, and the assertions hold wherever it lands.

"Disk full": ``prlimit(RLIMIT_FSIZE)`` lowered to 0 on the running process from
outside (no root needed). From then on every write the process makes to a regular
file fails with EFBIG (CPython ignores SIGXFSZ), which is how a full disk looks to the
writer (ENOSPC), for every file at once: checkpoint chunks, metrics, summary. Lifting
it is starting the next process without the limit.

Ray: a SIGKILLed worker's restart that ends bit-identical is tests/test_ray_launch.py's
(`test_killed_worker_restarts_from_checkpoint`, the documented example). SIGTERM to a Ray
worker must stop the run with a checkpoint and resume bit-identically: that test is
written below; it passed when run alone, and is skipped until it has passed repeatedly.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
import threading
import time

import pytest

from scaletrain.training.checkpoint import Checkpointer, step_folders
from scaletrain.training.state import params_sha256

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from resume_worker import build_trainer  # noqa: E402

SEED = int(os.environ.get("SCALETRAIN_CHAOS_SEED", "1616"))
STEPS, ROWS, ACCUM = 10, 64, 1  # resume_worker saves every 2 steps and logs every step
EVENTS = ("kill9", "sigterm", "disk_full")
PROCESS_TIMEOUT = 300  # a hung process fails the test instead of hanging it (JAX ignores SIGTERM when hung)


def _train_losses(out) -> dict[int, float]:
    """Loss per logged step; a resumed run's later line for a step wins."""
    by_step = {}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            if line.endswith("\n"):
                rec = json.loads(line)
                if rec.get("split") == "train":
                    by_step[rec["step"]] = rec["loss"]
    return by_step


def _logged_lines(out) -> list[dict]:
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except OSError:
        return []


def _start(out, log) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "resume_worker.py"), str(out), str(ACCUM),
                             str(ROWS), str(STEPS)], stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait_for_step(proc, out, lines_before: int, step: int) -> bool:
    """Until this process logs a step >= ``step`` (a new line of metrics.jsonl); False if it ended first."""
    while proc.poll() is None:
        if any(r.get("split") == "train" and r["step"] >= step for r in _logged_lines(out)[lines_before:]):
            return True
        time.sleep(0.01)  # polling a file the run appends to; no assertion depends on this interval
    return False


def _strike(proc, event: str) -> None:
    if event == "kill9":
        proc.send_signal(signal.SIGKILL)
    elif event == "sigterm":
        proc.send_signal(signal.SIGTERM)
    else:  # disk full: every write to a regular file fails from now on (soft limit only: no privilege needed)
        _, hard = resource.prlimit(proc.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (0, hard))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, in this process (same 8 fake devices and flags as the subprocesses)."""
    out = tmp_path_factory.mktemp("chaos") / "reference"
    trainer = build_trainer(str(out), ACCUM, ROWS, STEPS)
    trainer.train()
    return out, trainer


def _params_at(trainer, out, step: int) -> str:
    """Load checkpoint ``step`` of ``out`` into the reference trainer's state; its parameters' hash."""
    ckpt = Checkpointer.for_run(str(out), async_save=False)
    try:
        state, _, _ = ckpt.restore(step, trainer.model_state)
    finally:
        ckpt.close()
    assert int(state.step) == step
    return params_sha256(state.params)


def test_single_process_chaos_resumes_exactly_and_loses_no_checkpoint(reference, tmp_path):
    ref_out, ref_trainer = reference
    rng = random.Random(SEED)
    events = rng.sample(EVENTS, len(EVENTS))
    triggers = sorted(rng.sample(range(2, STEPS - 2), len(events)))
    print(f"\nchaos seed {SEED} (SCALETRAIN_CHAOS_SEED): {list(zip(events, triggers))}")
    out = tmp_path / "run"
    complete: set[int] = set()  # checkpoints seen complete before some event
    for rnd, (event, at) in enumerate(zip(events, triggers)):
        lines_before = len(_logged_lines(out))
        with open(tmp_path / f"round-{rnd}.log", "w") as log:
            proc = _start(out, log)
            try:
                struck = _wait_for_step(proc, out, lines_before, at)
                complete |= set(step_folders(str(out / "checkpoints")))  # complete: orbax renames on commit
                if struck:
                    _strike(proc, event)
                rc = proc.wait(timeout=PROCESS_TIMEOUT)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        tail = (tmp_path / f"round-{rnd}.log").read_text()[-3000:]
        where = f"round {rnd}: {event} at step {at} (seed {SEED}); rc {rc}\n{tail}"
        assert struck, where  # the run got to the step (it did not fail or finish first)
        if event == "kill9":
            assert rc == -signal.SIGKILL, where
        elif event == "sigterm":  # a clean stop with a checkpoint at the step it stopped after
            summary = json.loads((out / "summary.json").read_text())
            assert rc == 0 and "SIGTERM" in summary["stop_reason"], where
            assert summary["final_step"] in step_folders(str(out / "checkpoints")), where
            complete.add(summary["final_step"])
        else:  # the full disk fails the run; it must not hang or be mistaken for a finished one
            assert rc not in (0, -signal.SIGKILL), where
        lost = complete - set(step_folders(str(out / "checkpoints")))
        assert not lost, f"checkpoints {sorted(lost)} lost; {where}"

    with open(tmp_path / "final.log", "w") as log:
        proc = _start(out, log)
        rc = proc.wait(timeout=PROCESS_TIMEOUT)
    final = (tmp_path / "final.log").read_text()[-3000:]
    assert rc == 0, final
    summary = json.loads((out / "summary.json").read_text())
    ref_summary = json.loads((ref_out / "summary.json").read_text())
    assert summary["final_step"] == STEPS and summary["resumed_from"] is not None
    assert summary["params_sha256"] == ref_summary["params_sha256"], f"seed {SEED}: not bit-identical"
    assert _train_losses(out) == _train_losses(ref_out)  # every step's loss, redone steps included

    kept = step_folders(str(out / "checkpoints"))
    assert complete <= set(kept), f"checkpoints {sorted(complete - set(kept))} lost (seed {SEED})"
    ref_steps = set(step_folders(str(ref_out / "checkpoints")))
    for step in kept:  # each loads; a step the reference also saved holds the reference's parameters there
        got = _params_at(ref_trainer, out, step)
        if step in ref_steps:
            assert got == _params_at(ref_trainer, ref_out, step), f"checkpoint {step} differs (seed {SEED})"


# ------------------------------------------------------------------------------------------ Ray

RAY_STEPS = 8


@pytest.fixture(scope="module")
def ray_setup(tmp_path_factory):
    """A local Ray instance (2 CPUs), the 2-worker trainer of docs/distributed.md, and its uninterrupted run."""
    pytest.importorskip("ray")
    import jax.numpy as jnp
    import numpy as np
    import ray

    import scaletrain as st
    from scaletrain.data import bundled_tokenizer_path
    from scaletrain.distributed import RayDistributedTrainer
    from scaletrain.models import LlamaForCausalLM

    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        rng = np.random.default_rng(0)
        rows = [{"input_ids": (rng.integers(0, 128) + np.arange(rng.integers(8, 24))) % 128} for _ in range(64)]
        trainer = RayDistributedTrainer(
            bundled_tokenizer_path(), model_class=LlamaForCausalLM,
            config_scaling_variables={"hidden_size": 16, "intermediate_size": 32,
                                      "num_attention_heads": 2, "num_key_value_heads": 1},
            config_variables={"dtype": jnp.float32, "param_dtype": jnp.float32, "attn_dtype": jnp.float32,
                              "attn_softmax_dtype": jnp.float32, "num_hidden_layers": 2, "vocab_size": 128,
                              "max_position_embeddings": 64})
        root = tmp_path_factory.mktemp("chaos-ray")
        arguments = st.TrainingArguments(
            output_dir=str(root / "reference"), total_batch_size=8, max_length=16, num_train_epochs=None,
            max_training_steps=RAY_STEPS, learning_rate=1e-2, warmup_steps=2, log_steps=1, save_steps=2,
            progress_bar=False, do_eval=False, report_to=())
        ref = trainer.launch(num_workers=2, arguments=arguments, dataset_train=rows)
        yield trainer, arguments, rows, root, ref
    finally:
        ray.shutdown()


@pytest.mark.ray
@pytest.mark.skip(reason="issue 16 item 4: passed when run alone on 2026-11-23 (141 s); held out of the suite "
                         "until it has passed repeatedly under load and the suite has room for it")
def test_ray_worker_sigterm_stops_with_a_checkpoint_and_resumes_exactly(ray_setup):
    trainer, arguments, rows, root, ref = ray_setup
    rng = random.Random(SEED + 2)
    step, rank = rng.randint(2, RAY_STEPS - 3), rng.randint(0, 1)
    print(f"\nchaos seed {SEED}: SIGTERM to Ray worker {rank} once it logged step {step}")
    args = arguments.model_copy(update={"output_dir": str(root / "sigterm")})
    out = args.output_dir
    result: dict = {}

    def launch():
        try:
            result["run"] = trainer.launch(num_workers=2, arguments=args, dataset_train=rows)
        except BaseException as err:  # reported by the assertion below
            result["error"] = err

    thread = threading.Thread(target=launch)
    thread.start()
    placement = os.path.join(out, "ray", f"placement-{rank}.json")
    while thread.is_alive() and not (os.path.exists(placement) and any(
            r.get("split") == "train" and r["step"] >= step for r in _logged_lines(out))):
        time.sleep(0.01)  # waits on files the run writes; no assertion depends on the interval
    if thread.is_alive():
        with open(placement) as f:
            os.kill(json.load(f)["pid"], signal.SIGTERM)
    thread.join(PROCESS_TIMEOUT)
    assert not thread.is_alive(), f"seed {SEED}: the launch did not return {PROCESS_TIMEOUT}s after SIGTERM"
    assert "error" not in result, f"seed {SEED}: {result.get('error')!r}"
    summary = result["run"].summary
    assert "SIGTERM" in (summary.get("stop_reason") or ""), f"seed {SEED}: {summary.get('stop_reason')}"
    assert summary["final_step"] < RAY_STEPS and summary["final_step"] in step_folders(os.path.join(out, "checkpoints"))
    resumed = trainer.launch(num_workers=2, arguments=args.model_copy(update={"resume_if_possible": True}),
                             dataset_train=rows)
    assert resumed.summary["params_sha256"] == ref.summary["params_sha256"]
