"""A multi-turn row's kept pages, driven through an open schedule on tiny models of the page kinds: DeepSeek-V3's
latent pages keep and resume, a Qwen3.5 Gated DeltaNet hybrid (per-slot state) falls back to whole prefills, and
a pool too small for every kept page gives them back (at insertion and before a decode step) rather than preempt.
The overlapped rollout on the tiny Llama, with its keep-off twin: tests/test_agent_overlap.py.

Tolerances: tokens equal; log-probabilities within 2e-6 (float32): a resumed turn's prefix keys came from the
prefill and decode programs and its new tokens' from a chunk over them, so the same sums run in another order
(the continuous engine tests' tolerance for the last bits; measured <= 5e-7).
"""

from __future__ import annotations

import numpy as np
import pytest

from scaletrain.generation import SamplingParams
from scaletrain.generation.continuous import ContinuousBatchEngine
from scaletrain.generation.schedule import Schedule
from engine_testing import tiny_mla

LP_TOL = 2e-6
NEW = 12
ROWS = 4
EXTRA = [11, 12, 13]  # a "tool output" between two turns


def _two_turns(model, *, keep_pages: bool, slots: int = 2, cache_pages: int | None = 64,
               temperature: float = 1.0, delay: int = 0) -> tuple[list, dict]:
    """Each of ``ROWS`` rows samples a turn, then (its context, that turn and ``EXTRA``) a second one, queued as
    ``delay`` rounds after its first stops, as the overlapped loop queues a row whose tools came back; every turn
    submitted with ``keep``. Returns each row's two turns (ids, log-probs) and the engine's stats."""
    sampling = SamplingParams(max_completion_length=NEW, temperature=temperature, stop_token_ids=(2, 7, 9),
                              pad_token_id=0)
    engine = ContinuousBatchEngine(sampling, slots=slots, page_size=4, decode_steps=4, prefill_chunk=8,
                                   keep_pages=keep_pages, cache_pages=cache_pages)
    rs = np.random.RandomState(1)
    prompts = [[int(t) for t in rs.randint(3, 128, n)] for n in (5, 9, 3, 7)]
    turns: list[list] = [[] for _ in range(ROWS)]
    later: list[tuple[int, int, list[int]]] = []  # (round due, row, context) of the second turns not yet queued
    with engine.session(model, rows=ROWS, longest=9, seed=3, step=1) as run:
        for row, prompt in enumerate(prompts):
            run.submit(prompt, [row], keep=True)
        done = 0
        while run.busy or later:
            finished = run.advance() if run.busy else []
            done += 1
            for row, (ids, lps) in zip(finished, run.read(finished)):
                turns[row].append((ids, lps))
                if len(turns[row]) == 1:
                    later.append((done + delay, row, prompts[row] + ids + EXTRA))
                else:
                    run.forget(row)
            for due, row, context in [x for x in later if x[0] <= done]:
                later.remove((due, row, context))
                run.submit(context, [row], seed=4, limit=NEW + len(prompts[row]) - len(context), keep=True)
    return turns, dict(engine.stats)


def _same(a: list, b: list) -> None:
    for turns_a, turns_b in zip(a, b):
        for (ids_a, lps_a), (ids_b, lps_b) in zip(turns_a, turns_b, strict=True):
            assert ids_a == ids_b
            np.testing.assert_allclose(lps_a, lps_b, rtol=0, atol=LP_TOL)


@pytest.fixture(scope="module")
def mla():
    return tiny_mla(layers=1)


def test_latent_pages_are_kept_and_a_short_pool_gives_them_back_before_preempting(mla, monkeypatch) -> None:
    """DeepSeek-V3's keys-only latent pages are kept: every second turn resumes over them, to the tokens of whole
    prefills. With three slots over the smallest pool (two rows at their longest) and second turns queued four
    rounds late, kept pages go back both to fit an insertion and before a decode step the pool could not give pages
    for, and no live row is preempted; the turns still equal, and every page comes back."""
    whole, plain = _two_turns(mla, keep_pages=False)
    kept, stats = _two_turns(mla, keep_pages=True)
    _same(kept, whole)
    assert plain["prefills_resumed"] == 0 and stats["prefills_resumed"] == ROWS and stats["kept_prefix_tokens"] > 0
    assert stats["pages_in_use"] == plain["pages_in_use"] == 0

    dropped = []
    drop = Schedule._drop_kept

    def spy(self, spare=frozenset()):
        done = drop(self, spare)
        dropped.append(("insert" if spare else "decode", done))
        return done

    monkeypatch.setattr(Schedule, "_drop_kept", spy)
    small, short = _two_turns(mla, keep_pages=True, slots=3, cache_pages=1, delay=4)  # rows hold kept pages longer
    _same(small, whole)
    assert ("insert", True) in dropped and ("decode", True) in dropped  # given back at both places
    assert short["kept_dropped"] > 0 and short["preemptions"] == 0 and short["pages_in_use"] == 0


def test_gated_deltanet_hybrid_falls_back_to_whole_prefills() -> None:
    """Qwen3.5's Gated DeltaNet layers keep a per-slot state that kept pages would not restore: its turns are
    prefilled whole, however they are submitted, and every page comes back."""
    from preference_testing import one_device_mesh
    from scaletrain.models import Qwen3_5ForCausalLM, Qwen3_5TextConfig, create_sharded_model

    config = Qwen3_5TextConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                               full_attention_interval=2, max_position_embeddings=64, eos_token_id=1,
                               pad_token_id=0)
    hybrid = create_sharded_model(Qwen3_5ForCausalLM, config, seed=0, mesh=one_device_mesh())[0]
    _, stats = _two_turns(hybrid, keep_pages=True)
    assert stats["prefills_resumed"] == stats["kept_dropped"] == 0 and stats["prefills"] == 2 * ROWS
    assert stats["pages_in_use"] == 0
