"""Gemma 3 (text): local and global layers, (1 + w) norms around attention and MLP, GeGLU, soft-capped logits."""

from scaletrain.models.common.family import register
from scaletrain.models.gemma3.config import FULL, SLIDING, Gemma3TextConfig, gemma3_from_hf, gemma3_to_hf
from scaletrain.models.gemma3.model import Gemma3DecoderLayer, Gemma3ForCausalLM, Gemma3TextModel, GemmaRMSNorm
from scaletrain.models.hf_family import HFFamily

GEMMA3_TEXT = HFFamily("Gemma3ForCausalLM", "Gemma3TextConfig", Gemma3TextConfig, gemma3_from_hf, gemma3_to_hf)
register(GEMMA3_TEXT, Gemma3ForCausalLM, Gemma3TextModel)

__all__ = ["FULL", "GEMMA3_TEXT", "SLIDING", "Gemma3DecoderLayer", "Gemma3ForCausalLM", "Gemma3TextConfig",
           "Gemma3TextModel", "GemmaRMSNorm"]
