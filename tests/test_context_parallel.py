"""Long sequences: the flash kernel on a sequence split over devices, and remat that keeps its statistics.

Context parallelism runs each device's slice of the queries against the whole row's
keys at the slice's offset (:mod:`scaletrain.models.kernels.flash_sharding`); these tests hold
it to the einsum path over the unsplit row, first kernel-level (slices in a loop with
a traced offset), then as ``attn_mechanism="pallas"`` in a Llama on a mesh with
``sp = 2``. Pallas runs in interpret mode on CPU.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flash_testing import assert_same_loss_and_grads
from flax import nnx

from scaletrain.errors import ConfigError
from scaletrain.models.kernels.attention import build_attention_mask, dot_product_attention
from scaletrain.models.kernels.flash_attention import attention_with_visits, segment_flash_attention
from scaletrain.models.kernels.flash_sharding import sequence_block, sharded_flash_attention, zigzag_chunk, zigzag_order

HQ, HKV, D = 4, 2, 16


def segments(t: int, *lengths: int) -> np.ndarray:
    """Documents 1, 2, ... of these lengths, then padding to ``t``."""
    ids = np.zeros(t, np.int32)
    ids[: sum(lengths)] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    return ids


def test_slices_at_their_offsets_equal_the_whole_row() -> None:
    """Four 32-token query slices against the 128-token row (offset traced, as ``axis_index`` is):
    outputs concatenate and key/value gradients sum to the einsum path's over the unsplit row."""
    t, n = 128, 4
    s = t // n
    rng = np.random.default_rng(0)
    seg = jnp.asarray(np.stack([segments(t, t), segments(t, 20, 50, 40), segments(t, 30, 1, 33)]))
    b = seg.shape[0]
    q, do = (jnp.asarray(rng.standard_normal((b, t, HQ, D), np.float32)) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, t, HKV, D), np.float32)) for _ in range(2))

    @jax.jit
    def both(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, seg: jax.Array) -> tuple:
        def one_slice(r: jax.Array) -> tuple:
            take = lambda x: jax.lax.dynamic_slice_in_dim(x, r * s, s, axis=1)  # noqa: E731
            out, vjp = jax.vjp(lambda q_, k_, v_: segment_flash_attention(
                q_, k_, v_, take(seg), kv_segment_ids=seg, q_offset=r * s, block_q=16, block_k=16,
                interpret=True), take(q), k, v)
            return (out, *vjp(take(do)))

        out, dq, dk, dv = jax.lax.map(one_slice, jnp.arange(n))  # one compile of the kernels for every slice
        whole = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, t, *x.shape[3:])  # noqa: E731
        mask = build_attention_mask(seg, jnp.zeros_like(seg), None)
        ref, ref_vjp = jax.vjp(lambda *a: dot_product_attention(*a, mask, jnp.float32, None), q, k, v)
        return (whole(out), whole(dq), dk.sum(0), dv.sum(0)), (ref, *ref_vjp(do))

    got, want = both(q, k, v, do, seg)
    for name, a, w in zip(("output", "dq", "dk", "dv"), got, want):
        # float32 throughout; only the summation order differs (online softmax over <= 128 keys,
        # dk/dv summed over 4 slices): measured <= 3e-6 absolute, as test_flash_attention
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("t, zigzag", [(128, True), (192, False)])
def test_sharded_over_sp_equals_the_whole_row(t: int, zigzag: bool) -> None:
    """The kernel over sp 4 in shard_map: 128 tokens go zigzag (8 chunks of 16: rows permuted in and out
    as the model does), 192 stay contiguous (chunks of 24 are not whole tiles; slices of 48, tiles of 16)."""
    assert (zigzag_chunk(t, 4) is not None) == zigzag
    rng = np.random.default_rng(1)
    seg = jnp.asarray(np.stack([segments(t, t), segments(t, 40, 50, 30)]))
    q, do = (jnp.asarray(rng.standard_normal((2, t, HQ, D), np.float32)) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((2, t, HKV, D), np.float32)) for _ in range(2))
    order = zigzag_order(t, 4) if zigzag else np.arange(t)
    restore = np.argsort(order)
    mesh = jax.make_mesh((4,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))

    @jax.jit
    def both(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, seg: jax.Array) -> tuple:
        def split(q_, k_, v_):
            perm = lambda x: x[:, order]  # noqa: E731
            out = sharded_flash_attention(perm(q_), perm(k_), perm(v_), perm(seg), scale=None, batch_axis=None,
                                          sequence_axis="sp", head_axis=None, kv_head_axis=None, zigzag=zigzag)
            return out[:, restore]

        out, vjp = jax.vjp(split, q, k, v)
        mask = build_attention_mask(seg, jnp.zeros_like(seg), None)
        ref, ref_vjp = jax.vjp(lambda *a: dot_product_attention(*a, mask, jnp.float32, None), q, k, v)
        return (out, *vjp(do)), (ref, *ref_vjp(do))

    with jax.set_mesh(mesh):
        got, want = both(q, k, v, do, seg)
    for name, a, w in zip(("output", "dq", "dk", "dv"), got, want):
        # float32, summation order only (as above; dk/dv also summed over the 4 devices by the reduce-scatter)
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-5, atol=2e-5, err_msg=name)


def test_zigzag_balances_the_tiles_each_device_visits() -> None:
    """One 512-token document over sp 4 (tiles of 16): the forward kernel's own tile counts per device.
    Contiguous slices visit 1 : 3 : 5 : 7 (the last device sets the pace); zigzag gives each the same."""
    t, n, block = 512, 4, 16
    q = jnp.zeros((1, t, 1, D), jnp.float32)
    seg = jnp.ones((1, t), jnp.int32)

    @jax.jit  # one compile per slice length: the slice's rows and offset are traced
    def count(rows: jax.Array, offset: jax.Array) -> jax.Array:
        kw = dict(kv_segment_ids=seg, q_offset=offset, block_q=block, block_k=block, interpret=True)
        return attention_with_visits(q[:, rows], q, q, seg[:, rows], **kw)[1].sum()

    def visits(rows: np.ndarray, offset: int) -> int:
        return int(count(jnp.asarray(rows), jnp.int32(offset)))

    local, c = t // n, t // (2 * n)
    contiguous = [visits(np.arange(r * local, (r + 1) * local), r * local) for r in range(n)]
    zigzag = [visits(np.arange(r * c, (r + 1) * c), r * c) + visits(np.arange((2 * n - 1 - r) * c, (2 * n - r) * c),
                                                                   (2 * n - 1 - r) * c) for r in range(n)]
    per_tile_row = (local // block) * (local // block + 1) // 2  # one slice's own causal triangle of tiles
    assert contiguous == [per_tile_row + r * (local // block) ** 2 for r in range(n)]  # 36, 100, 164, 228
    assert len(set(zigzag)) == 1 and sum(zigzag) == sum(contiguous)  # the same work, evenly spread


def test_sequence_block_is_a_whole_tile_of_the_slice() -> None:
    assert sequence_block(4096) == 64 and sequence_block(96) == 32 and sequence_block(48) == 16
    with pytest.raises(ConfigError, match="attn_mechanism.*multiple of 16"):
        sequence_block(40)


def _llama(mechanism: str, policy: str = "none", **kw: object):
    from scaletrain.models.llama.config import LlamaConfig
    from scaletrain.models.factory import create_sharded_model, mesh_for_config
    from scaletrain.models.llama import LlamaForCausalLM

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    config = LlamaConfig(**{**shape, **kw}, attn_mechanism=mechanism, gradient_checkpointing=policy)
    return create_sharded_model(LlamaForCausalLM, config, seed=0, mesh=mesh_for_config(config))


def _packed_rows(seed: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(input_ids, segment_ids, positions)`` [4, 64]: rows of one, three (two apart), one plus padding and
    three documents, positions restarting per document (0 on padding)."""
    ids = jnp.asarray(np.random.default_rng(seed).integers(1, 64, (4, 64)), jnp.int32)
    seg = jnp.asarray(np.stack([segments(64, 64), segments(64, 20, 30), segments(64, 40), segments(64, 31, 2, 31)]))
    pos = jnp.asarray(np.stack([np.concatenate([np.arange(n) for n in np.bincount(r)[1:] if n] +
                                               [np.zeros((r == 0).sum(), int)]) for r in np.asarray(seg)]))
    return ids, seg, pos


def _loss_and_grads_over_sp(model: nnx.Module, mesh: Any, mechanism: str,
                            batch: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[float, dict]:
    """The mean squared logits on ``batch`` and their gradients; checks that only ``pallas`` gathers keys
    and values over sp (context parallelism)."""
    ids, seg, pos = batch

    def loss(m: nnx.Module) -> jax.Array:
        return jnp.mean(m(ids, positions=pos, segment_ids=seg).astype(jnp.float32) ** 2)

    with jax.set_mesh(mesh):
        value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
        traced = str(jax.make_jaxpr(lambda s: loss(nnx.merge(nnx.graphdef(model), s)))(nnx.state(model)))
    assert ("all_gather" in traced) == (mechanism == "pallas")  # keys and values gathered over sp
    return float(value), nnx.to_pure_dict(grads)


def test_model_over_sp_equals_the_einsum_path() -> None:
    """A Llama on fsdp 2 x tp 2 x sp 2 over packed rows: ``pallas`` (context parallel, 64 tokens laid out
    zigzag in chunks of 16) gives the einsum path's loss and gradients."""
    batch = _packed_rows(seed=0)

    def loss_and_grads(mechanism: str) -> tuple[float, dict]:
        model, mesh = _llama(mechanism, sharding_axis_dims=(1, 2, 1, 2, 2))
        return _loss_and_grads_over_sp(model, mesh, mechanism, batch)

    assert_same_loss_and_grads(loss_and_grads("pallas"), loss_and_grads("xla"))


def test_remat_policies_that_keep_attention_run_its_forward_once() -> None:
    """One layer, the compiled gradient: the policies that save the kernel's output and
    log-sum-exp run the forward kernel as often as no remat does; ``full`` runs it again in the backward.

    Counted in the compiled program, not the jaxpr: a ``pallas_call`` is never dropped from a jaxpr
    (Pallas' DCE rule keeps it), but XLA drops one whose results go unused, on CPU (where interpret
    mode makes each kernel call loops tagged with the kernel's name) as on GPU (a Triton custom call
    without side effects)."""
    ids = jnp.ones((2, 32), jnp.int32)  # rows that are one sequence each: the kernel gets one segment per row

    def forward_loops(policy: str) -> int:
        model, mesh = _llama("pallas", policy)

        def loss(state: nnx.State) -> jax.Array:
            return nnx.merge(nnx.graphdef(model), state)(ids).astype(jnp.float32).sum()

        with jax.set_mesh(mesh):
            hlo = jax.jit(jax.grad(loss)).lower(nnx.state(model)).compile().as_text()
        return sum(" while(" in line and "segment_flash_forward" in line for line in hlo.splitlines())

    once = forward_loops("none")
    assert once > 0
    assert forward_loops("full") == 2 * once
    assert forward_loops("save_attention") == once
    assert forward_loops("dots_and_attention") == once


def test_auto_runs_the_kernel_where_a_gpu_mesh_splits_the_sequence() -> None:
    """``auto`` becomes ``pallas`` on a GPU mesh with sp > 1 (cuDNN refuses the split, the einsum path
    would build [T / sp, T] scores), and stays itself wherever the kernel cannot or need not run."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    from scaletrain.models.llama.config import LlamaConfig
    from scaletrain.models.mistral import MistralConfig
    from scaletrain.models.kernels.flash_sharding import training_mechanism

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2)

    def on(dims: tuple[int, ...], config: LlamaConfig, t: int = 128, platform: str = "gpu") -> str:
        mesh = AbstractMesh(dims, ("dp", "fsdp", "ep", "tp", "sp"), axis_types=(AxisType.Auto,) * 5,
                            abstract_device=AbstractDevice("H100", None, platform))
        with jax.sharding.use_abstract_mesh(mesh):
            return training_mechanism(config, t)

    sp4, llama = (1, 2, 1, 1, 4), LlamaConfig(**kw)
    assert on(sp4, llama) == "pallas"
    assert on(sp4, llama, platform="cpu") == "auto"  # the einsum path, as the CPU tests compare against
    assert on((1, 8, 1, 1, 1), llama) == "auto"  # whole sequences: cuDNN
    assert on(sp4, llama, t=100) == "auto"  # slices of 25 tokens are not whole tiles: never an error for auto
    assert on((1, 1, 1, 4, 2), llama) == "auto"  # 2 kv heads do not split over tp 4
    assert on(sp4, LlamaConfig(**kw, attn_mechanism="xla")) == "xla"
    assert on(sp4, MistralConfig(**kw, sliding_window=16)) == "pallas"  # the kernel takes the window


@pytest.mark.parametrize("scan_layers", [False, True])
def test_gemma3_over_sp_takes_the_kernel_and_zigzag_llama_takes(scan_layers: bool, monkeypatch) -> None:
    """Gemma 3 (a local layer with window 20 and a global one) on fsdp 2 x tp 2 x sp 2 over packed rows:
    ``pallas`` runs the kernel on the zigzag layout for both kinds of layer (each with its own window),
    as Llama does, and gives the loss and gradients of the einsum path on the unsplit row (sp = 1)."""
    from scaletrain.models.common import layers
    from scaletrain.models.factory import create_sharded_model, mesh_for_config
    from scaletrain.models.gemma3 import Gemma3ForCausalLM
    from scaletrain.models.gemma3 import Gemma3TextConfig

    calls: set[tuple[object, bool]] = set()
    kernel = layers.sharded_flash_attention

    def spy(*args, **kwargs):
        calls.add((kwargs["window"], kwargs["zigzag"]))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(layers, "sharded_flash_attention", spy)
    batch = _packed_rows(seed=1)

    def loss_and_grads(mechanism: str, dims: tuple[int, ...]) -> tuple[float, dict]:
        config = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=20,
                                  max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"],
                                  attn_mechanism=mechanism, scan_layers=scan_layers, sharding_axis_dims=dims)
        model, mesh = create_sharded_model(Gemma3ForCausalLM, config, seed=0, mesh=mesh_for_config(config))
        return _loss_and_grads_over_sp(model, mesh, mechanism, batch)

    got = loss_and_grads("pallas", (1, 2, 1, 2, 2))
    assert calls == {(20, True), (None, True)}  # both kinds: the kernel, zigzag, each with its window
    assert_same_loss_and_grads(got, loss_and_grads("xla", (1, 4, 1, 2, 1)))
