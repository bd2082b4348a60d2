"""Torch references of the x86 CPU MoE kernels that read the cpu backend's layouts the way the kernels
do, never through the backend's decoder, so verify's numerics check covers the bytes the kernel would
read:

* INT4 (sgl-kernel `fused_experts_int4_w4a8`, vLLM `CPUExpertsInt4`): the group size and block_k derived
  once per layer from w13 and H, as the kernel derives them (`kernel_view`); nibbles by their byte position
  in each (32-channel, block_k) block, the STORED compensation sums, the blocked scales and zero points.
  Per block the integer dot product Σ q·(c − z) minus 128·compensation gives Σ (q − 128)·(c − z); that
  times the row scale and the channel's group scale is accumulated over K blocks in fp32. Gate/up
  outputs, SiLU·up and the weighted down output are rounded to the activation dtype.
* INT8 (sgl-kernel `fused_experts_int8_kernel_impl`, vLLM `CPUExpertsInt8`): int8 weights by their
  VNNI position in each 32-channel block and the STORED compensation 128·Σw. Σ q·w over all of K minus
  the compensation gives Σ (q − 128)·w, times the row scale times the channel scale, in fp32. SiLU·up
  is fused on the fp32 accumulators and stored in the activation dtype, as is the weighted down output.

Both quantize activations as the kernels do (W8A8 / W4A8): each row to uint8 with zero point 128 and
scale max|x|/127 (`quantize_row_int8`), i.e. symmetric int8 codes shifted by 128 so that the u8·s8
VNNI instruction applies; the compensation removes the shift. With `quantize_activations=False` the same
reads run with float activations (W4A16 / W8A16), which isolates the error activation quantization adds.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import torch
import torch.nn.functional as F

from moeconv import packing
from moeconv.backends.cpu import (ACTIVATION_ZERO_POINT, BLOCK_N, COMPENSATION_BYTES, COMPENSATION_BYTES_PER_ROW,
                                  MAX_BLOCK_K, VNNI, BlockedInt4, VnniInt8, blocked_suffixes, vnni_suffixes)
from moeconv.canonical import MoELayerShape

ACTIVATION_LEVELS = 127  # max|x| maps to ±127, so codes stay in [1, 255]
_MIN_ABS_MAX = 1e-7  # the kernel's floor under max|x|


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row uint8 codes (as int32, zero point 128) and fp32 scales, as sgl-kernel's
    `quantize_row_int8`: scale = max|x| / 127, code = round_half_away(x · 127 / max|x|) + 128."""
    x = x.to(torch.float32)
    abs_max = x.abs().amax(dim=1).clamp(min=_MIN_ABS_MAX)
    scaled = x * (ACTIVATION_LEVELS / abs_max)[:, None]
    rounded = scaled.sign() * torch.floor(scaled.abs() + 0.5)  # std::round, not torch's half-to-even
    return rounded.to(torch.int32) + ACTIVATION_ZERO_POINT, abs_max / ACTIVATION_LEVELS


def signed_block_weights(blocked: BlockedInt4) -> torch.Tensor:
    """int32 (N/32, K/block_k, block_k, 32) of (code − zero), k-major inside each block.

    Read as the kernel's `load_uint4_as_int8` does: 32 bytes per k-quad and 16-channel half h,
    byte (ni, ki) low nibble -> channel 16h + ni, high nibble -> channel 16h + 8 + ni, at k = 4q + ki.
    """
    nc, kc, block_bytes = blocked.qweight.shape
    nibble_bytes = blocked.qweight[..., : block_bytes - COMPENSATION_BYTES].to(torch.int32)
    quads = nibble_bytes.reshape(nc, kc, -1, 2, 8, VNNI)  # (nc, kc, q, h, ni, ki)
    halves = torch.stack([quads & 0xF, quads >> 4], dim=4)  # (nc, kc, q, h, low/high, ni, ki)
    codes = halves.permute(0, 1, 2, 6, 3, 4, 5).reshape(nc, kc, -1, BLOCK_N)  # k = 4q + ki, n = 16h + 8·high + ni
    zeros = blocked.zeros.to(torch.int32)[:, _group_of_block(blocked)]  # (nc, kc, 32)
    return codes - zeros[:, :, None, :]


def stored_compensation(blocked: BlockedInt4) -> torch.Tensor:
    """int32 (N/32, K/block_k, 32): the little-endian sums at the end of each block, as stored."""
    return _little_endian_words(blocked.qweight[..., -COMPENSATION_BYTES:])


def _group_of_block(blocked: BlockedInt4) -> torch.Tensor:
    """Group index of every K block (the kernel's kci / block_per_group)."""
    k_blocks, groups = blocked.qweight.shape[1], blocked.scales.shape[1]
    return torch.arange(k_blocks) // (k_blocks // groups)


def blocked_linear(x: torch.Tensor, blocked: BlockedInt4, *, quantize_activations: bool = True) -> torch.Tensor:
    """x (M, K) · Wᵀ from the blocked INT4 tensors -> fp32 (M, N)."""
    weights = signed_block_weights(blocked)
    _, kc, block_k, _ = weights.shape
    if quantize_activations:
        codes, row_scales = quantize_rows(x)
        dots = torch.einsum("mck,nckj->mncj", codes.reshape(-1, kc, block_k), weights)  # exact int32
        dots = dots - ACTIVATION_ZERO_POINT * stored_compensation(blocked)
        partial = dots.to(torch.float32) * row_scales[:, None, None, None]
    else:
        partial = torch.einsum("mck,nckj->mncj", x.to(torch.float32).reshape(-1, kc, block_k),
                               weights.to(torch.float32))
    partial = partial * blocked.scales[:, _group_of_block(blocked)]
    return partial.sum(dim=2).flatten(1)


def vnni_int8_weights(packed: torch.Tensor) -> torch.Tensor:
    """int32 (N/32, K, 32) of the signed weights, k-major inside each 32-channel block: read as the
    kernel's VNNI loads do, byte q·128 + n·4 + ki of a block -> channel n at k = 4q + ki."""
    n, row_bytes = packed.shape
    k = row_bytes - COMPENSATION_BYTES_PER_ROW
    blocks = packed.reshape(n // BLOCK_N, BLOCK_N * row_bytes)[:, : BLOCK_N * k].to(torch.int32)
    return blocks.reshape(n // BLOCK_N, k // VNNI, BLOCK_N, VNNI).transpose(2, 3).reshape(n // BLOCK_N, k, BLOCK_N)


def stored_vnni_compensation(packed: torch.Tensor) -> torch.Tensor:
    """int32 (N/32, 32): the little-endian values after each block's weights, as stored."""
    n, row_bytes = packed.shape
    tails = packed.view(torch.uint8).reshape(n // BLOCK_N, BLOCK_N * row_bytes)[:, -COMPENSATION_BYTES:]
    return _little_endian_words(tails)


def _little_endian_words(stored: torch.Tensor) -> torch.Tensor:
    """uint8 bytes along the last dim -> the int32 words they store, 4 bytes a word (packing.pack_array)."""
    return torch.from_numpy(packing.pack_array(stored.numpy(), 8, axis=-1, container=np.int32))


def vnni_linear(x: torch.Tensor, tensors: VnniInt8, *, quantize_activations: bool = True) -> torch.Tensor:
    """x (M, K) · Wᵀ from the INT8 VNNI tensors -> fp32 (M, N)."""
    weights = vnni_int8_weights(tensors.weight)
    if quantize_activations:
        codes, row_scales = quantize_rows(x)
        dots = torch.einsum("mk,bkj->mbj", codes, weights)  # exact int32, u8·s8 as VNNI computes it
        dots = dots - stored_vnni_compensation(tensors.weight)
        out = dots.flatten(1).to(torch.float32) * row_scales[:, None]
    else:
        out = torch.einsum("mk,bkj->mbj", x.to(torch.float32), weights.to(torch.float32)).flatten(1)
    return out * tensors.scale[:, 0]


def kernel_view(tensors: Mapping[str, torch.Tensor], shape: MoELayerShape) -> dict[str, torch.Tensor]:
    """The blocked INT4 tensors of both GEMMs with the shapes the kernel reads them in. The kernel derives
    the group size ONCE per layer, from w13: g = H / (groups of w13_blocked_scales), block_k = min(g, 128),
    and reads w2 (K = I) with the same g and block_k, whatever w2's own tensors say. Raises ValueError
    naming the tensor when its bytes are not what that reading needs (the kernel would read past it or
    leave part of it unread)."""
    experts = tensors[blocked_suffixes("w13").scales].shape[0]
    groups = tensors[blocked_suffixes("w13").scales].shape[2]
    group_size = shape.hidden // groups
    block_k = min(group_size, MAX_BLOCK_K)
    viewed = dict(tensors)
    for prefix, out_features, in_features in (("w13", 2 * shape.intermediate, shape.hidden),
                                              ("w2", shape.hidden, shape.intermediate)):
        names = blocked_suffixes(prefix)
        if in_features % group_size or group_size % block_k or block_k % VNNI:
            raise ValueError(f"{names.qweight}: the kernel, with group size {group_size} and block_k {block_k} "
                             f"derived from {blocked_suffixes('w13').scales}, cannot tile K = {in_features}")
        blocks = (experts, out_features // BLOCK_N)
        wants = {names.qweight: (*blocks, in_features // block_k, block_k * BLOCK_N // 2 + COMPENSATION_BYTES),
                 names.scales: (*blocks, in_features // group_size, BLOCK_N),
                 names.zeros: (*blocks, in_features // group_size, BLOCK_N)}
        for name, want in wants.items():
            if tensors[name].numel() != math.prod(want):
                raise ValueError(f"{name}: the kernel, with group size {group_size} and block_k {block_k} derived "
                                 f"from {blocked_suffixes('w13').scales}, reads {list(want)}, but the tensor is "
                                 f"{list(tensors[name].shape)}")
            viewed[name] = tensors[name].reshape(want)
    return viewed


def _expert_gemm(tensors: Mapping[str, torch.Tensor], shape: MoELayerShape, prefix: str, expert: int,
                 x: torch.Tensor, quantize_activations: bool) -> torch.Tensor:
    """One expert's GEMM in the layout the cpu backend wrote for this scheme, fp32 (M, N)."""
    if shape.activation_bits == 8:
        vnni = VnniInt8(*(tensors[name][expert] for name in vnni_suffixes(prefix)))
        return vnni_linear(x, vnni, quantize_activations=quantize_activations)
    blocked = BlockedInt4(*(tensors[name][expert] for name in blocked_suffixes(prefix)))
    return blocked_linear(x, blocked, quantize_activations=quantize_activations)


def cpu_fused_moe(tensors: Mapping[str, torch.Tensor], shape: MoELayerShape, x: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                  quantize_activations: bool = True) -> torch.Tensor:
    """Σ_k w[t,k] · (silu(x·W13gateᵀ) * (x·W13upᵀ)) · W2ᵀ in x.dtype, from the cpu backend's stacked
    tensors keyed by suffix (dim 0: the experts topk_ids index); the INT8 kernel when
    `shape.activation_bits` is 8, else the INT4 one."""
    if shape.activation_bits != 8:
        tensors = kernel_view(tensors, shape)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for expert in topk_ids.unique().tolist():
        tokens, slots = (topk_ids == expert).nonzero(as_tuple=True)
        gate_up = _expert_gemm(tensors, shape, "w13", expert, x[tokens], quantize_activations)
        if shape.activation_bits != 8:  # the INT8 kernel fuses SiLU·up on the fp32 accumulators instead
            gate_up = gate_up.to(x.dtype).float()
        gate, up = gate_up[:, : shape.intermediate], gate_up[:, shape.intermediate:]
        activated = (F.silu(gate) * up).to(x.dtype)
        down = _expert_gemm(tensors, shape, "w2", expert, activated, quantize_activations)
        out.index_add_(0, tokens, (down * topk_weights[tokens, slots].float()[:, None]).to(x.dtype).float())
    return out.to(x.dtype)
