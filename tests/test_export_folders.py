"""Export folders: a kill at any moment leaves a complete export at the path (or one the next export
restores), leftovers are cleaned by the next export, and files get the umask's modes.

The kills are real ``SIGKILL``s of a subprocess running :class:`scaletrain.folders.StagedFolder`'s
install (what ``save_hf_checkpoint`` and ``save_peft_adapter`` end with) on a finished export,
stopped at the moment named; the next export is the real one, in this process.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest

from folder_testing import tree_hash
from scaletrain.folders import StagedFolder, recover
from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
from scaletrain.models.hf import EXPORT_MARKER, save_hf_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Installs a copy of the finished export argv[1] at argv[2] and kills itself where argv[3] says:
# "after-exchange" (the atomic swap done, the previous folder not yet removed) or "between-renames"
# (no renameat2: the previous folder renamed aside, the new one not yet renamed in).
_KILLED_INSTALL = textwrap.dedent("""
    import os, shutil, signal, sys
    import scaletrain.folders as folders

    source, out_dir, where = sys.argv[1:]
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    if where == "after-exchange":
        real = folders.exchange
        folders.exchange = lambda a, b: (real(a, b) or sys.exit("no renameat2 here")) and die()
    else:
        folders.exchange = lambda a, b: False
        rename = os.rename
        def killing_rename(a, b):
            rename(a, b)
            if ".old-" in os.path.basename(b):
                die()
        folders.os.rename = killing_rename
    staged = folders.StagedFolder(out_dir)
    shutil.copytree(source, staged.path, dirs_exist_ok=True)
    staged.install("scaletrain_export.json")
    sys.exit("not killed")
""")


def _model(seed):
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return create_sharded_model(LlamaForCausalLM, cfg, seed=seed)[0]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Two finished exports of different weights: ``(old, new)`` folders to compare against."""
    root = tmp_path_factory.mktemp("exports")
    return save_hf_checkpoint(_model(0), root / "old"), save_hf_checkpoint(_model(1), root / "new")


def _install_killed(source, out_dir, where):
    res = subprocess.run([sys.executable, "-c", _KILLED_INSTALL, str(source), str(out_dir), where],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert res.returncode == -9, (res.returncode, res.stderr[-2000:])


def _hidden(parent):
    return sorted(n for n in os.listdir(parent) if n.startswith("."))


def test_a_kill_right_after_the_swap_leaves_the_new_export_and_the_next_export_cleans_up(exports, tmp_path):
    old, new = exports
    out = tmp_path / "hf"
    save_hf_checkpoint(_model(0), out)
    _install_killed(new, out, "after-exchange")
    assert tree_hash(out) == tree_hash(new)  # the path never lacked an export: now the new one
    assert [n.split("-")[0] for n in _hidden(tmp_path)] == [".hf.tmp"]  # the previous one, not yet removed
    save_hf_checkpoint(_model(0), out)  # the next export
    assert tree_hash(out) == tree_hash(old) and _hidden(tmp_path) == []


def test_a_kill_between_the_fallback_renames_is_restored_before_the_next_export(exports, tmp_path):
    """Without renameat2 the path is missing between two renames; the next export first puts the
    finished new folder in place, then removes every leftover."""
    old, new = exports
    out = tmp_path / "hf"
    save_hf_checkpoint(_model(0), out)
    _install_killed(new, out, "between-renames")
    assert not out.exists()  # the documented window: both complete folders beside the path
    assert sorted(n.split("-")[0] for n in _hidden(tmp_path)) == [".hf.old", ".hf.tmp"]
    recover(str(out), EXPORT_MARKER)  # what the next export runs before anything else
    assert tree_hash(out) == tree_hash(new) and _hidden(tmp_path) == []
    _install_killed(new, out, "between-renames")
    save_hf_checkpoint(_model(0), out)
    assert tree_hash(out) == tree_hash(old) and _hidden(tmp_path) == []


def test_an_unfinished_staging_folder_is_removed_but_never_a_live_exports(tmp_path):
    out = str(tmp_path / "hf")
    live = StagedFolder(out)  # another export still writing: it holds its lock
    dead = tmp_path / ".hf.tmp-deadbeef"  # a killed one's: no lock, no marker
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"half")
    recover(out, EXPORT_MARKER)
    assert os.path.isdir(live.path) and not dead.exists() and not os.path.exists(out)
    live.discard()
    assert _hidden(tmp_path) == []


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_model_and_adapter_files_have_the_umasks_modes(tmp_path, umask):
    from scaletrain.peft.lora import LoRAConfig, apply_lora
    from scaletrain.peft.adapter import save_peft_adapter

    previous = os.umask(umask)
    try:
        folders = [save_hf_checkpoint(_model(0), tmp_path / "hf"),
                   save_peft_adapter(apply_lora(_model(0), LoRAConfig()), tmp_path / "adapter")]
    finally:
        os.umask(previous)
    for folder in folders:
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o777 & ~umask, folder
        modes = {name: stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode) for name in os.listdir(folder)}
        assert modes and set(modes.values()) == {0o666 & ~umask}, modes


def test_a_folder_made_at_the_path_during_an_export_is_refused_not_swapped_away(tmp_path):
    from scaletrain.errors import ConfigError
    from scaletrain.folders import staged

    out = tmp_path / "hf"
    with pytest.raises(ConfigError, match="not a previous scaletrain export"):
        with staged(str(out), EXPORT_MARKER) as tmp:
            (tmp_path / "hf").mkdir()  # someone else's folder appears while the export writes
            (out / "precious.txt").write_text("keep")
            (tmp_path / tmp / EXPORT_MARKER).write_text("{}")
    assert (out / "precious.txt").read_text() == "keep" and _hidden(tmp_path) == []


def test_write_atomic_leaves_the_old_file_when_a_write_fails(tmp_path):
    """A reader sees the old file or the new one: a write that fails midway keeps the old bytes and leaves no
    sibling behind (what summary.json, recipe.yaml and the stored log-probs are written with)."""
    from scaletrain.folders import write_atomic, write_json_atomic

    path = tmp_path / "summary.json"
    write_json_atomic(str(path), {"loss": 1.5})
    with pytest.raises(TypeError):
        write_atomic(str(path), None)  # type: ignore[arg-type]  # fails after the sibling is opened
    assert path.read_text() == '{\n  "loss": 1.5\n}' and os.listdir(tmp_path) == ["summary.json"]
    write_atomic(str(path), b"new")
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["summary.json"]
