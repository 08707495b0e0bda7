"""The score head (reward models) against transformers' ``AutoModelForSequenceClassification`` on two families.

A random tiny transformers ``*ForSequenceClassification`` (``num_labels=1``, every parameter random) is saved,
loaded here, scored on right-padded rows, exported back and loaded by transformers again: the scores must agree
within 1e-4 relative (float32 both sides: two programs summing in different orders, ~1e-6 apart) each way.
The padding rule is transformers': the score sits at the last token that is not the pad token.
"""

from __future__ import annotations

import numpy as np
import pytest

from hf_testing import TINY, rel_diff

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore")

PAD = 0
#: right-padded rows of different lengths, one unpadded
IDS = np.array([[5, 9, 17, 33, 2, PAD, PAD, PAD],
                [7, 7, 40, 2, PAD, PAD, PAD, PAD],
                [11, 12, 13, 14, 15, 16, 17, 2]], np.int32)


def _hf_classifier(family: str):
    import transformers

    torch.manual_seed(3)
    config = transformers.AutoConfig.for_model(family, **{**TINY, "num_labels": 1, "pad_token_id": PAD})
    model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


def _hf_scores(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(ids != PAD))
    return out.logits[:, 0].numpy()


def _our_scores(model, ids: np.ndarray) -> np.ndarray:
    import jax

    with jax.set_mesh(_mesh(model)):
        return np.asarray(jax.jit(lambda m, x: m(x, attention_mask=x != PAD))(model, ids))[:, 0]


def _mesh(model):
    from scaletrain.models.factory import _mesh_of

    return _mesh_of(model)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_score_head_loads_and_exports_as_transformers_sequence_classifier_with_same_scores(family, tmp_path):
    import transformers

    from scaletrain.models.registry import AutoModelForSequenceClassification
    from scaletrain.parallel import create_mesh
    import jax

    theirs = _hf_classifier(family)
    theirs.save_pretrained(tmp_path / "hf")
    ref = _hf_scores(theirs, IDS)
    mesh = create_mesh((1, 1, 1, 1, 1), devices=jax.devices()[:1])
    ours = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf", mesh=mesh)
    assert type(ours).__name__.endswith("ForSequenceClassification") and ours.lm_head is None
    scores = _our_scores(ours, IDS)
    assert rel_diff(scores, ref) < 1e-4, (scores, ref)

    ours.save_pretrained(str(tmp_path / "ours"))
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "ours").eval()
    assert back.config.num_labels == 1 and back.config.architectures[0].endswith("ForSequenceClassification")
    assert rel_diff(_hf_scores(back, IDS), ref) < 1e-4


def test_score_head_from_a_causal_lm_folder_starts_new_and_keeps_the_decoder(tmp_path):
    import jax

    from hf_testing import hf_model
    from scaletrain.models.registry import AutoModelForCausalLM, AutoModelForSequenceClassification
    from scaletrain.parallel import create_mesh

    hf_model("llama").save_pretrained(tmp_path / "lm")
    mesh = create_mesh((1, 1, 1, 1, 1), devices=jax.devices()[:1])
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "lm", mesh=mesh)
    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "lm", mesh=mesh)
    kernel = np.asarray(rm.score.kernel[...])
    assert kernel.shape == (TINY["hidden_size"], 1) and 0 < kernel.std() < 0.1  # N(0, initializer_range^2)
    np.testing.assert_array_equal(np.asarray(rm.model.embed_tokens[...]), np.asarray(lm.model.embed_tokens[...]))
