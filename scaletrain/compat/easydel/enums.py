"""EasyDeL's enums for the attention kernel and the remat policy, and its ``TaskType``.

Why here: an EasyDeL config says ``attn_mechanism=AttentionMechanisms.FLASH_ATTN2`` or
``gradient_checkpointing=EasyDeLGradientCheckPointers.NOTHING_SAVEABLE``. The members are str
enums whose values are the plain names the core's tables accept (``scaletrain.models.options``),
so the core never imports them: a member is its string wherever a name is read.
"""

from __future__ import annotations

import enum


class AttentionMechanisms(str, enum.Enum):
    """EasyDeL's attention implementations (member names and values as EasyDeL spells them).

    Accepted: ``AUTO``, ``SDPA``, the flash family (``FLASH``, ``FLASH_ATTN2``,
    ``CUDA_FLASH_ATTN2``) → cuDNN's fused flash kernel where it applies (GPU, bf16/fp16),
    einsum elsewhere; ``CUDNN`` → always fused; ``VANILLA`` and ``BLOCKWISE`` → einsum
    with float32 softmax over causal query blocks. The rest are refused (:data:`REFUSED_ATTENTION`).
    """

    AUTO = "auto"
    FLASH = "flash"
    FLASH_ATTN2 = "flash_attn2"
    CUDA_FLASH_ATTN2 = "cuda_flash_attn2"
    SDPA = "sdpa"
    CUDNN = "cudnn"
    VANILLA = "vanilla"
    BLOCKWISE = "blockwise"
    RING = "ring"
    SPLASH = "splash"
    BLOCKSPARSE = "blocksparse"
    RAGGED_PAGE_ATTENTION_V2 = "ragged_page_attention_v2"
    RAGGED_PAGE_ATTENTION_V3 = "ragged_page_attention_v3"
    PAGED_ATTENTION = "page_attention"
    REGRESSIVE_DECODE = "autoregressive_decodeattn"


class EasyDeLGradientCheckPointers(str, enum.Enum):
    """EasyDeL's remat policies (member names and values as EasyDeL spells them; ``NONE`` is ``""``).

    Accepted: ``NONE`` and ``EVERYTHING_SAVEABLE`` (saving everything is no remat) →
    ``none``; ``NOTHING_SAVEABLE`` → ``full``; ``CHECKPOINT_DOTS``/``DOTS_SAVEABLE`` →
    ``dots``; ``CHECKPOINT_DOTS_WITH_NO_BATCH_DMIS``/``DOTS_WITH_NO_BATCH_DIMS_AVAILABLE``
    → ``dots_with_no_batch_dims``; ``SELECTIVE`` → ``dots_with_no_batch_dims`` (selective
    recomputation: keep the projections' outputs, recompute the attention scores). The
    name-list policies are refused: they need EasyDeL's checkpoint names.
    """

    NONE = ""
    EVERYTHING_SAVEABLE = "everything_saveable"
    NOTHING_SAVEABLE = "nothing_saveable"
    CHECKPOINT_DOTS = "checkpoint_dots"
    CHECKPOINT_DOTS_WITH_NO_BATCH_DMIS = "checkpoint_dots_with_no_batch_dims"
    DOTS_SAVEABLE = "dots_saveable"
    DOTS_WITH_NO_BATCH_DIMS_AVAILABLE = "dots_with_no_batch_dims_saveable"
    SELECTIVE = "selective"
    SAVE_ANYTHING_EXCEPT_THESE_NAMES = "save_anything_except_these_names"
    SAVE_ANY_NAMES_BUT_THESE = "save_any_names_but_these"
    SAVE_ONLY_THESE_NAMES = "save_only_these_names"
    SAVE_FROM_BOTH_POLICIES = "save_from_both_policies"
    ATTN_NOTSAVEABLE = "attn_notsaveable"
    MLP_NOTSAVEABLE = "mlp_notsaveable"
    MLP_ATTN_NOTSAVEABLE = "mlp_attn_notsaveable"


class TaskType(str, enum.Enum):
    """EasyDeL's task types (its RayDistributedTrainer's ``model_task``): the core's task strings
    (:mod:`scaletrain.models.task`) as enum members, so ``TaskType.CAUSAL_LM`` works wherever a task does."""

    CAUSAL_LM = "causal-language-model"
    SEQUENCE_CLASSIFICATION = "sequence-classification"
    BASE_MODULE = "base-module"
    CUSTOM = "custom"

    def __str__(self) -> str:
        return self.value
