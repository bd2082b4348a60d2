"""moeconv's Triton fused-MoE kernel for the ``moe_wna16`` layout and its float references."""

from moeconv.kernels.fused_moe import (
    ExpertBlocks,
    GemmConfig,
    align_tokens_to_experts,
    choose_block_m,
    choose_config,
    fused_moe,
    moe_gemm,
)
from moeconv.kernels.int8_moe import choose_int8_config, int8_fused_moe, int8_moe_gemm, quantize_per_token
from moeconv.kernels.reference import (
    DequantizedExperts,
    dequantize_wna16,
    random_routing,
    reference_fused_moe,
    relative_error,
)

__all__ = [
    "DequantizedExperts",
    "ExpertBlocks",
    "GemmConfig",
    "align_tokens_to_experts",
    "choose_block_m",
    "choose_config",
    "dequantize_wna16",
    "fused_moe",
    "moe_gemm",
    "random_routing",
    "reference_fused_moe",
    "relative_error",
]
