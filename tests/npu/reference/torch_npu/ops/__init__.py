"""The torch_npu ops of the reference, as `torch_npu.<name>` (and `torch.ops.npu.<name>`)."""

from __future__ import annotations

from . import rules as rules
from .attention import npu_lightning_indexer, npu_sparse_flash_attention
from .cache import npu_scatter_nd_update, npu_scatter_nd_update_, scatter_update, scatter_update_
from .fusion_attention import npu_fusion_attention
from .moe import npu_grouped_matmul, npu_moe_finalize_routing, npu_moe_gating_top_k, npu_moe_init_routing_v2
from .norm_rope import npu_interleave_rope, npu_rms_norm, npu_rotary_mul, npu_swiglu
from .quant import npu_dynamic_quant
from .quant import quant_matmul as npu_quant_matmul

__all__ = [
    "npu_dynamic_quant",
    "npu_fusion_attention",
    "npu_grouped_matmul",
    "npu_interleave_rope",
    "npu_lightning_indexer",
    "npu_moe_finalize_routing",
    "npu_moe_gating_top_k",
    "npu_moe_init_routing_v2",
    "npu_quant_matmul",
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_scatter_nd_update",
    "npu_scatter_nd_update_",
    "npu_sparse_flash_attention",
    "npu_swiglu",
    "scatter_update",
    "scatter_update_",
]
