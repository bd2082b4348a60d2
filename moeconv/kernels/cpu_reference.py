"""A torch reference of the x86 CPU INT4 MoE kernel (sgl-kernel `fused_experts_int4_w4a8`, used by vLLM
`CPUExpertsInt4`) that reads the blocked layout of moeconv.backends.cpu the way the kernel does: nibbles
by their byte position in each (32-channel, block_k) block, the STORED compensation sums, the blocked
scales and zero points. It never goes through the backend's decoder, so verify's numerics check covers
the bytes the kernel would read.

W4A8, as the kernel computes: each activation row is quantized to uint8 with zero point 128 and scale
max|x|/127; per block the integer dot product Σ q·(c − z) minus 128·compensation gives Σ (q − 128)·(c − z);
that times the row scale and the channel's group scale is accumulated over K blocks in fp32.
Intermediates are rounded to the activation dtype where the kernel stores them (gate/up output,
SiLU·up, the weighted down output). With `quantize_activations=False` the same reads run with float
activations (W4A16), which isolates the error that activation quantization adds.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F

from moeconv import packing
from moeconv.backends.cpu import BLOCK_N, COMPENSATION_BYTES, VNNI, BlockedInt4, blocked_suffixes
from moeconv.canonical import MoELayerShape

ACTIVATION_ZERO_POINT = 128
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
    return packing.pack(blocked.qweight[..., -COMPENSATION_BYTES:], 8, dim=-1, container=torch.int32)


def _group_of_block(blocked: BlockedInt4) -> torch.Tensor:
    """Group index of every K block (the kernel's kci / block_per_group)."""
    k_blocks, groups = blocked.qweight.shape[1], blocked.scales.shape[1]
    return torch.arange(k_blocks) // (k_blocks // groups)


def blocked_linear(x: torch.Tensor, blocked: BlockedInt4, *, quantize_activations: bool = True) -> torch.Tensor:
    """x (M, K) · Wᵀ from the blocked tensors -> fp32 (M, N)."""
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


def cpu_fused_moe(tensors: Mapping[str, torch.Tensor], shape: MoELayerShape, x: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                  quantize_activations: bool = True) -> torch.Tensor:
    """Σ_k w[t,k] · (silu(x·W13gateᵀ) * (x·W13upᵀ)) · W2ᵀ in x.dtype, from the cpu backend's stacked
    tensors keyed by suffix (dim 0: the experts topk_ids index)."""
    stacks = {prefix: BlockedInt4(*(tensors[name] for name in blocked_suffixes(prefix))) for prefix in ("w13", "w2")}
    out = torch.zeros(x.shape, dtype=torch.float32)
    for expert in topk_ids.unique().tolist():
        tokens, slots = (topk_ids == expert).nonzero(as_tuple=True)
        w13, w2 = (BlockedInt4(*(tensor[expert] for tensor in stacks[prefix])) for prefix in ("w13", "w2"))
        gate_up = blocked_linear(x[tokens], w13, quantize_activations=quantize_activations).to(x.dtype).float()
        gate, up = gate_up[:, : shape.intermediate], gate_up[:, shape.intermediate:]
        activated = (F.silu(gate) * up).to(x.dtype)
        down = blocked_linear(activated, w2, quantize_activations=quantize_activations)
        out.index_add_(0, tokens, (down * topk_weights[tokens, slots].float()[:, None]).to(x.dtype).float())
    return out.to(x.dtype)
