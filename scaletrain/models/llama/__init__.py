"""Llama: the pre-norm SwiGLU decoder (its block is Mistral's, Qwen2's and Qwen3's too)."""

from scaletrain.models.common.family import register
from scaletrain.models.common.layers import MLP, Attention
from scaletrain.models.llama.config import LlamaConfig
from scaletrain.models.common.dense import RMSNorm
from scaletrain.models.hf_family import HFFamily
from scaletrain.models.llama.hf import llama_from_hf, llama_to_hf
from scaletrain.models.llama.model import DecoderLayer, LlamaForCausalLM, LlamaModel

LLAMA = HFFamily("LlamaForCausalLM", "LlamaConfig", LlamaConfig, llama_from_hf, llama_to_hf)
register(LLAMA, LlamaForCausalLM, LlamaModel)

__all__ = ["LLAMA", "MLP", "Attention", "DecoderLayer", "LlamaConfig", "LlamaForCausalLM", "LlamaModel", "RMSNorm"]
