"""The x86 CPU blocked INT4 layout (vLLM `CPUExpertsInt4`, sgl-kernel `convert_weight_packed_scale_zp`;
vllm-layouts.md §5.1): what the W4A8 AVX-512/AMX MoE kernel reads, so nothing is re-blocked at start-up.

Per MoE layer, experts stacked, w13 = gate then up (N = 2I, K = H), w2 (N = H, K = I). Output channels
go in blocks of BLOCK_N = 32, K in blocks of block_k = min(g, 128) (g = K when channel-wise):
  {w13,w2}_blocked_qweight uint8 (E, N/32, K/block_k, block_k·16 + 128). In block (nc, kc), for k-quad q
      and half h: byte q·64 + (h·8 + ni)·4 + ki holds the code of channel 16h + ni in its low nibble and
      of channel 16h + 8 + ni in its high nibble, at k = 4q + ki (VNNI-4 along K). The last 128 bytes are
      32 little-endian int32 compensation sums Σ_{k in block} (code − zero), one per channel.
  {w13,w2}_blocked_scales  float32 (E, N/32, G, 32): fp16/bf16 -> fp32 is exact; decode casts back.
  {w13,w2}_blocked_zeros   int8 (E, N/32, G, 32): TRUE zero points, used as stored (CPUQuantAlgo.AWQ,
      no "+1"); symmetric layers store 8 explicitly.
Gate and up are blocked separately (the kernel reads gate block nb and up block nb + I/32 together),
so w13's first I/32 channel blocks are the gate's.

INT8 W8A8 (VNNI-4 rows of K + 4 bytes with 128·Σw compensation, §5.2) will be a second set of
per-projection functions next to `block_int4`/`unblock_int4`, chosen by `layer.bits`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

import torch

from moeconv import packing
from moeconv.backends.base import ExpertWeights, TensorSpec
from moeconv.canonical import MoELayerShape, QuantizedWeight
from moeconv.checkpoint.reader import TORCH_DTYPES

BLOCK_N = 32  # output channels per block: two 16-channel halves of one AVX-512 register each
MAX_BLOCK_K = 128
VNNI = 4  # consecutive k per 32-bit lane of a VNNI dot product
COMPENSATION_BYTES = BLOCK_N * 4  # one int32 per channel
SYMMETRIC_ZERO = 8


class BlockedInt4(NamedTuple):
    """One projection (or the stacked w13) in the blocked layout, without the expert dim."""

    qweight: torch.Tensor  # uint8 (N/32, K/block_k, block_k·16 + 128)
    scales: torch.Tensor  # float32 (N/32, G, 32)
    zeros: torch.Tensor  # int8 (N/32, G, 32)


def block_k_for(group_size: int) -> int:
    return min(group_size, MAX_BLOCK_K)


def blocked_suffixes(prefix: str) -> BlockedInt4:
    """The tensor names of one GEMM's blocked tensors, in BlockedInt4's order."""
    return BlockedInt4(*(f"{prefix}_blocked_{part}" for part in BlockedInt4._fields))


def _gemms(layer: MoELayerShape) -> tuple[tuple[str, int, int], ...]:
    """(prefix, out_features, in_features) of the two GEMMs."""
    return ("w13", 2 * layer.intermediate, layer.hidden), ("w2", layer.hidden, layer.intermediate)


class CpuBackend:
    name = "cpu"
    layout_version = 1

    def refusal(self, layer: MoELayerShape) -> str | None:
        if layer.intermediate % layer.tp:
            return f"intermediate size {layer.intermediate} does not split over tp={layer.tp}"
        if layer.tp > 1:  # every check below is about what one rank holds
            layer = replace(layer, intermediate=layer.intermediate_per_rank, tp=1)
        if layer.bits != 4:
            return (f"the x86 CPU MoE layout takes 4-bit weights, not {layer.bits}-bit "
                    f"(the INT8 W8A8 VNNI layout is not implemented yet)")
        if layer.intermediate % BLOCK_N:
            return (f"intermediate size {layer.intermediate} is not a multiple of the {BLOCK_N}-channel block "
                    f"(the gate and up halves of w13 are blocked separately)")
        if layer.hidden % BLOCK_N:
            return f"hidden size {layer.hidden} is not a multiple of the {BLOCK_N}-channel block (w2's outputs)"
        for prefix, _, in_features in _gemms(layer):
            g = layer.group_size_for(in_features)
            if in_features % g:
                return f"{prefix}: group size {g} does not divide K = {in_features}"
            block_k = block_k_for(g)
            if in_features % block_k or block_k % VNNI:
                return (f"{prefix}: K = {in_features} does not split into K blocks of min(group size, "
                        f"{MAX_BLOCK_K}) = {block_k} that are multiples of {VNNI}")
        return None

    def layer_tensors(self, layer: MoELayerShape) -> list[TensorSpec]:
        specs = []
        for prefix, out_features, in_features in _gemms(layer):
            g = layer.group_size_for(in_features)
            block_k = block_k_for(g)
            blocks = (layer.experts, out_features // BLOCK_N)
            names = blocked_suffixes(prefix)
            block_bytes = block_k * BLOCK_N // 2 + COMPENSATION_BYTES
            specs += [
                TensorSpec(names.qweight, (*blocks, in_features // block_k, block_bytes), "U8"),
                TensorSpec(names.scales, (*blocks, in_features // g, BLOCK_N), "F32"),
                TensorSpec(names.zeros, (*blocks, in_features // g, BLOCK_N), "I8"),
            ]
        return specs

    def encode_expert(self, expert: ExpertWeights, layer: MoELayerShape) -> dict[str, torch.Tensor]:
        slices = {}
        for prefix, projections in (("w13", (expert.gate, expert.up)), ("w2", (expert.down,))):
            blocked = [block_int4(weight) for weight in projections]
            for name, parts in zip(blocked_suffixes(prefix), zip(*blocked)):
                slices[name] = torch.cat(parts)
        return slices

    def decode_expert(self, slices: dict[str, torch.Tensor], layer: MoELayerShape) -> ExpertWeights:
        """Raises ValueError naming the tensor when the bytes hold something no canonical weight
        encodes to: wrong compensation sums, inexact fp32 scales, symmetric zeros other than 8."""
        scale_dtype = TORCH_DTYPES[layer.scale_dtype]
        decoded = []
        for prefix, _, in_features in _gemms(layer):
            names = blocked_suffixes(prefix)
            blocked = BlockedInt4(*(slices[name] for name in names))
            projections = _gate_and_up(blocked, layer.intermediate // BLOCK_N) if prefix == "w13" else [blocked]
            decoded += [unblock_int4(projection, names, layer.group_size_for(in_features), scale_dtype,
                                     layer.symmetric) for projection in projections]
        return ExpertWeights(*decoded)

    def quantization_config(self, layer: MoELayerShape) -> dict[str, Any]:
        return {
            "bits": layer.bits,
            "group_size": layer.group_size,
            "has_zp": not layer.symmetric,
            "layout": "x86_int4_blocked",
            "block_n": BLOCK_N,
            "block_k": {prefix: block_k_for(layer.group_size_for(k)) for prefix, _, k in _gemms(layer)},
            "zero_point_convention": "awq",  # TRUE zero points used as stored, no +1; symmetric stores 8
            "compute": "w4a8",  # activations quantized per row to uint8, zero point 128
        }


def block_int4(weight: QuantizedWeight) -> BlockedInt4:
    """Canonical (N, K) 4-bit weight -> blocked tensors, with explicit shifts only."""
    n, k = weight.codes.shape
    block_k = block_k_for(weight.group_size)
    nc, kc = n // BLOCK_N, k // block_k
    zeros = weight.effective_zeros()
    # n = 32·nc + 16·h + 8·high + ni, k = block_k·kc + 4·q + ki; bytes go in (nc, kc, q, h, ni, ki) order
    # with `high` selecting the nibble.
    codes = weight.codes.view(nc, 2, 2, 8, kc, block_k // VNNI, VNNI).permute(0, 4, 5, 1, 3, 6, 2)
    nibbles = packing.pack(codes, 4, dim=-1, container=torch.uint8).reshape(nc, kc, -1)
    compensation = _compensation(weight.codes, zeros, weight.group_size, block_k)  # (N/32, K/block_k, 32)
    compensation_bytes = packing.unpack(compensation, 8, dim=-1)  # int32 -> 4 bytes each, little-endian
    return BlockedInt4(
        qweight=torch.cat([nibbles, compensation_bytes], dim=-1),
        scales=_channel_blocks(weight.scales.to(torch.float32)),
        zeros=_channel_blocks(zeros.to(torch.int8)),
    )


def unblock_int4(blocked: BlockedInt4, names: BlockedInt4, group_size: int, scale_dtype: torch.dtype,
                 symmetric: bool) -> QuantizedWeight:
    """Inverse of `block_int4`; checks every byte that the canonical form does not carry."""
    nc, kc, block_bytes = blocked.qweight.shape
    block_k = (block_bytes - COMPENSATION_BYTES) * 2 // BLOCK_N
    nibbles = blocked.qweight[..., : block_bytes - COMPENSATION_BYTES]
    # (nc, kc, q, h, ni, ki, high) -> (nc, h, high, ni, kc, q, ki) = (N, K)
    codes = packing.unpack(nibbles.reshape(nc, kc, block_k // VNNI, 2, 8, VNNI, 1), 4, dim=-1)
    codes = codes.permute(0, 3, 6, 4, 1, 2, 5).reshape(nc * BLOCK_N, kc * block_k)
    zeros = _unblock_channels(blocked.zeros)
    if symmetric and bool((zeros != SYMMETRIC_ZERO).any()):
        raise ValueError(f"{names.zeros}: a symmetric layer stores zero point {SYMMETRIC_ZERO} everywhere, "
                         f"found {sorted(set(zeros[zeros != SYMMETRIC_ZERO].tolist()))[:4]}")
    if bool(((zeros < 0) | (zeros > 15)).any()):
        raise ValueError(f"{names.zeros}: 4-bit zero points must be in [0, 15]")
    zeros = zeros.to(torch.uint8)
    stored = packing.pack(blocked.qweight[..., block_bytes - COMPENSATION_BYTES:], 8, dim=-1, container=torch.int32)
    wrong = stored != _compensation(codes, zeros, group_size, block_k)
    if bool(wrong.any()):
        first = wrong.nonzero()[0].tolist()
        raise ValueError(f"{names.qweight}: {int(wrong.sum())} compensation sum(s) disagree with the codes "
                         f"(first: channel block {first[0]}, K block {first[1]}, channel {first[2]})")
    scales32 = _unblock_channels(blocked.scales)
    scales = scales32.to(scale_dtype)
    if not torch.equal(scales.to(torch.float32).view(torch.int32), scales32.view(torch.int32)):
        raise ValueError(f"{names.scales}: scales that are not exactly {scale_dtype} values")
    return QuantizedWeight(codes=codes.contiguous(), zeros=None if symmetric else zeros, scales=scales,
                           bits=4, group_size=group_size)


def _compensation(codes: torch.Tensor, zeros: torch.Tensor, group_size: int, block_k: int) -> torch.Tensor:
    """int32 (N/32, K/block_k, 32): Σ over each K block of (code − zero) = Σ code − block_k · zero,
    per channel (a K block lies inside one group)."""
    n, k = codes.shape
    code_sums = codes.view(n, k // block_k, block_k).sum(dim=-1, dtype=torch.int32)
    block_zeros = zeros.to(torch.int32).repeat_interleave(group_size // block_k, dim=1)
    sums = code_sums - block_k * block_zeros
    return sums.view(n // BLOCK_N, BLOCK_N, -1).transpose(1, 2).contiguous()


def _channel_blocks(per_channel: torch.Tensor) -> torch.Tensor:
    """(N, G) -> (N/32, G, 32)."""
    n, groups = per_channel.shape
    return per_channel.view(n // BLOCK_N, BLOCK_N, groups).transpose(1, 2).contiguous()


def _unblock_channels(blocked: torch.Tensor) -> torch.Tensor:
    """(N/32, G, 32) -> (N, G)."""
    nc, groups, _ = blocked.shape
    return blocked.transpose(1, 2).reshape(nc * BLOCK_N, groups)


def _gate_and_up(w13: BlockedInt4, gate_blocks: int) -> list[BlockedInt4]:
    """The gate's channel blocks come first, then the up's."""
    return [BlockedInt4(*parts) for parts in zip(*(tensor.split(gate_blocks) for tensor in w13))]
