"""Stopping rules agree across processes (a per-process stop would hang the others' collectives).

The agreement is checked here with a faked second process; tests/test_ray_launch.py
runs real ones.
"""

from types import SimpleNamespace

import jax
import numpy as np
from jax.experimental import multihost_utils

from scaletrain.training.stopping import _NAME_BYTES, StoppingRules


def _trainer(**args):
    base = dict(exit_iteration=None, exit_iteration_this_run=None, kill_switch_path=None,
                training_time_limit=None, time_limit_seconds=None, log_steps=4)
    stops: list[str] = []
    t = SimpleNamespace(arguments=SimpleNamespace(**{**base, **args}), start_step=0, max_training_steps=100,
                        global_step=0, request_stop=stops.append)
    return t, stops


def test_per_process_conditions_are_agreed_at_log_steps(monkeypatch, tmp_path):
    gathered = []

    other = np.zeros(1 + _NAME_BYTES, np.int32)  # a process's row: its stop code, then the signal's name
    other[0] = 3  # the other process has reached its time limit

    def fake_allgather(x):
        gathered.append(int(x[0]))
        return np.stack([x, other])

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather", fake_allgather)
    rules = StoppingRules()
    trainer, stops = _trainer(training_time_limit="1h")
    rules._deadline = None
    rules._check(trainer, 5)  # not a log step: no collective, no stop
    assert gathered == [] and stops == []
    rules._check(trainer, 8)
    assert gathered == [0] and stops == ["reached training_time_limit 1h at step 8"]
    # exit_iteration is decided alone (every process counts the same steps)
    trainer, stops = _trainer(exit_iteration=6)
    rules._check(trainer, 6)
    assert stops == ["reached exit_iteration 6"] and gathered == [0]
    # one process's kill switch and another's clock: the kill switch, as in a single process
    switch = tmp_path / "stop"
    switch.write_text("")
    trainer, stops = _trainer(kill_switch_path=str(switch))
    rules._check(trainer, 4)
    assert gathered[-1] == 2 and stops == [f"found kill switch {switch} at step 4"]


def test_a_signal_seen_by_another_process_is_named_everywhere(monkeypatch):
    """A driver's stop request is read by each process on its own: at a log step one may have read
    it and another not yet. Both stop after that step, and both name the signal."""
    other = np.zeros(1 + _NAME_BYTES, np.int32)  # a process's row: its stop code, then the signal's name
    name = b"SIGINT sent to the Ray driver"
    other[0], other[1:1 + len(name)] = 1, np.frombuffer(name, np.uint8)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.stack([x, other]))
    trainer, stops = _trainer()
    rules = StoppingRules()
    rules._deadline = None
    rules._check(trainer, 4)
    assert stops == ["received SIGINT sent to the Ray driver at step 4"]
