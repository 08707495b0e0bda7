"""The continuous-batching engine over a paged cache: a row's tokens and log-probabilities do not depend on
its slot or neighbours, equal the static engine's, a prompt's samples prefill once, every page comes back.

Tolerances: tokens must be equal; log-probabilities within 2e-6 (float32; the programs of different slot
counts batch the same per-row sums differently, so only the last bits may differ; measured <= 5e-7).
"""

from __future__ import annotations

import numpy as np
import pytest

from scaletrain.generation import SamplingParams, StaticBatchEngine
from scaletrain.generation.continuous import ContinuousBatchEngine
from engine_testing import tiny_mla
from preference_testing import one_device_mesh, tiny_llama

LP_TOL = 2e-6
NEW = 10
G = 2
STOPS = (2, 7, 9)  # frequent enough in a random 128-word model that rows stop early and slots refill


def _prompts() -> list[list[int]]:
    """Four prompts of 5, 9, 3 and 17 tokens: two prompt buckets (16, 32), whole and partial pages of 4 tokens."""
    rs = np.random.RandomState(0)
    return [[int(t) for t in rs.randint(3, 128, n)] for n in (5, 9, 3, 17)]


def _sampling(temperature: float) -> SamplingParams:
    return SamplingParams(max_completion_length=NEW, temperature=temperature, stop_token_ids=STOPS, pad_token_id=0)


def _run(model, temperature: float, slots: int, prompts=None, **kw) -> tuple[dict[str, np.ndarray], dict]:
    engine = ContinuousBatchEngine(_sampling(temperature), slots=slots, page_size=4, decode_steps=4, **kw)
    out = engine.generate(model, prompts or _prompts(), num_generations=G, seed=3, step=1)
    return {k: np.asarray(getattr(out, k)) for k in ("completion_ids", "completion_mask", "log_probs", "lengths",
                                                      "truncated")}, engine.stats


def _assert_rows_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray], rows=slice(None)) -> None:
    for key in ("completion_ids", "completion_mask", "lengths", "truncated"):
        np.testing.assert_array_equal(a[key][rows], b[key][rows], err_msg=key)
    np.testing.assert_allclose(a["log_probs"][rows], b["log_probs"][rows], rtol=0, atol=LP_TOL)


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(0)


@pytest.fixture(scope="module")
def hybrid():
    """A 4-layer Qwen3.5 text model: Gated DeltaNet layers (per-slot state) and a full-attention layer (pages)."""
    from scaletrain.models import Qwen3_5ForCausalLM, Qwen3_5TextConfig, create_sharded_model

    config = Qwen3_5TextConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                               max_position_embeddings=64, eos_token_id=1, pad_token_id=0)
    return create_sharded_model(Qwen3_5ForCausalLM, config, seed=0, mesh=one_device_mesh())[0]


@pytest.fixture(scope="module")
def mla():
    """A one-layer DeepSeek-V3: multi-head latent attention, whose pages hold the latent (the MoE layers are not
    what the pages change)."""
    return tiny_mla(layers=1)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("family", ["hybrid"])  # a tiny llama through this engine: tests/test_rollout_engines.py
def test_row_equals_alone_and_behind_a_reused_slot_and_the_static_engine(family, temperature, request) -> None:
    """8 rows through 1 slot (each row alone, each behind the row before it in the same slot) and through 3 slots
    (rows refill slots as others stop, beside changing neighbours): every row's tokens and log-probs are equal,
    and equal the static engine's; every page comes back to the pool."""
    model = request.getfixturevalue(family)
    alone, stats_alone = _run(model, temperature, slots=1)
    refilled, stats = _run(model, temperature, slots=3)
    _assert_rows_equal(alone, refilled)
    assert stats["decode_calls"] > 1 and stats_alone["decode_calls"] >= len(_prompts()) * G  # slots were reused
    assert (alone["lengths"] < NEW).any() and (alone["lengths"] == NEW).any()  # some rows stopped early
    static = StaticBatchEngine(_sampling(temperature)).generate(model, _prompts(), num_generations=G, seed=3, step=1)
    _assert_rows_equal(alone, {k: np.asarray(getattr(static, k)) for k in alone})
    for s in (stats_alone, stats):
        assert s["pages_in_use"] == 0 and 0 < s["peak_pages"] <= s["num_pages"]


def test_row_does_not_depend_on_the_other_prompts_of_its_request(llama) -> None:
    """Replacing prompt 1 changes rows 2-3 only: the other rows (same request index) keep their sampled
    tokens and log-probs, whatever now runs beside them."""
    prompts = _prompts()
    before, _ = _run(llama, 1.0, slots=3, prompts=prompts)
    after, _ = _run(llama, 1.0, slots=3, prompts=[prompts[0], [5, 6, 8, 10, 11, 12, 13], *prompts[2:]])
    kept = np.r_[0:2, 4:8]
    _assert_rows_equal(before, after, kept)
    assert not np.array_equal(before["completion_ids"][2:4], after["completion_ids"][2:4])


@pytest.mark.parametrize("family", ["llama", "hybrid"])
def test_prompt_samples_prefill_once_and_equal_unshared_runs(family, request) -> None:
    """With shared prefixes each prompt is prefilled once for its G samples (4 prefills for 8 rows), their
    pages shared and the partial last page copied per sample; the sampled rows equal a run that prefills
    every sample on its own (8 prefills)."""
    model = request.getfixturevalue(family)
    shared, stats_shared = _run(model, 1.0, slots=3)
    unshared, stats_unshared = _run(model, 1.0, slots=3, share_prefix=False)
    assert stats_shared["prefills"] == len(_prompts()) and stats_unshared["prefills"] == len(_prompts()) * G
    _assert_rows_equal(shared, unshared)
    assert stats_shared["pages_in_use"] == 0 and stats_unshared["pages_in_use"] == 0


def test_mla_latent_pages_rows_equal_alone_unshared_and_behind_reused_slots(mla) -> None:
    """DeepSeek-V3's latent pages: sampled rows through 1 slot with every sample prefilled on its own equal the
    rows through 3 slots that share each prompt's latent pages (4 prefills for 8 rows) and refill slots as rows
    stop; every page comes back. (Its greedy tokens equal transformers': the conformance suite; the tiny model's
    greedy rows never reach a stop id, so this runs sampled.)"""
    alone, stats_alone = _run(mla, 1.0, slots=1, share_prefix=False)
    shared, stats = _run(mla, 1.0, slots=3)
    _assert_rows_equal(alone, shared)
    assert stats_alone["prefills"] == len(_prompts()) * G and stats["prefills"] == len(_prompts())
    assert (alone["lengths"] < NEW).any() and (alone["lengths"] == NEW).any() and stats["decode_calls"] > 1
    assert stats_alone["pages_in_use"] == 0 and stats["pages_in_use"] == 0


def test_mla_absorbed_decode_equals_expanded_with_a_lora_kv_b_proj() -> None:
    """LoRA runs unmerged, so a LoRA ``kv_b_proj`` (non-zero B) is absorbed by its effective weight: attention
    over latent entries in the absorbed form equals expanding every entry through the adapted projection
    (float32; 1e-5 of the largest output: the two forms sum the same products in another order, measured
    1.7e-7)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from scaletrain.models.common.inputs import LayerInputs
    from scaletrain.models.common.latent_attention import LatentAttention
    from scaletrain.models.deepseek_v3 import DeepseekV3Config
    from scaletrain.models.kernels.paged_attention import paged_mask
    from scaletrain.peft.lora import LoRADense

    config = DeepseekV3Config(vocab_size=64, hidden_size=32, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=None,
                              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    layer = LatentAttention(config, jnp.float32, jnp.float32, None, nnx.Rngs(0))
    layer.kv_b_proj = LoRADense(layer.kv_b_proj, rank=4, scaling=2.0, quant=None, block_size=16, key=jax.random.key(0))
    layer.kv_b_proj.lora_b[...] = 0.1 * jax.random.normal(jax.random.key(1), layer.kv_b_proj.lora_b.shape)
    graphdef, params = nnx.split(layer)
    rs = np.random.RandomState(0)
    q = jnp.asarray(rs.standard_normal((2, 1, 4, 16)), jnp.float32)
    entries = jnp.asarray(rs.standard_normal((2, 12, 1, 24)), jnp.float32)
    mask = paged_mask(jnp.asarray([5, 11], jnp.int32), 12, None)

    @jax.jit
    def both(params):
        attn = nnx.merge(graphdef, params)
        return attn.absorbed_attention(q, entries, LayerInputs(mask, None, None)), attn.expanded_attention(q, entries,
                                                                                                           mask)

    absorbed, expanded = (np.asarray(x) for x in both(params))
    np.testing.assert_allclose(absorbed, expanded, rtol=0, atol=1e-5 * np.abs(expanded).max())


def test_a_second_call_compiles_nothing(llama) -> None:
    """One compile per (slots, bucket): a second rollout of other prompts in the same buckets, at another step,
    traces none of the engine's programs again."""
    from scaletrain.generation.continuous import programs_for
    from flax import nnx

    graphdef, params = nnx.split(llama)
    engine = ContinuousBatchEngine(_sampling(1.0), slots=3, page_size=4, decode_steps=4)
    engine.generate(llama, _prompts(), num_generations=G, seed=3, step=1)
    traces = dict(programs_for(graphdef, params).traces)
    engine.generate(llama, [p[::-1] for p in _prompts()], num_generations=G, seed=3, step=2)
    assert programs_for(graphdef, params).traces == traces


def test_grpo_step_samples_through_the_continuous_engine_by_option(tmp_path) -> None:
    """``objective.rollout_engine: continuous`` makes GRPOTrainer sample through the continuous engine; the
    sampler's log-probs are the trainer's forward's (float32, one device: 1e-5, as for the static engine in
    test_grpo_trainer.py) and the step trains."""
    import json

    import scaletrain as st
    from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
    from scaletrain.rl.trainer import GRPOTrainer
    from preference_testing import word_tokenizer

    tok = word_tokenizer(str(tmp_path / "tok"))
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, eos_token_id=1,
                         pad_token_id=0, bos_token_id=None)
    model = create_sharded_model(LlamaForCausalLM, config, seed=0, mesh=one_device_mesh())[0]
    args = st.TrainingArguments(output_dir=str(tmp_path / "run"), total_batch_size=8, max_length=32,
                                learning_rate=3e-2, scheduler="constant", max_training_steps=1, log_steps=1,
                                save_at_end=False, progress_bar=False, report_to=(), seed=0)
    trainer = GRPOTrainer(arguments=args, model=model, tokenizer=tok,
                          options={"num_generations": 4, "max_completion_length": 6,
                                   "rollout_engine": "continuous", "rollout_slots": 3, "rollout_keep_pages": True},
                          dataset_train=[{"prompt": p} for p in ("say yes", "the sky colour")],
                          reward_funcs=[lambda prompts, completions, **_: [float(len(c)) for c in completions]])
    trainer.train()
    assert isinstance(trainer.rollout_engine, ContinuousBatchEngine) and trainer.rollout_engine.slots == 3
    assert trainer.rollout_engine.keep_pages  # objective.rollout_keep_pages (single-turn here: nothing to keep)
    assert trainer.rollout_engine.stats["prefills"] == 2 and trainer.rollout_engine.stats["pages_in_use"] == 0
    [record] = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if r.get("split") == "train"]
    assert np.isfinite(record["loss"]) and record["reward_std"] > 0
    assert record["rollout/logprob_diff_max"] <= 1e-5
    assert record["grad_norm"] > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_row_preempted_and_resumed_equals_one_never_preempted(llama, temperature) -> None:
    """Four 30-token prompts x G=2 through 4 slots, every row running to the cap, over a pool of the smallest
    size the engine allows (2 x 11 pages of 4 tokens, two rows at their longest): it runs short as the rows
    grow, so the youngest rows are preempted and sampled again later. Every row's tokens and log-probs equal
    a run whose pool holds every slot at its longest (no preemption), and every page comes back."""
    rs = np.random.RandomState(1)
    prompts = [[int(t) for t in rs.randint(3, 128, 30)] for _ in range(4)]
    sampling = SamplingParams(max_completion_length=NEW, temperature=temperature, pad_token_id=0)
    runs = []
    for pool in (dict(cache_fraction=1.0), dict(cache_pages=1)):
        engine = ContinuousBatchEngine(sampling, slots=4, page_size=4, decode_steps=4, **pool)
        out = engine.generate(llama, prompts, num_generations=G, seed=3, step=1)
        runs.append(({k: np.asarray(getattr(out, k)) for k in ("completion_ids", "completion_mask", "log_probs",
                                                                "lengths", "truncated")}, engine.stats))
    (roomy, stats_roomy), (tight, stats_tight) = runs
    assert stats_roomy["preemptions"] == 0 and stats_tight["preemptions"] > 0
    assert stats_tight["num_pages"] == 22 < stats_roomy["num_pages"] and stats_tight["pages_in_use"] == 0
    _assert_rows_equal(roomy, tight)


def test_paged_cache_is_sharded_like_the_static_cache_and_tp2_rows_equal_one_device(llama) -> None:
    """On 4 of the fake devices (fsdp 2 x tp 2): the decode program takes and returns each page pool with its
    key/value heads over tp and its pages whole, and the per-slot arrays (page table, lengths, tokens) over the
    batch axes, as docs/generation.md says; the rows it samples equal the one-device run's (tokens equal,
    log-probs within 1e-5: the attention and head sums are split over tp and reduced in another order, as
    test_rollout.py's sharded bound)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from scaletrain.generation.continuous import programs_for
    from scaletrain.generation.paged_programs import Sampler
    from scaletrain.generation.sampling import inverse_temperature
    from scaletrain.parallel import create_mesh

    mesh = create_mesh((1, 2, 1, 2, 1), devices=jax.devices()[:4])
    sharded = tiny_llama(0, mesh=mesh)
    one, _ = _run(llama, 1.0, slots=3)  # the rows do not depend on the slots (the tests above): the compiled run
    two, _ = _run(sharded, 1.0, slots=4)
    for key in ("completion_ids", "completion_mask", "lengths"):
        np.testing.assert_array_equal(one[key], two[key], err_msg=key)
    np.testing.assert_allclose(one["log_probs"], two["log_probs"], rtol=0, atol=1e-5)

    # the engine's programs, called as the engine calls them for these prompts (decode straight after init: one
    # more trace, its input shardings being init's rather than insert's)
    graphdef, params = nnx.split(sharded)
    programs = programs_for(graphdef, params)
    sampling = _sampling(1.0)
    sampler = Sampler(jnp.asarray(0, jnp.uint32), jnp.asarray(0, jnp.int32), jnp.float32(1.0),
                      jnp.asarray(inverse_temperature(1.0)), jnp.float32(1.0), jnp.asarray(STOPS, jnp.int32),
                      jnp.int32(0))
    pages_per_slot = -(-(32 + NEW) // 4)  # prompt bucket 32 + the completion, 4-token pages
    with jax.set_mesh(mesh):
        state = programs.init(params, None, jnp.int32(sampling.pad_token_id), slots=4, num_pages=5 * pages_per_slot,
                              page_size=4, max_pages=pages_per_slot, rows=8, new=NEW)
        after, _ = programs.decode(params, None, state, sampler, jnp.asarray(False), new=NEW, greedy=False,
                                   top_k=None, use_top_p=False, page_size=4, decode_steps=4)
    pool, slot = P(None, None, "tp", None), P(("dp", "fsdp"))
    for es in (state, after):  # what the decode program takes, and what it gives back
        for layer in es.cache:
            for x in layer:
                assert x.sharding.is_equivalent_to(NamedSharding(mesh, pool), 4), x.sharding
        for x in (es.lengths, es.tokens, es.active):
            assert x.sharding.is_equivalent_to(NamedSharding(mesh, slot), 1), x.sharding
        assert es.table.sharding.is_equivalent_to(NamedSharding(mesh, P(("dp", "fsdp"), None)), 2)


def test_long_prompt_prefills_in_chunks_between_decodes_with_one_compile_per_bucket(llama) -> None:
    """A 40-token prompt (bucket 64) behind short ones, with 16-token chunks: it is prefilled in 3 chunks (the
    first 16 slots are padding alone and skipped), decode calls run between its chunks, its rows equal a run
    that prefills it whole (greedy: the same tokens; log-probs within 1e-5, as the chunks attend over the
    cache in other sums), and a second call of the same buckets compiles nothing."""
    from flax import nnx

    from scaletrain.generation.continuous import programs_for

    rs = np.random.RandomState(2)
    prompts = [[int(t) for t in rs.randint(3, 128, n)] for n in (5, 9, 40, 3)]
    sampling = SamplingParams(max_completion_length=NEW, temperature=0.0, pad_token_id=0)
    whole = ContinuousBatchEngine(sampling, slots=2, page_size=4, decode_steps=2)
    chunked = ContinuousBatchEngine(sampling, slots=2, page_size=4, decode_steps=2, prefill_chunk=16)
    a = whole.generate(llama, prompts, num_generations=G, seed=3, step=1)
    b = chunked.generate(llama, prompts, num_generations=G, seed=3, step=1)
    assert whole.stats["prefill_chunks"] == 0 and chunked.stats["prefill_chunks"] == 3
    assert chunked.stats["prefills"] == len(prompts) and chunked.stats["decodes_between_chunks"] >= 2
    np.testing.assert_array_equal(np.asarray(a.completion_ids), np.asarray(b.completion_ids))
    np.testing.assert_allclose(np.asarray(a.log_probs), np.asarray(b.log_probs), rtol=0, atol=1e-5)
    graphdef, params = nnx.split(llama)
    traces = dict(programs_for(graphdef, params).traces)
    assert traces["prefill_chunk"] == 1 and traces["prefill_cache"] == 1
    chunked.generate(llama, [p[::-1] for p in prompts], num_generations=G, seed=3, step=2)
    assert programs_for(graphdef, params).traces == traces
    assert chunked.stats["pages_in_use"] == 0

def test_prompts_of_three_buckets_compile_one_prefill_one_insert_and_decode_once(llama, monkeypatch) -> None:
    """Prompts of 5, 20 and 40 tokens (buckets 16, 24 and 48 with 4-token pages) are all prefilled at the call's
    width, 48: from an empty program cache the call compiles init, one prefill, one insert and one decode (each of
    the last two compiled on a thread beside the prefills, and found there by the engine's call), not a prefill
    and an insert per bucket. The 5-token prompt's rows equal its rows run alone (prefilled at its own bucket, 16):
    the padding is masked out, so the sampled tokens are equal and the log-probs within LP_TOL."""
    from scaletrain.generation.buckets import prompt_bucket

    assert [prompt_bucket(n, 4, 256) for n in (5, 20, 40, 48, 49, 100, 200, 300)] == [16, 24, 48, 48, 64, 128, 256,
                                                                                    512]
    assert [prompt_bucket(n, 16, 256) for n in (40, 90, 190)] == [48, 96, 192]  # 3/4 steps only in whole pages
    from flax import nnx

    import scaletrain.compile_cache as compile_cache
    import scaletrain.generation.continuous as continuous

    monkeypatch.setattr(continuous, "_PROGRAMS", compile_cache.ProgramCache(8))
    rs = np.random.RandomState(4)
    prompts = [[int(t) for t in rs.randint(3, 128, n)] for n in (5, 20, 40)]
    together, _ = _run(llama, 1.0, slots=3, prompts=prompts)
    traces = continuous.programs_for(*nnx.split(llama)).traces
    assert {k: v for k, v in traces.items() if v} == {"init": 1, "prefill": 1, "insert": 1, "decode": 1}
    alone, _ = _run(llama, 1.0, slots=3, prompts=prompts[:1])
    _assert_rows_equal(together, alone, slice(0, G))


@pytest.mark.parametrize("family", ["hybrid", "mla"])
def test_rows_preempted_and_prefilled_in_chunks_equal_rows_never_preempted_and_prefilled_whole(family,
                                                                                               request) -> None:
    """Preemption and chunked prefill beyond the Llama, in one pair of runs: four 30-token prompts x G=2 (bucket
    32) through 4 slots to the cap, once over a roomy pool with each prompt prefilled whole, once over the
    smallest pool (rows preempted and prefilled again) with 16-token chunks (each prompt in 2). The hybrid
    (Qwen3.5) must start a refilled slot from the new row's prefilled Gated DeltaNet recurrent and convolution
    state, not the preempted row's, and carry that state from chunk to chunk; DeepSeek-V3 its latent pages.
    Sampled, so a stale state or page would change the tokens: they are equal, log-probs within 1e-5 (chunks
    attend over the cache in other sums, as for the Llama), and every page comes back."""
    model = request.getfixturevalue(family)
    rs = np.random.RandomState(1)
    prompts = [[int(t) for t in rs.randint(3, 128, 30)] for _ in range(4)]
    sampling = SamplingParams(max_completion_length=NEW, temperature=1.0, pad_token_id=0)
    runs = []
    for options in (dict(cache_fraction=1.0), dict(cache_pages=1, prefill_chunk=16)):
        # two decode steps a host turn: the prompts (a chunk a turn) come before the first rows end; the pool runs out
        engine = ContinuousBatchEngine(sampling, slots=4, page_size=4, decode_steps=2, **options)
        out = engine.generate(model, prompts, num_generations=G, seed=3, step=1)
        runs.append(({k: np.asarray(getattr(out, k)) for k in ("completion_ids", "completion_mask", "log_probs",
                                                                "lengths", "truncated")}, engine.stats))
    (roomy, stats_roomy), (tight, stats_tight) = runs
    assert stats_roomy["preemptions"] == stats_roomy["prefill_chunks"] == 0
    assert stats_tight["preemptions"] > 0 and stats_tight["prefill_chunks"] >= 2 * len(prompts)
    assert stats_tight["pages_in_use"] == 0 and stats_roomy["pages_in_use"] == 0
    for key in ("completion_ids", "completion_mask", "lengths", "truncated"):
        np.testing.assert_array_equal(roomy[key], tight[key], err_msg=key)
    np.testing.assert_allclose(roomy["log_probs"], tight["log_probs"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["scanned", "hybrid", "mla"])  # the unrolled Llama's caches: as the hybrid's
def test_a_call_whose_prompts_all_fit_prefills_them_in_one_batch_with_the_rows_of_one_by_one(family, request,
                                                                                              monkeypatch) -> None:
    """Four prompts x G=2 into 8 slots: the first round places every row, so the four prompts are prefilled in one
    batch (one prefill trace, ``prefills`` 4) and each insertion takes its row of it: the per-layer caches (stacked
    ones on their second axis), Qwen3.5's Gated DeltaNet state, DeepSeek-V3's latent. Into 7 slots the last row
    waits, so each prompt is prefilled alone (a second prefill program, of one row): the same sampled tokens,
    log-probs within LP_TOL (a batch of rows sums in other blocks)."""
    from flax import nnx

    import scaletrain.compile_cache as compile_cache
    import scaletrain.generation.continuous as continuous

    monkeypatch.setattr(continuous, "_PROGRAMS", compile_cache.ProgramCache(8))

    if family == "scanned":
        from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model

        config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             eos_token_id=1, pad_token_id=0, bos_token_id=None, scan_layers=True)
        model = create_sharded_model(LlamaForCausalLM, config, seed=0, mesh=one_device_mesh())[0]
    else:
        model = request.getfixturevalue(family)
    traces = continuous.programs_for(*nnx.split(model)).traces
    together, stats = _run(model, 1.0, slots=8)
    assert stats["prefills"] == 4 and stats["pages_in_use"] == 0 and traces["prefill"] == 1
    one_by_one, stats = _run(model, 1.0, slots=7)
    assert stats["prefills"] == 4 and traces["prefill"] == 2  # the batch of 4, then the prompt of 1
    _assert_rows_equal(together, one_by_one)
