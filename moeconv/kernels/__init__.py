"""moeconv's Triton fused-MoE kernels (``moe_wna16`` W4A16/W8A16 and INT8 W8A8) and their float references."""

from moeconv.kernels.fused_moe import (ExpertBlocks, GemmConfig, align_tokens_to_experts, choose_block_m,
                                       choose_config, fused_moe, moe_gemm)
from moeconv.kernels.int8_moe import choose_int8_config, int8_fused_moe, int8_moe_gemm, quantize_per_token
from moeconv.kernels.reference import (DequantizedExperts, dequantize_wna16, random_routing, reference_fused_moe,
                                       relative_error)

__all__ = [
    "DequantizedExperts",
    "ExpertBlocks",
    "GemmConfig",
    "align_tokens_to_experts",
    "choose_block_m",
    "choose_config",
    "choose_int8_config",
    "dequantize_wna16",
    "fused_moe",
    "int8_fused_moe",
    "int8_moe_gemm",
    "moe_gemm",
    "quantize_per_token",
    "random_routing",
    "reference_fused_moe",
    "relative_error",
]
