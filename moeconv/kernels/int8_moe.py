"""Fused MoE over experts in the INT8 W8A8 layout (vLLM `TritonExperts` with ``use_int8_w8a8``).

moeconv's second reference kernel, for compressed-tensors ``int-quantized`` checkpoints converted
to the Triton backend: ``w13_weight`` int8 (E, 2I, H), ``w13_weight_scale`` fp32 (E, 2I, 1) and
the ``w2_*`` likewise (docs/FORMAT.md, W8A8; vLLM's `CompressedTensorsW8A8Int8MoEMethod`). As the serving kernel does, the activations of each
GEMM are quantized per token (per row) on the fly: ``s_a = max|a| / 127``, ``q = round(a / s_a)``.
The dot runs on int8 × int8 → int32, exact, and the row scale times the weight's channel scale
turns the int32 sum into the output: ``out = (q · Wᵀ) · s_a · s_w``.

Token-expert pairs are sorted and padded per expert exactly as for the W4A16 kernel (shared
helpers of :mod:`moeconv.kernels.fused_moe`). CPU tensors run the same kernel under Triton's
interpreter, CUDA tensors run it compiled, picked per call from the device.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import triton
import triton.language as tl

from moeconv.kernels.fused_moe import (ExpertBlocks, GemmConfig, choose_block_m, kernel_for_device,
                                       multiprocessor_count, pairs_per_activation_row, run_fused_experts)

INT8_MAX = 127


def quantize_per_token(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 quantization of each row: (int8 rows, fp32 scales (rows,)).

    Round half to even, as vLLM's ``scaled_int8_quant``; an all-zero row gets scale 1, not 0/0.
    """
    a32 = a.float()
    scales = a32.abs().amax(dim=-1) / INT8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    quantized = torch.round(a32 / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return quantized, scales


def choose_int8_config(num_pairs: int, num_experts: int, n: int, k: int, block_m: int,
                       device: torch.device) -> GemmConfig:
    """Tiles for the int8 tensor-core dot (16 rows at least, power-of-two tiles): ``block_k`` the
    largest of 128/64/32/16 dividing K (128 int8 = one 128-byte line per weight row); ``block_n``
    128; K split in two while the grid is under two waves of the GPU and each split keeps four K
    tiles (decode of a long-K GEMM). Under the interpreter, small tiles and no split."""
    block_k = next((b for b in (128, 64, 32, 16) if k % b == 0), None)
    if block_k is None:
        raise ValueError(f"K={k} must be a multiple of 16")
    if device.type != "cuda":
        return GemmConfig(block_m=block_m, block_n=64, block_k=block_k, num_warps=1, num_stages=1)
    active_experts = max(1, min(num_experts, num_pairs))
    programs = active_experts * math.ceil(num_pairs / active_experts / block_m) * math.ceil(n / 128)
    k_tiles, split_k = k // block_k, 1
    target = 2 * multiprocessor_count(device)
    while programs * split_k < target and k_tiles % (2 * split_k) == 0 and k_tiles // (2 * split_k) >= 4:
        split_k *= 2
    return GemmConfig(block_m=block_m, block_n=128, block_k=block_k, split_k=split_k)


def int8_moe_gemm(a: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, blocks: ExpertBlocks, *,
                  topk_weights: torch.Tensor | None = None, config: GemmConfig | None = None,
                  out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One grouped W8A8 GEMM: ``out[p] = quant(a[row(p)]) · W[expert(p)]ᵀ`` for every pair ``p``.

    ``a`` float, one row per token or one per pair; ``weight`` int8 (E, N, K); ``weight_scale``
    (E, N, 1) fp32. With ``topk_weights`` each row is multiplied by its pair's router weight.
    """
    num_experts, n, k = weight.shape
    if weight.dtype != torch.int8 or a.shape[-1] != k:
        raise ValueError(f"want int8 weights (E, N, {a.shape[-1]}), got {weight.dtype}{tuple(weight.shape)}")
    if blocks.block_m < 16:
        raise ValueError(f"block_m {blocks.block_m}: the int8 tl.dot needs row blocks of 16 or more")
    if weight_scale.shape != (num_experts, n, 1):
        raise ValueError(f"weight_scale {tuple(weight_scale.shape)} is not ({num_experts}, {n}, 1)")
    pairs_per_a_row = pairs_per_activation_row(a, blocks)
    if config is None:
        config = choose_int8_config(blocks.num_pairs, num_experts, n, k, blocks.block_m, a.device)
    quantized, a_scale = quantize_per_token(a)
    accumulate = config.split_k > 1
    out = torch.empty(blocks.num_pairs, n, dtype=out_dtype, device=a.device)
    target = torch.zeros(out.shape, dtype=torch.float32, device=a.device) if accumulate else out
    k_tiles = k // config.block_k
    k_tiles_per_split = math.ceil(k_tiles / config.split_k)
    router_weights = topk_weights.reshape(-1) if topk_weights is not None else a_scale
    grid = (blocks.block_experts.numel(), triton.cdiv(n, config.block_n), math.ceil(k_tiles / k_tiles_per_split))
    kernel_for_device(_int8_moe_gemm_kernel, a.device)[grid](
        quantized, a_scale, weight, weight_scale, target, router_weights, blocks.pair_ids, blocks.block_experts,
        blocks.num_pairs, pairs_per_a_row, num_experts, n, k_tiles, k_tiles_per_split,
        quantized.stride(0), quantized.stride(1),
        weight.stride(0), weight.stride(1), weight.stride(2),
        weight_scale.stride(0), weight_scale.stride(1),
        target.stride(0), target.stride(1),
        MUL_ROUTER_WEIGHT=topk_weights is not None, ACCUMULATE=accumulate,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if accumulate:
        out.copy_(target)
    return out


def int8_fused_moe(x: torch.Tensor, w13_weight: torch.Tensor, w13_weight_scale: torch.Tensor,
                   w2_weight: torch.Tensor, w2_weight_scale: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> torch.Tensor:
    """A W8A8 MoE layer: ``Σ_k w[t,k] · (silu(x·Wgateᵀ) * (x·Wupᵀ)) · W2ᵀ``, both GEMMs on
    per-token int8 activations. The gate/up output and SiLU-and-mul stay in x.dtype, as in vLLM."""
    num_experts = w13_weight.shape[0]
    block_m = max(16, choose_block_m(topk_ids.numel(), num_experts))  # int8 tl.dot needs 16 rows or more
    return run_fused_experts(x, topk_weights, topk_ids, num_experts, block_m,
                             partial(int8_moe_gemm, weight=w13_weight, weight_scale=w13_weight_scale),
                             partial(int8_moe_gemm, weight=w2_weight, weight_scale=w2_weight_scale))


@triton.jit(do_not_specialize=["num_pairs"])
def _int8_moe_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, router_weight_ptr, pair_ids_ptr, block_experts_ptr,
    num_pairs, pairs_per_a_row, num_experts, N, k_tiles, k_tiles_per_split,
    stride_am, stride_ak,
    stride_be, stride_bn, stride_bk,
    stride_se, stride_sn,
    stride_cm, stride_cn,
    MUL_ROUTER_WEIGHT: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid (row blocks, column blocks, K splits); every row block reads one expert. The int32
    accumulator is exact, so the two scales are applied once, after the K loop."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert >= num_experts:
        return
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ids_ptr + offs_m)
    row_valid = pair < num_pairs
    a_row = (pair // pairs_per_a_row).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = offs_n % N  # the last column block wraps, so weight loads need no mask
    offs_k = tl.arange(0, BLOCK_K)
    expert = expert.to(tl.int64)

    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + n_in[None, :] * stride_bn + offs_k[:, None] * stride_bk
    k_tile_begin = pid_k * k_tiles_per_split
    k_tile_end = tl.minimum(k_tile_begin + k_tiles_per_split, k_tiles)
    acc = tl.full((BLOCK_M, BLOCK_N), 0, tl.int32)
    for k_tile in range(k_tile_begin, k_tile_end):
        k0 = k_tile * BLOCK_K
        a = tl.load(a_ptrs + k0 * stride_ak, mask=row_valid[:, None], other=0)
        b = tl.load(b_ptrs + k0 * stride_bk)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)  # compiled, int8 dots must name their int32 accumulator

    a_scale = tl.load(a_scale_ptr + a_row, mask=row_valid, other=0.0)
    b_scale = tl.load(b_scale_ptr + expert * stride_se + n_in * stride_sn)
    result = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    if MUL_ROUTER_WEIGHT:
        result *= tl.load(router_weight_ptr + pair, mask=row_valid, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = row_valid[:, None] & (offs_n[None, :] < N)
    if ACCUMULATE:
        tl.atomic_add(c_ptrs, result, mask=c_mask, sem="relaxed")
    else:
        tl.store(c_ptrs, result.to(c_ptr.dtype.element_ty), mask=c_mask)
