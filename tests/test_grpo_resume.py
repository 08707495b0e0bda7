"""A GRPO recipe run killed with SIGKILL inside a ``num_iterations`` cycle and resumed ends with the parameters
and figures of an uninterrupted run (the reused rollout comes back from the checkpoint); resuming against another
reference model is refused, naming it. A multi-turn run (tool and environment turns) killed and resumed replays
the same episodes to the same parameters as an uninterrupted run on two processes, each of which ran only its
own rows' tools and environment steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from preference_testing import export, tiny_llama, word_tokenizer
from xla_testing import child_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "grpo_resume_worker.py")
AGENTIC_WORKER = os.path.join(ROOT, "tests", "agentic_resume_worker.py")
STEPS = (1, 2, 3, 4)
PROMPTS = ["what is two plus three", "the sky colour", "say hello", "name a fruit", "count to four", "the dog",
           "is the cat a dog", "say goodbye"]


def _worker(workdir, run, kill_at=None, reference=None, objective="grpo", cmd=None, devices=1, wait=True):
    cmd = cmd or [sys.executable, WORKER, str(workdir), run, str(kill_at) if kill_at else "-"] + (
        [reference] if reference else [])
    # one CPU device (the suite's 8 are for the mesh tests): the run compiles several times faster; the cheap
    # compile setting too, as every run compared here is such a child (tests/xla_testing.py)
    env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": child_xla_flags(devices), "RESUME_OBJECTIVE": objective}
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def _train_records(path, objective="grpo"):
    keys = ("loss", "kl", "clip_ratio/region_mean", "reward") if objective == "grpo" else (
        "loss", "loss/value_avg", "val/clipfrac_avg", "reward")
    return {r["step"]: tuple(r.get(k) for k in keys)
            for r in map(json.loads, path.read_text().splitlines()) if r["split"] == "train"}


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["grpo", "ppo"])
def test_sigkill_inside_a_num_iterations_cycle_and_resume_is_bitwise_identical(tmp_path, objective):
    """GRPO, and PPO (its value head in the state, its per-token advantages and returns in the stored rollout)."""
    word_tokenizer(str(tmp_path / "tok"))
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    ref = _worker(tmp_path, "ref", objective=objective)
    assert ref.returncode == 0, ref.stderr[-3000:]
    # steps 1 3 5... sample (every 3rd step, from 1), the checkpoint of step 2 sits inside the first cycle
    killed = _worker(tmp_path, "run", kill_at=3, objective=objective)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    data = json.loads((tmp_path / "run" / "checkpoints" / "2" / "data" / "metadata").read_text())
    assert data["train"]["repeat"] == 2 and data["train"]["rollout"]["index"] == 0  # the rollout of step 1, stored
    if objective == "grpo":  # the reference check is the same code for both
        other = export(tiny_llama(seed=11, layers=1), str(tmp_path / "other_reference"))
        refused = _worker(tmp_path, "run", reference=other)
        assert refused.returncode != 0 and "trained against the reference" in refused.stderr, refused.stderr[-3000:]
    resumed = _worker(tmp_path, "run", objective=objective)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "sampling it again" not in resumed.stderr
    ref_summary = json.loads((tmp_path / "ref" / "summary.json").read_text())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["resumed_from"].endswith("/2") and summary["final_step"] == 6
    assert summary["params_sha256"] == ref_summary["params_sha256"]
    assert summary["reference"] == ref_summary["reference"] and summary["reference"]["reference"].startswith("starting")
    records = _train_records(tmp_path / "run" / "metrics.jsonl", objective)
    assert records == _train_records(tmp_path / "ref" / "metrics.jsonl", objective) and len(records) == 6
    assert [s for s, r in sorted(records.items()) if r[3] is not None] == [1, 4]  # rewards come with each rollout
    assert records[3][2] is not None and records[3][0] != records[1][0]  # the reused rollout's update moved
    if objective == "ppo":  # the export is the policy, a causal LM transformers loads (the value head left out)
        from safetensors import safe_open

        from scaletrain.export import export_checkpoint

        folder = export_checkpoint(str(tmp_path / "run"), str(tmp_path / "export"))
        with safe_open(os.path.join(folder, "model.safetensors"), framework="np") as f:
            assert "score.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
        assert json.loads((tmp_path / "export" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.slow
def test_multi_turn_run_on_two_processes_runs_each_rows_calls_once_and_equals_one_process_killed_and_resumed(
        tmp_path):
    """Episodes with tool turns and environment turns (``agentic_resume_worker.py``): environments seeded by
    ``(seed, step, row)``, later turns by ``(seed, turn)``. The reference runs on two processes (one CPU device
    each), where each process runs the ``look`` calls and ``step``s of its own 4 rows only and takes the others'
    outcomes from their owner (``OwnedCalls``); the run compared with it is one process with two devices (the same
    mesh), killed with SIGKILL after step 3 and resumed. Equal bit for bit: two processes build the episodes one
    process builds, and the resumed run replays steps 3 and 4 exactly. (One row for both guarantees: a two-process
    row of its own would cost ~25 CPU-s more.)"""
    from agentic_testing import chatml_tokenizer
    from scaletrain.launch.jax.supervisor import free_port
    from scaletrain.rl.agentic import episode_seed

    chatml_tokenizer(str(tmp_path / "tok"))

    def run(out, last=None, devices=2, wait=True):
        return _worker(tmp_path, out, cmd=[sys.executable, AGENTIC_WORKER, str(tmp_path / out), str(tmp_path / "tok")]
                       + ([str(last)] if last else []), devices=devices, wait=wait)

    port = free_port()
    pair = [run("ref", f"{port}:{rank}", devices=1, wait=False) for rank in (0, 1)]
    for child in pair:
        text, _ = child.communicate(timeout=600)
        assert child.returncode == 0, text[-3000:]
    # each process's environments ran calls of its own rows only (the first 4 of each step's 8 are process 0's)
    seeds = {int(p.stem): set(p.read_text().split()) for p in (tmp_path / "ref-calls").iterdir()}
    rows = {p: {str(episode_seed(0, step, r)) for step in STEPS for r in range(4 * p, 4 * p + 4)} for p in (0, 1)}
    assert sorted(seeds) == [0, 1] and all(seeds[p] and seeds[p] <= rows[p] for p in (0, 1))
    killed = run("run", 3)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run("run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (tmp_path / "run" / "params_sha256").read_text() == (tmp_path / "ref" / "params_sha256").read_text()
    episodes = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert episodes == [json.loads(line) for line in (tmp_path / "ref" / "completions.jsonl").read_text()
                        .splitlines()]
    assert [e["step"] for e in episodes] == [s for s in (1, 2, 3, 4) for _ in range(8)]
    roles = [t["role"] for e in episodes for t in e["completion"]["turns"]]
    assert roles.count("tool") >= 16 and roles.count("user") >= 8  # tool turns and environment turns were replayed
    keys = ("loss", "reward", "tools/call_frequency", "tools/environment_tokens", "tools/turns_per_episode")
    records = {r["step"]: tuple(r.get(k) for k in keys)
               for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
               if r["split"] == "train"}
    assert records == {r["step"]: tuple(r.get(k) for k in keys)
                       for r in map(json.loads, (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines())
                       if r["split"] == "train"} and len(records) == 4
    # and between them, the calls of every episode that one process ran calls for
    assert seeds[0] | seeds[1] == set((tmp_path / "run-calls" / "0.txt").read_text().split())
