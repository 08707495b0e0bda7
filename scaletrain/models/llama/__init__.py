"""Llama: the pre-norm SwiGLU decoder (its block is Mistral's, Qwen2's and Qwen3's too)."""

from scaletrain.models.common.family import FamilyConformance, register
from scaletrain.models.common.layers import MLP, Attention
from scaletrain.models.llama.config import LlamaConfig
from scaletrain.models.common.dense import RMSNorm
from scaletrain.models.hf_family import HFFamily
from scaletrain.models.llama.hf import llama_from_hf, llama_to_hf
from scaletrain.models.llama.model import DecoderLayer, LlamaForCausalLM, LlamaModel

LLAMA = HFFamily("LlamaForCausalLM", "LlamaConfig", LlamaConfig, llama_from_hf, llama_to_hf)
#: llama3's frequency bands, with an original context (32) shorter than the suite's rows (40)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

register(LLAMA, LlamaForCausalLM, LlamaModel, conformance=FamilyConformance(variants={  # GQA, untied head
    "tied": dict(tie_word_embeddings=True),
    "attention-mlp-bias": dict(attention_bias=True, mlp_bias=True),
    "rope-linear": dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "rope-llama3": dict(rope_parameters=LLAMA3_ROPE),
    # YaRN stretching an original context of 32 (shorter than the test rows) 4 times: the ramp between interpolated
    # and kept frequencies falls inside the head, truncated to whole dimensions (the default), attention factor 1.14
    "rope-yarn": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                       "original_max_position_embeddings": 32}),
    "head-dim": dict(head_dim=24),
    "mha": dict(num_key_value_heads=4),
}))

__all__ = ["LLAMA3_ROPE", "LLAMA", "MLP", "Attention", "DecoderLayer", "LlamaConfig", "LlamaForCausalLM", "LlamaModel", "RMSNorm"]
