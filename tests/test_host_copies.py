"""Reading device arrays on the host leaves no copy behind, and the state digest streams in blocks.

JAX caches the host copy that ``np.asarray`` / ``jax.device_get`` make on the array itself
(``_npy_value``) for as long as the array lives, whenever the copy is not a view of a CPU
buffer: on a GPU always, here on CPU for an array sharded over the 8 fake devices. The run
summary's ``params_sha256`` read every parameter that way, so a GPU run kept all of them on
the host after training (``scaletrain/parallel/host.py``).
"""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import scaletrain as st
from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
from scaletrain.parallel.host import host_blocks, to_host
from scaletrain.parallel.mesh import create_mesh
from scaletrain.training.state import params_sha256


def _mesh():
    return create_mesh((1, 8, 1, 1, 1), ("dp", "fsdp", "ep", "tp", "sp"))


def _cached(x) -> bool:
    return x._npy_value is not None  # jax.Array's host-copy cache (AttributeError if jax renames it)


def _whole_array_digest(params) -> str:
    """The digest's definition: key path, dtype and the whole array's C-order bytes, leaves in key order."""
    digest = hashlib.sha256()
    for path, leaf in sorted(jax.tree_util.tree_flatten_with_path(params)[0],
                             key=lambda kv: jax.tree_util.keystr(kv[0])):
        host = np.array(leaf)
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(str(host.dtype).encode())
        digest.update(host.tobytes())
    return digest.hexdigest()


def _params(mesh):
    rng = np.random.default_rng(0)
    sharded = NamedSharding(mesh, PartitionSpec("fsdp"))
    return {
        "embed": jax.device_put(rng.normal(size=(64, 32)).astype(np.float32), sharded),
        "norm": jax.device_put(rng.normal(size=(48, 8)).astype(np.float32), NamedSharding(mesh, PartitionSpec())),
        "head": jax.device_put(jnp.asarray(rng.normal(size=(40, 16)), jnp.bfloat16), jax.devices()[3]),
    }


def test_digest_and_reads_leave_no_host_copy_and_stream_in_bounded_blocks():
    mesh = _mesh()
    probe = _params(mesh)["embed"]
    jax.device_get(probe)
    assert _cached(probe), "this jax no longer caches host copies: the premise of parallel/host.py changed"

    params = _params(mesh)
    streamed = params_sha256(params, block_bytes=1000)  # every replicated/one-device leaf is cut into blocks
    assert not any(_cached(x) for x in jax.tree.leaves(params))
    assert np.array_equal(to_host(params["embed"]), np.asarray(_params(mesh)["embed"]))
    assert not _cached(params["embed"])
    assert streamed == params_sha256(params) == _whole_array_digest(_params(mesh))

    for name, bound in (("norm", 1000), ("head", 300)):
        blocks = list(host_blocks(params[name], bound))
        assert len(blocks) > 1 and all(b.nbytes <= bound for b in blocks), name
        assert np.array_equal(np.concatenate(blocks), np.asarray(_params(mesh)[name])), name
    assert len(list(host_blocks(params["embed"], 1000))) == 1  # sharded over devices: whole, not gathered there


def test_run_summary_leaves_no_host_copy_of_the_parameters(tmp_path, tiny_config_kwargs):
    """Every train() ends with write_summary and its digest: the state must not keep the parameters on the
    host after it (called on the built state here: the step's compile would add nothing to this)."""
    cfg = LlamaConfig(**tiny_config_kwargs, sharding_axis_dims=(1, 8, 1, 1, 1))
    model, _ = create_sharded_model(LlamaForCausalLM, cfg, seed=0)
    rows = [{"input_ids": np.arange(16) % 128} for _ in range(16)]
    args = st.TrainingArguments(output_dir=str(tmp_path), total_batch_size=8, max_length=16, num_train_epochs=None,
                                max_training_steps=2, progress_bar=False, report_to=(), save_at_end=False,
                                do_eval=False)
    trainer = st.Trainer(args, model=model, dataset_train=rows)
    state = trainer.model_state
    summary = trainer.write_summary(state)
    trainer.close()
    trainer.release_run_lock()
    sharded = [x for x in jax.tree.leaves(state.params) if not x.is_fully_replicated]
    assert sharded and not any(_cached(x) for x in sharded)
    assert summary["params_sha256"] == _whole_array_digest(state.params)
