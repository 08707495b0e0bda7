"""Gemma 3 (text): local and global layers, (1 + w) norms around attention and MLP, GeGLU, soft-capped logits."""

from scaletrain.models.common.family import FamilyConformance, register
from scaletrain.models.gemma3.config import FULL, SLIDING, Gemma3TextConfig, gemma3_from_hf, gemma3_to_hf
from scaletrain.models.gemma3.model import Gemma3DecoderLayer, Gemma3ForCausalLM, Gemma3TextModel, GemmaRMSNorm
from scaletrain.models.hf_family import HFFamily

GEMMA3_TEXT = HFFamily("Gemma3ForCausalLM", "Gemma3TextConfig", Gemma3TextConfig, gemma3_from_hf, gemma3_to_hf)
#: Gemma 3's layer kinds in one small model: local, local, global (the legacy ``sliding_window_pattern``
#: key), windows of 8 tokens (shorter than the suite's rows and prompts), each kind its own RoPE (the
#: global one linearly scaled by 8, as in the 4B+ configs), the attention scale 24 ** -0.5 where head_dim
#: is 16, and logits soft-capped at 5 (random logits reach ~5, so the cap bends them); the head is tied
GEMMA3_LOCAL_GLOBAL = dict(
    num_hidden_layers=3, sliding_window_pattern=3, sliding_window=8, head_dim=16, query_pre_attn_scalar=24,
    final_logit_softcapping=5.0,
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})

register(GEMMA3_TEXT, Gemma3ForCausalLM, Gemma3TextModel, conformance=FamilyConformance(
    hf=GEMMA3_LOCAL_GLOBAL, variants={
        # explicit layer_types (global first), an untied head, no soft-capping, attention biases
        "untied": dict(layer_types=["full_attention", "sliding_attention"], sliding_window=6,
                       tie_word_embeddings=False, attention_bias=True, head_dim=32, query_pre_attn_scalar=16),
    }))

__all__ = ["GEMMA3_LOCAL_GLOBAL", "FULL", "GEMMA3_TEXT", "SLIDING", "Gemma3DecoderLayer", "Gemma3ForCausalLM", "Gemma3TextConfig",
           "Gemma3TextModel", "GemmaRMSNorm"]
