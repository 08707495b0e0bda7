"""The command line on Ray: `scaletrain train RECIPE ray.num_workers=2` and `scaletrain sweep`.

Each command runs in a subprocess, as a user's would: the training joins a Ray instance
started beforehand (`ray.address=auto`); the sweep's first run starts and stops its own local
one and its re-run joins the instance the training used (`--address auto`), so the module
starts two Ray instances rather than three. The recipe is examples/sweep.yaml (the one
docs/distributed.md uses), shrunk by overrides.
"""

import json
import os
import subprocess
import sys

import pytest

from xla_testing import CHEAP_COMPILE

pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "examples", "sweep.yaml")
TINY = ["model.hidden_size=16", "model.intermediate_size=32", "model.num_hidden_layers=1",
        "data.max_documents=2", "training.max_length=64", "training.total_batch_size=4",
        "training.max_training_steps=4", "training.log_steps=2", "training.save_steps=2",
        "training.max_evaluation_steps=2", "training.report_to=[]"]


def _scaletrain(*args, cwd, timeout=420, **extra_env):
    # no fake devices for a real CLI run, the suite's cheap compile setting (the driver passes it to its Ray
    # workers and sweep members: launch/xla_flags.py); no figure here is compared with another process's
    env = {**os.environ, "XLA_FLAGS": CHEAP_COMPILE}
    env.update(PYTHONPATH=ROOT, RAY_AUTH_MODE="disabled", JAX_PLATFORMS="cpu", **extra_env)
    cmd = ["timeout", "-s", "KILL", str(timeout), sys.executable, "-m", "scaletrain", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env)


HEAD = """
import sys, ray
ray.init(num_cpus=2, include_dashboard=False)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()  # until the test closes stdin
ray.shutdown()
"""


@pytest.fixture(scope="module")
def running_cluster(tmp_path_factory):
    """A Ray instance started outside the CLI (as a user's cluster), stopped through its own driver."""
    tmp_path = tmp_path_factory.mktemp("head")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}  # no scaletrain on it
    env["RAY_AUTH_MODE"] = "disabled"
    head = subprocess.Popen(["timeout", "-s", "KILL", "600", sys.executable, "-c", HEAD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    address = head.stdout.readline().strip()
    yield address
    head.stdin.close()
    head.wait(timeout=120)


def test_train_recipe_on_two_ray_workers(tmp_path, running_cluster):
    """`ray.address=auto` joins the running cluster (found through RAY_ADDRESS, as `ray start` sets it up)."""
    res = _scaletrain("train", RECIPE, *TINY, "training.output_dir=run", "ray.num_workers=2", "ray.address=auto",
                      cwd=tmp_path, RAY_ADDRESS=running_cluster)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["process_count"] == 2 and summary["final_step"] == 4
    placement = json.loads((tmp_path / "run" / "ray" / "placement-1.json").read_text())
    assert placement["mesh_processes"] == [0, 1] and placement["fully_addressable_sharded_params"] == 0
    assert "final_eval_loss" in res.stdout
    # Ray Train's placement-group watcher, asking a state API this cluster does not run, is silenced
    assert "Failed to query Ray Train Controller" not in res.stdout + res.stderr
    attempts = (tmp_path / "run" / "ray_attempts.jsonl").read_text().splitlines()
    assert len(attempts) == 1 and json.loads(attempts[0])["processes"] == 2


def test_sweep_reports_failures_and_resumes(tmp_path, running_cluster):
    first = _scaletrain(
        "sweep", RECIPE, "--scaling-indices", "1,2,3", "--num-cpus", "2", *TINY, "training.output_dir=ladder",
        'sweep.member_overrides={2: ["data.source=/nonexistent/*.txt"], 3: ["training.exit_iteration_this_run=2"]}',
        cwd=tmp_path,
    )
    assert first.returncode == 1, (first.stdout + first.stderr)[-4000:]
    report = json.loads((tmp_path / "ladder" / "sweep.json").read_text())
    status = {m["scaling_index"]: m for m in report["members"]}
    assert status[1]["status"] == "finished" and status[1]["final_eval_loss"] is not None
    assert status[2]["status"] == "failed" and "DataError" in status[2]["error"]
    assert status[3]["status"] == "stopped early" and status[3]["final_step"] == 2
    assert report["fit"]["ok"] is False and "at least 3" in report["fit"]["reason"]
    assert "1 member(s) failed: [2]" in first.stderr
    first_summary = (tmp_path / "ladder" / "member-1" / "summary.json").stat().st_mtime_ns

    # the re-run joins the running cluster (`--address auto`, found through RAY_ADDRESS): members run there too
    second = _scaletrain("sweep", RECIPE, "--scaling-indices", "1,2,3", "--address", "auto", *TINY,
                         "training.output_dir=ladder", cwd=tmp_path, RAY_ADDRESS=running_cluster)
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    report = json.loads((tmp_path / "ladder" / "sweep.json").read_text())
    status = {m["scaling_index"]: m for m in report["members"]}
    assert status[1]["status"] == "skipped (finished earlier)"
    assert (tmp_path / "ladder" / "member-1" / "summary.json").stat().st_mtime_ns == first_summary
    assert status[2]["status"] == "finished" and status[3]["status"] == "finished"
    resumed = json.loads((tmp_path / "ladder" / "member-3" / "summary.json").read_text())["resumed_from"]
    assert resumed.endswith("member-3/checkpoints/2")  # continued, not started over
    params = [status[i]["num_params"] for i in (1, 2, 3)]
    flops = [status[i]["flops"] for i in (1, 2, 3)]
    assert params == sorted(params) and flops == sorted(flops) and len(set(params)) == 3
    # three members for three parameters: the curve passes through every point, no evidence
    assert report["fit"]["status"] == "exactly_determined" and report["fit"]["ok"] is False
    assert report["fit"]["points"] == 3
    csv_lines = (tmp_path / "ladder" / "sweep.csv").read_text().splitlines()
    assert csv_lines[0].startswith("scaling_index,status,num_params") and len(csv_lines) == 4
    png = (tmp_path / "ladder" / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
