"""Fused MoE over float-coded (FP4) experts, MXFP4 and NVFP4, dequantized in the kernel, in Triton.

moeconv's reference kernel for float-coded outputs (DESIGN §7.3): it reads the E2M1 codes and the scale bytes
exactly as the compressed-tensors layout stores them (docs/FORMAT.md, "Float codes") and decodes both with
integer bit operations, so a wrong nibble order, scale bias or global-scale convention in the output shows up
as an error against a float64 reference that decodes the SOURCE through a lookup table (float_codes.py):

  codes         uint8 (E, N, K/2): E2M1, element 2j in the low nibble of byte j
  scales        uint8 (E, N, K/BLOCK): MXFP4 UE8M0 bytes (2^(b - 127), one per 32), NVFP4 E4M3 bytes (one per 16)
  global_scale  float32 (E, S) or None: NVFP4's per-tensor global scale of each of S equal row segments
                (w13 holds gate and up, two linears with a global scale each: S = 2), in the given
                convention, divided by (compressed-tensors' `weight_global_scale`) or multiplied by (ModelOpt's
                `weight_scale_2`)

W[n, k] = E2M1(c[n, k]) · scale(s[n, k // BLOCK]) [/ or ·] global[n // (N / S)].

Decoding, with integer operations only (the producers' arithmetic, docs/FLOAT_SOURCES.md):
* E2M1 (s.ee.m) placed in an fp16 as s.00ee.m000000000 is E2M1(c) · 2^-14 exactly (e = 0, m = 1 lands on
  fp16's subnormal 2^-15), so one shift and a multiplication by 2^14 in fp32 give the value, exact in
  fp16, bf16 and fp32 activations alike;
* E4M3 (s.eeee.mmm) placed as s.0eeee.mmm0000000 is the value · 2^-8 (bias 15 against 7, subnormals
  included), converted to fp32 and multiplied by 2^8;
* UE8M0 b is the fp32 with exponent field b (b = 0, 2^-127, is the fp32 subnormal 0x00400000).
The reserved bytes (UE8M0 0xFF, E4M3 S.1111.111) are never decoded: the formats refuse them at read.

Each K tile is one scale block, as each K tile of the integer kernel (fused_moe.py) lies in one group: the tile's
weights are exact small values in the activation dtype, `tl.dot` accumulates in fp32, and the block's scale
multiplies the partial sum once per column; the global scale applies once, after the K loop. Token-expert pairs
are sorted and padded per expert with the integer kernel's helpers. CPU tensors run the kernel under Triton's
interpreter, CUDA tensors compiled (fused_moe.kernel_for_device); bf16 activations only compiled (a bf16 cast
before `tl.dot` is garbage under the interpreter).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moeconv.float_codes import DIVIDE, MULTIPLY, UE8M0, FloatScheme
from moeconv.kernels.fused_moe import (ExpertBlocks, GemmConfig, choose_block_m, kernel_for_device,
                                       pairs_per_activation_row, run_fused_experts)

# The kernel's GLOBAL constexpr: how the global scale applies (none: MXFP4)
GLOBAL_MODES = {None: 0, MULTIPLY: 1, DIVIDE: 2}


class Fp4Experts(NamedTuple):
    """One stacked expert GEMM's float-coded weights, as the kernel reads them (shapes in the module docstring)."""

    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None = None


def choose_fp4_config(n: int, block: int, block_m: int, device: torch.device) -> GemmConfig:
    """Tiles: ``block_k`` is the scale block (16 or 32: one scale a column a tile); ``block_n`` 64 on a GPU (a
    reference kernel: not tuned, unlike fused_moe.choose_config), and under the interpreter one column block
    of up to 256 (a power of two, as `tl.arange` needs) with one warp (fewest programs: tests take seconds)."""
    if device.type != "cuda":
        return GemmConfig(block_m=block_m, block_n=min(256, max(16, triton.next_power_of_2(n))), block_k=block,
                          num_warps=1, num_stages=1)
    return GemmConfig(block_m=block_m, block_n=64, block_k=block, num_warps=4, num_stages=3)


def fp4_moe_gemm(a: torch.Tensor, weights: Fp4Experts, blocks: ExpertBlocks, *, scheme: FloatScheme,
                 topk_weights: torch.Tensor | None = None, config: GemmConfig | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """One grouped FP4 GEMM: ``out[p] = a[row(p)] · W[expert(p)]ᵀ`` for every token-expert pair ``p``.

    Args:
        a: (tokens or pairs, K) fp16, bf16 (compiled only) or fp32: one row per token (shared by its top-k
            pairs) or one per pair.
        weights: codes uint8 (E, N, K/2), scales uint8 (E, N, K/block), global_scale float32 (E, S) with S
            dividing N where the scheme has one (NVFP4), else None.
        blocks: the pairs sorted and padded per expert (fused_moe.align_tokens_to_experts), block_m 16 or more.
        scheme: the block, the scale encoding and the global scale's convention (float_codes.FloatScheme).
        topk_weights: (tokens, top-k) router weights multiplied into each pair's row, or None.
        config: tiles (default: `choose_fp4_config`); ``block_k`` must be the scale block.
        out_dtype: of the output (default ``a.dtype``).

    Returns:
        (pairs, N) in ``out_dtype``, accumulated in fp32.
    """
    codes, scales, global_scale = weights
    num_experts, n, packed_k = codes.shape
    k, block = 2 * packed_k, scheme.block
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"codes and scales must be uint8 bytes, got {codes.dtype} and {scales.dtype}")
    if a.shape[-1] != k or k % block:
        raise ValueError(f"activations have K={a.shape[-1]}, the codes K={k}, which must be a multiple of the "
                         f"{block}-element block")
    if scales.shape != (num_experts, n, k // block):
        raise ValueError(f"scales {tuple(scales.shape)} do not match ({num_experts}, {n}, {k // block})")
    if (global_scale is None) != (scheme.global_convention is None):
        raise ValueError(f"{scheme.describe()}: {'no' if global_scale is None else 'a'} global scale given")
    if global_scale is not None and (global_scale.dtype != torch.float32 or global_scale.dim() != 2
                                     or global_scale.shape[0] != num_experts or n % global_scale.shape[1]):
        raise ValueError(f"global_scale {global_scale.dtype}{tuple(global_scale.shape)} is not float32 "
                         f"({num_experts}, S) with S dividing N={n}")
    if blocks.block_m < 16:
        raise ValueError(f"block_m {blocks.block_m}: tl.dot needs row blocks of 16 or more")
    config = config or choose_fp4_config(n, block, blocks.block_m, a.device)
    if config.block_k != block or config.block_m != blocks.block_m or config.split_k != 1:
        raise ValueError(f"{config} does not fit block_m={blocks.block_m}: block_k must be the scale block "
                         f"{block}, split_k 1")
    pairs_per_a_row = pairs_per_activation_row(a, blocks)
    out = torch.empty(blocks.num_pairs, n, dtype=out_dtype or a.dtype, device=a.device)
    segments = scales if global_scale is None else global_scale  # any pointer where there is none
    router_weights = topk_weights.reshape(-1) if topk_weights is not None else segments
    grid = (blocks.block_experts.numel(), triton.cdiv(n, config.block_n))
    kernel_for_device(_fp4_moe_gemm_kernel, a.device)[grid](
        a, codes, scales, segments, out, router_weights, blocks.pair_ids, blocks.block_experts,
        blocks.num_pairs, pairs_per_a_row, num_experts, n, n // segments.shape[1], k // block,
        stride_am=a.stride(0), stride_ak=a.stride(1),
        stride_be=codes.stride(0), stride_bn=codes.stride(1), stride_bk=codes.stride(2),
        stride_se=scales.stride(0), stride_sn=scales.stride(1), stride_sk=scales.stride(2),
        stride_ge=segments.stride(0), stride_gs=segments.stride(1),
        stride_cm=out.stride(0), stride_cn=out.stride(1),
        SCALE_UE8M0=scheme.scale_encoding == UE8M0, GLOBAL=GLOBAL_MODES[scheme.global_convention],
        MUL_ROUTER_WEIGHT=topk_weights is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK=block,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def fp4_fused_moe(x: torch.Tensor, w13: Fp4Experts, w2: Fp4Experts, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, scheme: FloatScheme) -> torch.Tensor:
    """A float-coded MoE layer: ``Σ_k w[t,k] · (silu(x·Wgateᵀ) * (x·Wupᵀ)) · W2ᵀ`` over each token's top-k.

    ``x`` (T, H) fp16/fp32 (bf16 compiled only); ``w13`` (E, 2I, H) with gate rows first (its global scale
    (E, 2): gate's, up's), ``w2`` (E, H, I) (global (E, 1)); ``topk_weights`` (T, top-k) float,
    ``topk_ids`` (T, top-k) int. The gate/up output and SiLU-and-mul in x.dtype, as in vLLM; returns (T, H)
    in x.dtype."""
    num_experts = w13.codes.shape[0]
    block_m = max(16, choose_block_m(topk_ids.numel(), num_experts, x.device))  # tl.dot needs 16 rows or more
    return run_fused_experts(x, topk_weights, topk_ids, num_experts, block_m,
                             partial(fp4_moe_gemm, weights=w13, scheme=scheme),
                             partial(fp4_moe_gemm, weights=w2, scheme=scheme))


@triton.jit(do_not_specialize=["num_pairs"])
def _fp4_moe_gemm_kernel(
    a_ptr,  # (rows, K) fp16 / bf16 / fp32: one row per token or one per pair
    b_ptr,  # (E, N, K/2) uint8: E2M1 codes, element 2j in the low nibble of byte j
    scale_ptr,  # (E, N, K/BLOCK) uint8: UE8M0 or E4M3 scale bytes
    global_ptr,  # (E, S) float32: the global scale of each row segment (GLOBAL > 0), else unread
    c_ptr,  # (pairs, N) output
    router_weight_ptr,  # (pairs,) float32, read where MUL_ROUTER_WEIGHT
    pair_ids_ptr,  # (rows,) int32: the pair in each padded row, num_pairs for padding
    block_experts_ptr,  # (row blocks,) int32: each row block's expert, num_experts past the last
    num_pairs, pairs_per_a_row, num_experts, N, rows_per_segment, k_blocks,
    stride_am, stride_ak,
    stride_be, stride_bn, stride_bk,
    stride_se, stride_sn, stride_sk,
    stride_ge, stride_gs,
    stride_cm, stride_cn,
    SCALE_UE8M0: tl.constexpr, GLOBAL: tl.constexpr, MUL_ROUTER_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid (row blocks, column blocks); each row block reads one expert, each K tile one scale block.
    No nested @triton.jit calls: the interpreter path (fused_moe.kernel_for_device) cannot make them."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert >= num_experts:
        return
    pid_n = tl.program_id(1)
    BYTES: tl.constexpr = BLOCK // 2
    A_DTYPE: tl.constexpr = a_ptr.dtype.element_ty
    DOT_PRECISION: tl.constexpr = "tf32x3" if A_DTYPE == tl.float32 else "ieee"  # as in fused_moe

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ids_ptr + offs_m)
    row_valid = pair < num_pairs
    a_row = (pair // pairs_per_a_row).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = offs_n % N  # the last column block wraps, so weight loads need no mask
    expert = expert.to(tl.int64)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + tl.arange(0, BLOCK)[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + n_in[:, None] * stride_bn + tl.arange(0, BYTES)[None, :] * stride_bk
    scale_ptrs = scale_ptr + expert * stride_se + n_in * stride_sn
    nibble_shift = tl.arange(0, 2) * 4  # element 2j: bits 0-3 of byte j; element 2j + 1: bits 4-7

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k_block in range(0, k_blocks):
        packed = tl.load(b_ptrs + k_block * BYTES * stride_bk).to(tl.int32)  # (BLOCK_N, BYTES)
        codes = tl.reshape((packed[:, :, None] >> nibble_shift[None, None, :]) & 0xF, (BLOCK_N, BLOCK))
        # s.ee.m -> fp16 s.00ee.m000000000 = E2M1 · 2^-14, exactly
        half_bits = (((codes & 0x7) << 9) | ((codes & 0x8) << 12)).to(tl.int16)
        weights = (half_bits.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0).to(A_DTYPE)
        a = tl.load(a_ptrs + k_block * BLOCK * stride_ak, mask=row_valid[:, None], other=0.0)
        partial_sum = tl.dot(a, tl.trans(weights), input_precision=DOT_PRECISION)
        byte = tl.load(scale_ptrs + k_block * stride_sk).to(tl.int32)  # (BLOCK_N,)
        if SCALE_UE8M0:  # 2^(b - 127): the fp32 whose exponent field is b; b = 0 is the subnormal 2^-127
            scale = tl.where(byte == 0, 0x00400000, byte << 23).to(tl.float32, bitcast=True)
        else:  # E4M3 s.eeee.mmm -> fp16 s.0eeee.mmm0000000 = value · 2^-8, exactly (subnormals too)
            scale_bits = (((byte & 0x7F) << 7) | ((byte & 0x80) << 8)).to(tl.int16)
            scale = scale_bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        acc += partial_sum * scale[None, :]

    if GLOBAL > 0:
        segment = (n_in // rows_per_segment).to(tl.int64)
        global_scale = tl.load(global_ptr + expert * stride_ge + segment * stride_gs)
        if GLOBAL == 1:  # multiplied by (ModelOpt's weight_scale_2)
            acc = acc * global_scale[None, :]
        else:  # divided by (compressed-tensors' weight_global_scale)
            acc = acc / global_scale[None, :]
    if MUL_ROUTER_WEIGHT:
        acc *= tl.load(router_weight_ptr + pair, mask=row_valid, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_valid[:, None] & (offs_n[None, :] < N))
