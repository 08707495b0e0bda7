"""GPT-OSS: attention sinks, alternating sliding/full layers, biased top-k experts with a clamped SwiGLU, YaRN;
checkpoints whose experts are MXFP4 blocks load dequantised (:mod:`scaletrain.models.common.mxfp4`)."""

from scaletrain.models.common.family import FamilyConformance, register
from scaletrain.models.common.mxfp4 import QUANT_METHOD
from scaletrain.models.gpt_oss.config import GptOssConfig, gpt_oss_from_hf, gpt_oss_to_hf
from scaletrain.models.gpt_oss.model import GptOssForCausalLM
from scaletrain.models.hf_family import HFFamily

GPT_OSS = HFFamily("GptOssForCausalLM", "GptOssConfig", GptOssConfig, gpt_oss_from_hf, gpt_oss_to_hf,
                   quantizations=(QUANT_METHOD,))
#: two layers: sliding (window 8, shorter than the test rows and prompts), then full; top-2 of 4 experts
#: of width 24 (the suite randomises every parameter: router and expert biases, sinks); a swiglu_limit of 0.5 that
#: random activations cross, so both clamps bend; YaRN with the released ramp (truncate false) over an original
#: context of 32 tokens. Loaded on fsdp=2 x ep=4, so the biased experts run the expert-parallel dispatch
register(GPT_OSS, GptOssForCausalLM, conformance=FamilyConformance(
    hf=dict(num_hidden_layers=2, sliding_window=8, num_local_experts=4, num_experts_per_tok=2, intermediate_size=24,
            head_dim=16, swiglu_limit=0.5,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32}),
    load=dict(sharding_axis_dims=(1, 2, 4, 1, 1)), lora="attention"))

__all__ = ["GPT_OSS", "GptOssConfig", "GptOssForCausalLM"]
