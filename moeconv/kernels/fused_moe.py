"""Fused MoE over experts in the ``moe_wna16`` layout (W4A16 / W8A16), in Triton.

This is moeconv's own kernel for numerical verification (DESIGN §7.3): it reads converted
tensors exactly as the serving layout defines them (docs/FORMAT.md, backend triton), so a layout mistake
shows up as a numerical error against a float reference that dequantizes the *source*.

One Triton kernel does both expert GEMMs of a layer (``y = a · Wᵀ`` per token-expert pair):
pairs are sorted by expert in torch and each expert's run is padded to ``block_m`` rows
(:func:`align_tokens_to_experts`), so every row block of the grid reads a single expert.

Tensors on a CUDA device run the compiled kernel; CPU tensors run the same kernel under Triton's
interpreter (slow: small shapes only). The choice is made per call from the device, so neither
``TRITON_INTERPRET`` nor import order matters. The price: a kernel interpreted this way cannot
call other ``@triton.jit`` functions, Triton's own ``tl.sum`` included, hence ``tl.reduce`` with
Triton's sum combiner below. Under the interpreter a cast to bf16 followed by ``tl.dot`` returns
garbage, so there bf16 activations are unsupported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, partial
from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.standard import _sum_combine  # what tl.sum reduces with; see the module docstring
from triton.runtime.interpreter import InterpretedFunction

SUPPORTED_BITS = (4, 8)
REGISTER_PATH_MAX_ROWS = 2  # average rows per selected expert up to which one row per program wins
WAVES = 8  # programs per multiprocessor that split-K aims for, to keep enough weight bytes in flight
MAX_SPLIT_K = 16  # the largest split measured; each split adds a round of fp32 atomics


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and launch parameters of one grouped GEMM launch."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


@dataclass(frozen=True)
class ExpertBlocks:
    """Token-expert pairs sorted by expert, each expert's run padded to ``block_m`` rows.

    Pair ``p = token * topk + slot``. ``pair_ids[i]`` is the pair in row ``i`` (``num_pairs``
    for padding); ``block_experts[b]`` is the expert of row block ``b`` (``num_experts`` for
    blocks past the last used one, which the kernel skips at once).
    """

    pair_ids: torch.Tensor
    block_experts: torch.Tensor
    block_m: int
    num_pairs: int
    num_experts: int
    topk: int


def align_tokens_to_experts(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Sort token-expert pairs by expert and pad each expert's run to ``block_m`` rows.

    Pure tensor ops without host synchronisation, so it can be captured in a CUDA graph.
    Only experts that received tokens get blocks: at most ``min(num_experts, num_pairs)``
    experts are non-empty, each adding fewer than ``block_m`` padding rows, which bounds the
    row capacity (and the grid) tightly for decode batches.
    """
    device = topk_ids.device
    expert_of_pair = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = expert_of_pair.numel()
    sorted_experts, pair_order = torch.sort(expert_of_pair, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, expert_of_pair, torch.ones_like(expert_of_pair))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded_counts.cumsum(0)
    run_starts = counts.cumsum(0) - counts
    rank_in_expert = torch.arange(num_pairs, device=device) - run_starts[sorted_experts]
    rows = (padded_ends - padded_counts)[sorted_experts] + rank_in_expert

    capacity = _ceil_to(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    pair_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    pair_ids.scatter_(0, rows, pair_order.to(torch.int32))
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True).to(torch.int32)
    return ExpertBlocks(pair_ids, block_experts, block_m, num_pairs, num_experts, topk_ids.shape[-1])


def pairs_per_activation_row(a: torch.Tensor, blocks: ExpertBlocks) -> int:
    """How many token-expert pairs read each row of ``a``: top-k when it holds one row per token
    (the first GEMM), 1 when it holds one row per pair (the second)."""
    if a.shape[0] == blocks.num_pairs // blocks.topk:
        return blocks.topk
    if a.shape[0] == blocks.num_pairs:
        return 1
    raise ValueError(f"a has {a.shape[0]} rows: want one per token or one per pair ({blocks.num_pairs})")


def choose_block_m(num_pairs: int, num_experts: int, device: torch.device | None = None) -> int:
    """Rows per block, from the average run length of a non-empty expert.

    Decode gives each selected expert about one row: then one row per program (the register
    path) streams the weights with the fewest instructions per byte. Longer runs take tensor-core
    tiles of 16-64 rows so that each dequantized weight tile serves many rows. The interpreter
    (``device`` not CUDA; None means a GPU) runs fastest with the fewest programs, so there every
    block has 16 rows or more.
    """
    rows_per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    if rows_per_expert <= REGISTER_PATH_MAX_ROWS and (device is None or device.type == "cuda"):
        return 1
    return 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 32 else 64


def choose_config(num_pairs: int, num_experts: int, n: int, k: int, group_size: int, bits: int,
                  block_m: int, device: torch.device) -> GemmConfig:
    """A small heuristic for the tile shape of one GEMM (``n`` outputs, ``k`` inputs).

    Decode streams weight bytes, so the aim is many bytes in flight on every multiprocessor.
    Each choice below was the best or within 5% of it in the H200 sweeps of
    benchmarks/bench_kernel.py (E=8 top-2 H=4096 I=14336 and E=128 top-8 H=2048 I=768):
    * ``block_k``: at most 64 and a divisor of the group, so a tile needs one scale and one zero
      per column; 64 beat 32 and 128 in the sweeps;
    * ``block_n`` 128 on both paths (it beat 256 and 512 on the one-row path, 64 and 256 on the
      tensor-core path), with 4 warps (they beat 8);
    * ``split_k``: while the grid gives fewer than ``WAVES`` programs per multiprocessor (decode,
      above all of the long-K down projection: 3.5x faster at one token), split K in two, up
      to ``MAX_SPLIT_K`` and keeping at least two K tiles per split; partial sums meet through
      fp32 atomics. Prefill-sized blocks already fill the GPU and are not split.
    Under the interpreter, small tiles and no split keep tests to seconds.
    """
    group = k if group_size == -1 else group_size
    block_k = next((b for b in (64, 32, 16) if group % b == 0), None)
    if block_k is None:
        raise ValueError(f"group size {group} must be a multiple of 16")
    if device.type != "cuda":
        return GemmConfig(block_m=block_m, block_n=min(256, _ceil_to(n, 16)), block_k=block_k, num_warps=1,
                          num_stages=1)
    block_n = 128
    active_experts = max(1, min(num_experts, num_pairs))
    programs = active_experts * math.ceil(num_pairs / active_experts / block_m) * math.ceil(n / block_n)
    k_tiles = k // block_k
    split_k = 1
    while (block_m < 64 and split_k < MAX_SPLIT_K and programs * split_k < WAVES * multiprocessor_count(device)
           and k_tiles % (2 * split_k) == 0 and k_tiles // (2 * split_k) >= 2):
        split_k *= 2
    return GemmConfig(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k,
                      num_stages=4 if block_m < 64 else 3)


def moe_gemm(a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
             blocks: ExpertBlocks, *, bits: int, group_size: int, topk_weights: torch.Tensor | None = None,
             config: GemmConfig | None = None, out: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """One grouped quantized GEMM: ``out[p] = a[row(p)] · W[expert(p)]ᵀ`` for every pair ``p``.

    ``a`` holds one row per token (shared by its top-k pairs) or one row per pair. ``qweight``
    (E, N, K·bits/8) uint8, ``scales`` (E, N, K/g), ``qzeros`` (E, N·bits/8, K/g) uint8 or None
    (symmetric: zero 8 or 128), as in docs/FORMAT.md (backend triton); ``group_size`` -1 means channel-wise.
    With ``topk_weights`` each output row is multiplied by its pair's router weight. Returns
    ``out`` (num_pairs, N), allocated in ``out_dtype`` (default ``a.dtype``) when not given.
    """
    num_experts, n, packed_k = qweight.shape
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    k = packed_k * 8 // bits
    group = k if group_size == -1 else group_size
    if a.shape[-1] != k or k % group:
        raise ValueError(f"activations have K={a.shape[-1]}, weights K={k}, group size {group}")
    if qweight.dtype != torch.uint8 or (qzeros is not None and qzeros.dtype != torch.uint8):
        raise TypeError("qweight and qzeros must be uint8")
    if scales.shape != (num_experts, n, k // group):
        raise ValueError(f"scales {tuple(scales.shape)} do not match ({num_experts}, {n}, {k // group})")
    if qzeros is not None and qzeros.shape != (num_experts, n * bits // 8, k // group):
        raise ValueError(f"qzeros {tuple(qzeros.shape)} do not match ({num_experts}, {n * bits // 8}, {k // group})")
    pairs_per_a_row = pairs_per_activation_row(a, blocks)
    if config is None:
        config = choose_config(blocks.num_pairs, num_experts, n, k, group_size, bits, blocks.block_m, a.device)
    if (config.block_m != blocks.block_m or (config.block_m != 1 and config.block_m % 16) or group % config.block_k
            or config.block_k % 16 or (k // config.block_k) % config.split_k):
        raise ValueError(f"{config} does not fit block_m={blocks.block_m}, group size {group}, K={k}: block_m "
                         "must be 1 or a multiple of 16, block_k a multiple of 16 dividing the group, split_k "
                         "a divisor of the number of K tiles")
    accumulate = config.split_k > 1  # partial sums meet in a zeroed fp32 buffer through atomics
    target = torch.zeros(blocks.num_pairs, n, dtype=torch.float32, device=a.device) if accumulate else out
    if out is None:
        out_dtype = out_dtype or a.dtype
        fp32_target = accumulate and out_dtype == torch.float32
        out = target if fp32_target else torch.empty(blocks.num_pairs, n, dtype=out_dtype, device=a.device)
    target = out if target is None else target
    code_int, code_float, code_magic = _exact_code_float(a.dtype, bits)
    words = qweight.view(torch.int32)  # 4 bytes at a time; little-endian: byte 0 is bits 0-7
    zeros_or_dummy = scales if qzeros is None else qzeros
    router_weights = topk_weights.reshape(-1) if topk_weights is not None else scales
    grid = (blocks.block_experts.numel(), triton.cdiv(n, config.block_n), config.split_k)
    kernel_for_device(_moe_gemm_kernel, a.device)[grid](
        a, words, scales, zeros_or_dummy, target, router_weights, blocks.pair_ids, blocks.block_experts,
        blocks.num_pairs, pairs_per_a_row, num_experts, n, group, k // config.block_k // config.split_k,
        a.stride(0), a.stride(1),
        words.stride(0), words.stride(1), words.stride(2),
        scales.stride(0), scales.stride(1), scales.stride(2),
        zeros_or_dummy.stride(0), zeros_or_dummy.stride(1), zeros_or_dummy.stride(2),
        target.stride(0), target.stride(1),
        BITS=bits, HAS_ZEROS=qzeros is not None, MUL_ROUTER_WEIGHT=topk_weights is not None,
        ACCUMULATE=accumulate, CODE_INT=code_int, CODE_FLOAT=code_float, CODE_MAGIC=code_magic,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if target is not out:
        out.copy_(target)
    return out


def fused_moe(x: torch.Tensor, w13_qweight: torch.Tensor, w13_scales: torch.Tensor, w13_qzeros: torch.Tensor | None,
              w2_qweight: torch.Tensor, w2_scales: torch.Tensor, w2_qzeros: torch.Tensor | None,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, bits: int, group_size: int) -> torch.Tensor:
    """A MoE layer: ``Σ_k w[t,k] · (silu(x·Wgateᵀ) * (x·Wupᵀ)) · W2ᵀ`` over each token's top-k experts.

    Weights in the ``moe_wna16`` layout (rows [0, I) of w13 are gate, [I, 2I) up); one
    ``group_size`` for both GEMMs, -1 for channel-wise. Accumulates in fp32; returns x.dtype.
    """
    num_experts = w13_qweight.shape[0]
    w13_gemm = partial(moe_gemm, qweight=w13_qweight, scales=w13_scales, qzeros=w13_qzeros, bits=bits,
                       group_size=group_size)
    w2_gemm = partial(moe_gemm, qweight=w2_qweight, scales=w2_scales, qzeros=w2_qzeros, bits=bits,
                      group_size=group_size)
    block_m = choose_block_m(topk_ids.numel(), num_experts, x.device)
    return run_fused_experts(x, topk_weights, topk_ids, num_experts, block_m, w13_gemm, w2_gemm)


def run_fused_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                      block_m: int, w13_gemm: Callable[..., torch.Tensor],
                      w2_gemm: Callable[..., torch.Tensor]) -> torch.Tensor:
    """What every fused-MoE kernel here does around its grouped GEMM: sort and pad the token-expert
    pairs, gate/up GEMM (output in x.dtype), SiLU-and-mul, down GEMM weighted by the router (fp32),
    sum over each token's top-k. The launchers take ``(a, blocks=, out_dtype=, [topk_weights=])``."""
    num_tokens, hidden = x.shape
    blocks = align_tokens_to_experts(topk_ids, num_experts, block_m)
    gate_up = w13_gemm(x, blocks=blocks, out_dtype=x.dtype)
    intermediate = gate_up.shape[1] // 2
    activated = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
    down = w2_gemm(activated, blocks=blocks, topk_weights=topk_weights.contiguous(), out_dtype=torch.float32)
    return down.view(num_tokens, blocks.topk, hidden).sum(dim=1).to(x.dtype)


def _exact_code_float(dtype: torch.dtype, bits: int):
    """How the tensor-core path turns a code into a float with integer ops only (no int->float cvt).

    OR-ing a code into the mantissa of a power of two M gives exactly ``M + code`` when the code
    fits the mantissa: fp16 ``0x6400`` = 1024 (10 bits), bf16 ``0x4300`` = 128 (7 bits: 4-bit
    codes only), fp32 ``0x4B000000`` = 2^23. Subtracting ``M + zero`` formed the same way leaves
    ``code - zero``, an integer exact in the activation dtype.
    """
    if dtype == torch.float16:
        return tl.int16, tl.float16, 0x6400
    if dtype == torch.bfloat16 and bits == 4:
        return tl.int16, tl.bfloat16, 0x4300
    if dtype in (torch.bfloat16, torch.float32):
        return tl.int32, tl.float32, 0x4B000000
    raise TypeError(f"activations must be fp16, bf16 or fp32, got {dtype}")


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gemm_kernel(
    a_ptr, b_ptr, scale_ptr, zero_ptr, c_ptr, router_weight_ptr, pair_ids_ptr, block_experts_ptr,
    num_pairs, pairs_per_a_row, num_experts, N, group_size, k_tiles_per_split,
    stride_am, stride_ak,
    stride_be, stride_bn, stride_bk,
    stride_se, stride_sn, stride_sg,
    stride_ze, stride_zn, stride_zg,
    stride_cm, stride_cn,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, MUL_ROUTER_WEIGHT: tl.constexpr, ACCUMULATE: tl.constexpr,
    CODE_INT: tl.constexpr, CODE_FLOAT: tl.constexpr, CODE_MAGIC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid (row blocks, column blocks, K splits); ``b_ptr`` is the packed weights seen as int32.

    Each K tile lies in one quantization group, so the tile computes with exact integers
    ``code - zero`` and the group's scale multiplies the partial sum once per column. Weights are
    loaded once per tile, 16 bytes per thread, and unpacked in registers with shifts and masks.

    Row blocks of 16 or more use ``tl.dot`` (tensor cores; Triton pipelines the loads through
    shared memory). Blocks of one row (decode, where a selected expert sees about one token) use
    fp32 multiply-adds in the layout the weights were loaded in: no shared-memory round trip and
    about 5 instructions per weight (SASS for sm_90), against about 7 for the dot path."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert >= num_experts:
        return
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    CODES_PER_BYTE: tl.constexpr = 8 // BITS
    CODES_PER_WORD: tl.constexpr = 32 // BITS
    WORDS_K: tl.constexpr = BLOCK_K // CODES_PER_WORD
    CODE_MASK: tl.constexpr = (1 << BITS) - 1
    USE_DOT: tl.constexpr = BLOCK_M >= 16
    MANTISSA_LOW: tl.constexpr = 23 - BITS  # a code in bits [23 - BITS, 23) of an fp32 is code / 2^BITS
    ONE_FP32: tl.constexpr = 0x3F800000
    A_DTYPE: tl.constexpr = a_ptr.dtype.element_ty
    # fp32 activations: three tf32 products recover fp32 accuracy on tensor cores (a plain fp32
    # dot falls back to FMAs and spills); fp16/bf16 ignore the setting.
    DOT_PRECISION: tl.constexpr = "tf32x3" if A_DTYPE == tl.float32 else "ieee"

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ids_ptr + offs_m)
    row_valid = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = offs_n % N  # the last column block wraps, so weight loads need no mask
    expert = expert.to(tl.int64)
    # code k of a row sits in int32 word k // CODES_PER_WORD at bit BITS * (k % CODES_PER_WORD)
    offs_word = tl.arange(0, WORDS_K)
    code_shift = tl.arange(0, CODES_PER_WORD) * BITS
    w_ptrs = b_ptr + expert * stride_be + n_in[:, None] * stride_bn + offs_word[None, :] * stride_bk
    if USE_DOT:
        a_row = (pair // pairs_per_a_row).to(tl.int64)
        a_ptrs = a_ptr + a_row[:, None] * stride_am + tl.arange(0, BLOCK_K)[None, :] * stride_ak
    else:  # one row (so no padding): element k = CODES_PER_WORD * word + code, one code position at a time
        a_ptrs = a_ptr + (tl.load(pair_ids_ptr + pid_m) // pairs_per_a_row).to(tl.int64) * stride_am \
            + offs_word * CODES_PER_WORD * stride_ak
    scale_ptrs = scale_ptr + expert * stride_se + n_in * stride_sn
    zero_ptrs = zero_ptr + expert * stride_ze + (n_in // CODES_PER_BYTE) * stride_zn
    zero_shift = (n_in % CODES_PER_BYTE) * BITS

    if USE_DOT:
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    else:
        acc = tl.full((BLOCK_N,), 0.0, tl.float32)
    for k_tile in range(pid_k * k_tiles_per_split, (pid_k + 1) * k_tiles_per_split):
        k0 = k_tile * BLOCK_K
        group = k0 // group_size
        scale = tl.load(scale_ptrs + group * stride_sg).to(tl.float32)
        if HAS_ZEROS:
            zero = (tl.load(zero_ptrs + group * stride_zg) >> zero_shift) & CODE_MASK
        else:
            zero = tl.full((BLOCK_N,), 1 << (BITS - 1), tl.int32)
        words = tl.load(w_ptrs + k_tile * WORDS_K * stride_bk)
        if USE_DOT:
            zero = (zero.to(CODE_INT) | CODE_MAGIC).to(CODE_FLOAT, bitcast=True)
            codes = (words[:, :, None] >> code_shift[None, None, :]) & CODE_MASK  # (BLOCK_N, WORDS_K, CODES_PER_WORD)
            weights = (codes.to(CODE_INT) | CODE_MAGIC).to(CODE_FLOAT, bitcast=True) - zero[:, None, None]
            weights = tl.reshape(weights.to(A_DTYPE), (BLOCK_N, BLOCK_K))
            a = tl.load(a_ptrs + k0 * stride_ak, mask=row_valid[:, None], other=0.0)
            acc += tl.dot(a, tl.trans(weights), input_precision=DOT_PRECISION) * scale[None, :]
        else:
            # Each code goes into the top mantissa bits of 1.0: w = 1 + code / 2^BITS exactly, with
            # one shift and one and-or. Then sum(a * (code - zero)) = 2^BITS * sum(a * w)
            # - (2^BITS + zero) * sum(a): one fused multiply-add per weight, no cancellation.
            products = tl.full((BLOCK_N, WORDS_K), 0.0, tl.float32)
            a_sum = tl.full((WORDS_K,), 0.0, tl.float32)
            for code in tl.static_range(CODES_PER_WORD):
                if code * BITS <= MANTISSA_LOW:
                    moved = words << (MANTISSA_LOW - code * BITS)
                else:
                    moved = words >> (code * BITS - MANTISSA_LOW)
                weights = ((moved & (CODE_MASK << MANTISSA_LOW)) | ONE_FP32).to(tl.float32, bitcast=True)
                a = tl.load(a_ptrs + (k0 + code) * stride_ak).to(tl.float32)
                products += weights * a[None, :]
                a_sum += a
            zero_sum = ((1 << BITS) + zero.to(tl.float32)) * tl.reduce(a_sum, 0, _sum_combine)
            acc += ((1 << BITS) * tl.reduce(products, 1, _sum_combine) - zero_sum) * scale

    if not USE_DOT:
        acc = acc[None, :]
    if MUL_ROUTER_WEIGHT:
        acc *= tl.load(router_weight_ptr + pair, mask=row_valid, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = row_valid[:, None] & (offs_n[None, :] < N)
    if ACCUMULATE:
        tl.atomic_add(c_ptrs, acc, mask=c_mask, sem="relaxed")
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def kernel_for_device(kernel, device: torch.device):
    """The compiled kernel for CUDA tensors, the interpreted one for CPU tensors."""
    return kernel if device.type == "cuda" else _interpreted(kernel)


@cache
def _interpreted(kernel):
    if isinstance(kernel, InterpretedFunction):  # TRITON_INTERPRET=1 was set before import
        return kernel
    return InterpretedFunction(kernel.fn)


@cache
def multiprocessor_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _ceil_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
