"""``data.mixture``: token shares follow the weights, stages switch at their step, kill -9 resumes exactly,
exhausted sources repeat or stop (logged), per-source metrics and eval losses, bad mixtures refused."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import yaml
from data_helpers import CHAT_JSONL, PLAIN_TEMPLATE, REPO

from scaletrain.data.kinds import DATA_KINDS, DataKind
from scaletrain.data.loader import make_batch_iterator
from scaletrain.data.mixture import mix_rows
from scaletrain.data.mixture_schedule import CYCLE, cycle_counts, interleave
from scaletrain.data.packing import pack_documents
from scaletrain.errors import ConfigError
from scaletrain.recipe import Recipe
from scaletrain.run import run_training

WORKER = os.path.join(REPO, "tests", "mixture_worker.py")


def _source(first_token: int, n_docs: int, seed: int, max_length: int = 16):
    """Packed rows whose tokens lie in ``[first_token, first_token + 30]`` (so a batch row tells its source)."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(first_token + 1, first_token + 31, rng.integers(20, 200)) for _ in range(n_docs)]
    return pack_documents(docs, max_length, eos_id=first_token)


def _tokens_by_source(batch) -> tuple[int, int]:
    """Real tokens of source a (ids < 32) and b (ids >= 32) in a batch."""
    real = np.count_nonzero(batch["segment_ids"], axis=1)
    is_a = batch["input_ids"][:, 0] < 32
    return int(real[is_a].sum()), int(real[~is_a].sum())


A, B = _source(1, 40, seed=0), _source(33, 12, seed=1)


def test_interleaving_keeps_every_prefix_within_its_bound():
    """The docstring's bound of mixture_schedule: among the first j slots of a cycle a source has within
    1.5 (K + 1) rows of j n_k / CYCLE; the rates are rounded to whole rows of the cycle by at most one."""
    for weights in ([0.8, 0.2], [0.5, 0.3, 0.2], [0.999, 0.001], [1 / 3, 1 / 3, 1 / 3]):
        counts = cycle_counts(np.array(weights))
        assert counts.sum() == CYCLE and np.all(np.abs(counts - np.array(weights) * CYCLE) <= 1)
        pattern = interleave(counts)
        j = np.arange(1, CYCLE + 1)
        for k, n in enumerate(counts):
            assert np.abs(np.cumsum(pattern == k) - j * n / CYCLE).max() <= 1.5 * (len(weights) + 1)


def test_token_shares_follow_the_weights_over_200_steps():
    """0.8 / 0.2 over 200 steps of 16 rows: each share within 2 % of its weight, and equal to what the metrics say.

    Why the bound holds: the row counts are within 1.5 (K + 1) = 4.5 rows of their quota (plus one for the
    rounding of the rates to 1 / CYCLE); row rates are weight / mean real tokens per row, so the quota in
    tokens is exact up to those rows (<= max_length tokens each) and the deviation of a partly read pass
    from its mean (at most the sum over the source's rows of |tokens - mean|). ``bound`` adds these up
    for this data; it is below 2 % (asserted), and the measured shares are within it.
    """
    mixture = mix_rows({"a": A, "b": B}, {"a": 0.8, "b": 0.2})
    it = make_batch_iterator(mixture, 16, seed=7, process_index=0, process_count=1)
    totals = np.zeros(2)
    for step in range(1, 201):
        a, b = _tokens_by_source(next(it))
        totals += (a, b)
        if step in (1, 99, 200):
            figures = it.data_metrics(step)
            assert (figures["data/a/tokens"], figures["data/b/tokens"]) == (a, b)
            assert (figures["data/a/total_tokens"], figures["data/b/total_tokens"]) == tuple(totals)
    shares = totals / totals.sum()
    figures = it.data_metrics(200)
    assert figures["data/a/share"] == pytest.approx(shares[0], abs=1e-12)
    slack = 0.0
    for rows in (A, B):
        real = np.count_nonzero(rows.segment_ids, axis=1)
        slack += 5.5 * rows.max_length + np.abs(real - real.mean()).sum()
    bound = 2 * slack / totals.sum()
    assert bound < 0.02
    assert abs(shares[0] - 0.8) <= bound and abs(shares[1] - 0.2) <= bound
    assert figures["data/b/passes"] > 1  # the small source was repeated, reshuffled


def test_a_staged_mixture_switches_at_its_step():
    """b enters at step 50 (batch index 50) and a leaves: batches 0..49 are all a, 50.. all b; a two-stage
    0.8/0.2 -> 0.2/0.8 mixture has each stage's row counts at its own rates."""
    mixture = mix_rows({"a": A, "b": B}, {"a": {0: 1.0, 50: 0.0}, "b": {50: 1.0}})
    it = make_batch_iterator(mixture, 8, seed=0, process_index=0, process_count=1)
    sources = [_tokens_by_source(next(it)) for _ in range(60)]
    assert all(b == 0 < a for a, b in sources[:50]) and all(a == 0 < b for a, b in sources[50:])
    assert it.data_metrics(50)["data/b/tokens"] == 0 < it.data_metrics(51)["data/b/tokens"]

    staged = mix_rows({"a": A, "b": B}, {"a": {0: 0.8, 30: 0.2}, "b": {0: 0.2, 30: 0.8}})
    it = make_batch_iterator(staged, 8, seed=0, process_index=0, process_count=1)
    rows_a = [int(np.sum(next(it)["input_ids"][:, 0] < 32)) for _ in range(60)]
    mean = [np.count_nonzero(r.segment_ids) / r.num_rows for r in (A, B)]
    for stage, (wa, wb) in enumerate(((0.8, 0.2), (0.2, 0.8))):
        rate_a = (wa / mean[0]) / (wa / mean[0] + wb / mean[1])
        assert abs(sum(rows_a[30 * stage:30 * (stage + 1)]) - rate_a * 240) <= 4.5 + 1


def test_processes_share_each_global_batch_and_a_restored_iterator_continues_exactly(caplog):
    mixture = mix_rows({"a": A, "b": B}, {"a": 0.7, "b": 0.3})
    whole = make_batch_iterator(mixture, 8, seed=3, process_index=0, process_count=1)
    halves = [make_batch_iterator(mixture, 8, seed=3, process_index=p, process_count=2) for p in (0, 1)]
    for _ in range(30):
        batch = next(whole)
        joined = np.concatenate([next(h)["input_ids"] for h in halves])
        np.testing.assert_array_equal(joined, batch["input_ids"])
    state = whole.get_state()
    assert state["next_index"] == 30
    ahead = [next(whole)["input_ids"] for _ in range(25)]  # crosses passes of b
    resumed = make_batch_iterator(mixture, 8, seed=3, process_index=0, process_count=1)
    resumed.set_state(json.loads(json.dumps(state)))  # as a checkpoint stores it
    for expected in ahead:
        np.testing.assert_array_equal(next(resumed)["input_ids"], expected)
    other = make_batch_iterator(mix_rows({"a": A, "b": B}, {"a": 0.5, "b": 0.5}), 8, seed=3, process_index=0,
                                process_count=1)
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        other.set_state(state)
    assert "another data.mixture than the checkpoint's" in caplog.text


def test_an_exhausted_source_repeats_or_stops_as_chosen_and_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="scaletrain"):
        repeat = make_batch_iterator(mix_rows({"a": A, "b": B}, {"a": 0.5, "b": 0.5}), 8, seed=0,
                                     process_index=0, process_count=1)
        for _ in range(30):  # ~120 rows of b's 70
            next(repeat)
    assert f"source 'b' has been read whole ({B.num_rows} rows); it starts pass 2" in caplog.text
    caplog.clear()
    stop = mix_rows({"a": A, "b": B}, {"a": 0.5, "b": 0.5}, {"b": "stop"})
    it = make_batch_iterator(stop, 8, seed=0, process_index=0, process_count=1)
    with caplog.at_level(logging.INFO, logger="scaletrain"):
        served = [_tokens_by_source(batch) for batch in it]
    b_rows = np.count_nonzero(B.segment_ids)
    assert sum(b for _, b in served) <= b_rows  # b never read twice
    assert sum(b for _, b in served) > b_rows - 8 * B.max_length  # ...and read to within one batch of its end
    assert f"source 'b' has been read whole ({B.num_rows} rows) after step {len(served)}" in caplog.text
    assert "on_exhausted: stop" in caplog.text and "starts pass" not in caplog.text


# ------------------------------------------------------------------------------- recipes


def _recipe(tmp_path, **training) -> dict:
    """Shakespeare (one play, pre-training) and 48 conversations of the example chat set (chat),
    0.8 / 0.2 then 0.5 / 0.5 from step 4 (after 3 steps)."""
    chat = tmp_path / "chat.jsonl"
    if not chat.exists():
        tmp_path.mkdir(parents=True, exist_ok=True)
        chat.write_text("".join(open(CHAT_JSONL).readlines()[:48]))
    return {
        "model": {"type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2},
        "data": {"eval_fraction": 0.1, "mixture": [
            {"source": "bundled:shakespeare", "max_documents": 1, "weight": {0: 0.8, 3: 0.5}},
            {"name": "chat", "source": str(chat), "kind": "chat", "chat_template": PLAIN_TEMPLATE,
             "weight": {0: 0.2, 3: 0.5}},
        ]},
        "tokenizer": {"path": "bundled"},
        "training": {"output_dir": str(tmp_path / "run"), "total_batch_size": 8, "max_length": 64,
                     "num_train_epochs": None, "max_training_steps": 6, "learning_rate": 1e-2, "log_steps": 1,
                     "save_steps": 2, "evaluation_steps": 3, "max_evaluation_steps": 1, "progress_bar": False,
                     "resume_if_possible": True, "report_to": [], **training},
    }


def _records(out, split):
    by_step = {}
    for line in open(os.path.join(out, "metrics.jsonl")):
        rec = json.loads(line)
        if rec.get("split") == split:
            by_step[rec["step"]] = rec  # a resumed run's later line for a step wins
    return by_step


def _worker(path, kill_at=None):
    cmd = [sys.executable, WORKER, str(path), *([str(kill_at)] if kill_at else [])]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.slow
def test_a_recipe_mixture_logs_per_source_figures_and_resumes_bitwise_after_kill_9(tmp_path):
    """In-process reference run; the same recipe killed (SIGKILL) after step 3 (its last checkpoint: step 2)
    and resumed across the stage change ends with the same parameters and logs the same per-source figures;
    each source has its eval loss; stage 2 starts at step 4."""
    ref = run_training(Recipe.from_dict(_recipe(tmp_path / "ref")))
    out = tmp_path / "ref" / "run"
    train, evals = _records(out, "train"), _records(out, "eval")
    stats = json.loads((out / "data_stats.json").read_text())
    assert stats["kind"] == "mixture" and set(stats["sources"]) == {"shakespeare", "chat"}
    assert stats["sources"]["chat"]["kind"] == "chat"
    for name in ("shakespeare", "chat"):
        assert np.isfinite(evals[6][f"eval_{name}_loss"]) and f"data/{name}/share" in train[6]
    # the stages: the chat share of the step's tokens goes from ~0.2 to ~0.5 at step 4 (rows are 512 slots)
    chat = {s: r["data/chat/tokens"] / (r["data/chat/tokens"] + r["data/shakespeare/tokens"]) for s, r in train.items()}
    assert max(chat[s] for s in range(1, 4)) < 0.35 < min(chat[s] for s in range(4, 7))

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(_recipe(tmp_path)))
    killed = _worker(path, kill_at=3)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = _worker(path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["resumed_from"] is not None
    assert summary["params_sha256"] == ref["params_sha256"]
    again = _records(tmp_path / "run", "train")
    for step, rec in train.items():
        assert {k: v for k, v in again[step].items() if k.startswith("data/") or k == "loss"} == \
               {k: v for k, v in rec.items() if k.startswith("data/") or k == "loss"}


BAD = [
    ({"weight": 0}, "data.mixture.1.weight: a weight must be positive"),
    ({"weight": -0.5}, "data.mixture.1.weight: a weight must be positive"),
    ({"weight": {0: 0.0, 5: 0.0}}, "data.mixture.1.weight: weights must be >= 0 in every stage"),
    ({"weight": {-1: 1.0}}, "data.mixture.1.weight: the steps of a staged weight must be >= 0"),
    ({"kind": "nope"}, "data.mixture.1.kind: unknown data kind 'nope'"),
    ({"kind": "prompt_test"}, "data.mixture.1.kind: a mixture holds the kinds pretrain, chat"),
    ({"name": "a"}, "data.mixture.1.name: 'a' is also the name of data.mixture.0"),
    ({"name": "a b"}, "data.mixture.1.name: String should match pattern"),
    ({"mixture": [{"weight": 1}]}, "data.mixture.1.mixture: a mixture's entry cannot itself be"),
    ({"on_exhausted": "drop"}, "data.mixture.1.on_exhausted: Input should be 'repeat' or 'stop'"),
]


@pytest.mark.parametrize("entry,message", BAD, ids=[m.split(":")[0] + "-" + str(i) for i, (_, m) in enumerate(BAD)])
def test_a_bad_mixture_is_one_message_naming_the_field(entry, message):
    DATA_KINDS["prompt_test"] = DataKind("prompt_test", column=lambda d: "prompt", build=DATA_KINDS["pretrain"].build)
    try:
        with pytest.raises(ConfigError) as err:
            Recipe.from_dict({"data": {"mixture": [{"name": "a", "weight": 1}, {"weight": 1, **entry}]}},
                             where="r.yaml")
    finally:
        del DATA_KINDS["prompt_test"]
    lines = str(err.value).splitlines()
    assert lines[0] == "r.yaml: invalid recipe" and len(lines) == 2, lines
    assert lines[1].startswith(message), lines[1]


def test_a_stage_without_weight_and_an_empty_mixture_are_refused():
    with pytest.raises(ConfigError, match="data.mixture: no source has a positive weight at step 0"):
        Recipe.from_dict({"data": {"mixture": [{"name": "a", "weight": {5: 1}}, {"name": "b", "weight": {5: 1}}]}})
    with pytest.raises(ConfigError, match="data.mixture: no source has a positive weight at step 10"):
        Recipe.from_dict({"data": {"mixture": [{"name": "a", "weight": {0: 1, 10: 0}}, {"name": "b", "weight": {20: 1}}]}})
    with pytest.raises(ConfigError, match="no mixture source has a positive weight at step 10"):
        mix_rows({"a": A, "b": B}, {"a": {0: 1, 10: 0}, "b": {20: 1}})
    with pytest.raises(ConfigError, match="data.mixture: list at least one source"):
        Recipe.from_dict({"data": {"mixture": []}})


def test_keys_beside_the_mixture_are_every_entry_default():
    data = Recipe.from_dict({"data": {"skip_bad_rows": True, "kind": "chat", "mixture": [
        {"source": "x/chat.jsonl", "weight": 1},
        {"source": "bundled:shakespeare", "kind": "pretrain", "weight": 2}]}}).data
    first, second = data.mixture
    assert (first.name, first.kind, first.skip_bad_rows) == ("chat", "chat", True)
    assert (second.name, second.kind, second.skip_bad_rows) == ("shakespeare", "pretrain", True)
    assert Recipe.from_dict(yaml.safe_load(Recipe.from_dict({"data": data.model_dump()}).to_yaml())).data == data


@pytest.mark.parametrize("change,message", [
    ({"weight": 0}, "data.mixture.1.weight: a weight must be positive"),
    ({"source": "nope.jsonl", "name": "missing"}, "data.mixture[1] ('missing'): data file not found: nope.jsonl"),
], ids=["weight", "missing-source"])
def test_cli_refuses_a_bad_mixture_with_one_message_and_exit_2(tmp_path, change, message):
    recipe = _recipe(tmp_path)
    recipe["data"]["mixture"][1].update(change)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(recipe))
    res = subprocess.run([sys.executable, "-m", "scaletrain", "train", str(path)], capture_output=True, text=True,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert message in res.stderr


def test_the_ray_prelaunch_check_reads_every_source_of_a_mixture(tmp_path):
    from scaletrain.errors import DataError
    from scaletrain.launch.ray.prelaunch import check_recipe_before_launch

    recipe = _recipe(tmp_path)
    check_recipe_before_launch(Recipe.from_dict(recipe))
    recipe["data"]["mixture"][1].update(source=str(tmp_path / "nope.jsonl"), name="missing")
    with pytest.raises(DataError, match=r"data.mixture\[1\] \('missing'\): data file not found"):
        check_recipe_before_launch(Recipe.from_dict(recipe))
