"""The x86 CPU blocked INT4 layout (vLLM `CPUExpertsInt4`, sgl-kernel `convert_weight_packed_scale_zp`;
vLLM csrc/cpu/sgl-kernels/gemm_int4.cpp; docs/FORMAT.md): what the W4A8 AVX-512/AMX MoE kernel reads, so nothing is re-blocked at start-up.

Per MoE layer, experts stacked, w13 = gate then up (N = 2I, K = H), w2 (N = H, K = I). Output channels
go in blocks of BLOCK_N = 32, K in blocks of block_k = min(g, 128).

ONE group size g per layer, shared by both GEMMs: the kernel derives it once, from w13, as
H / (w13_blocked_scales groups), and block_k = min(g, 128) from it, and reads w2 with the same g and
block_k. So the layer's g is the largest divisor of both GEMMs' source group sizes (channel-wise: H
and I) that meets the block rules (g <= 128 and a multiple of 4, or a multiple of 128), and the
source's scales and zero points are repeated to it, losslessly (layout version 2; version 1 wrote a
group size per GEMM, which the kernel misreads whenever the two differ). A layer where no such g
exists is refused at plan time.
  {w13,w2}_blocked_qweight uint8 (E, N/32, K/block_k, block_k·16 + 128). In block (nc, kc), for k-quad q
      and half h: byte q·64 + (h·8 + ni)·4 + ki holds the code of channel 16h + ni in its low nibble and
      of channel 16h + 8 + ni in its high nibble, at k = 4q + ki (VNNI-4 along K). The last 128 bytes are
      32 little-endian int32 compensation sums Σ_{k in block} (code − zero), one per channel.
  {w13,w2}_blocked_scales  float32 (E, N/32, G, 32): fp16/bf16 -> fp32 is exact; decode casts back.
  {w13,w2}_blocked_zeros   int8 (E, N/32, G, 32): TRUE zero points, used as stored (CPUQuantAlgo.AWQ,
      no "+1"); symmetric layers store 8 explicitly.
Gate and up are blocked separately (the kernel reads gate block nb and up block nb + I/32 together),
so w13's first I/32 channel blocks are the gate's.

W8A8 schemes (activation_bits 8, symmetric int8 per channel) take the INT8 VNNI layout instead (vLLM
`CPUExpertsInt8`, sgl-kernel `convert_weight_packed` / `pack_vnni<int8_t>` / `s8s8_compensation`; vLLM csrc/cpu/sgl-kernels/gemm.cpp):
  {w13,w2}_vnni_weight  int8 (E, N, K + 4). Each block of 32 output channels (32·(K + 4) bytes) holds
      byte q·128 + n·4 + ki = w[32·nb + n, 4q + ki] (the signed weight, code − 128; [K/4][32][4], VNNI-4),
      then 32 little-endian int32 compensation values 128·Σ_k w[n, k]: the kernel multiplies uint8
      activations (zero point 128) with int8 weights and subtracts these to get the signed dot product.
  {w13,w2}_weight_scale float32 (E, N, 1): per-channel scale, exact from fp16/bf16; decode casts back.
w13 is blocked over its 2I rows as one tensor; since I % 32 == 0 no block straddles gate and up, and the
kernel reads gate block nb with up block nb + I/32.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from moeconv import packing
from moeconv.backends.base import FUSED_GEMMS, BackendDefaults, ExpertWeights, Numerics
from moeconv.spec import TORCH_NAMES, TensorSpec
from moeconv.canonical import LinearShape, MoELayerShape, QuantizedWeight, coarsen, is_channelwise, regroup

if TYPE_CHECKING:
    from moeconv.packed import PackedWeight

BLOCK_N = 32  # output channels per block: two 16-channel halves of one AVX-512 register each
MAX_BLOCK_K = 128
VNNI = 4  # consecutive k per 32-bit lane of a VNNI dot product
COMPENSATION_BYTES = BLOCK_N * 4  # one int32 per channel
COMPENSATION_BYTES_PER_ROW = 4  # INT8: the int32 of each channel widens its row from K to K + 4 bytes
ACTIVATION_ZERO_POINT = 128  # both kernels feed uint8 activations q + 128 to the u8·s8 VNNI dot product
SYMMETRIC_ZERO = 8


class BlockedInt4(NamedTuple):
    """One projection (or the stacked w13) in the blocked layout, without the expert dim."""

    qweight: np.ndarray  # uint8 (N/32, K/block_k, block_k·16 + 128)
    scales: np.ndarray  # float32 (N/32, G, 32)
    zeros: np.ndarray  # int8 (N/32, G, 32)


class VnniInt8(NamedTuple):
    """The INT8 W8A8 tensors of one GEMM, without the expert dim."""

    weight: np.ndarray  # int8 (N, K + 4)
    scale: np.ndarray  # float32 (N, 1)


def vnni_suffixes(prefix: str) -> VnniInt8:
    return VnniInt8(f"{prefix}_vnni_weight", f"{prefix}_weight_scale")


def block_k_for(group_size: int) -> int:
    return min(group_size, MAX_BLOCK_K)


def _fits_blocks(group_size: int) -> bool:
    """A K block of min(g, 128) lies inside one group and splits into VNNI quads."""
    return group_size % MAX_BLOCK_K == 0 if group_size > MAX_BLOCK_K else group_size % VNNI == 0


def layer_group_size(layer: MoELayerShape) -> int | None:
    """The one group size both GEMMs of the layer are written with (see the module doc), or None."""
    common = math.gcd(*(layer.group_size_for(k) for _, _, k in _gemms(layer)))
    return next((g for g in range(common, 0, -1) if common % g == 0 and _fits_blocks(g)), None)


def blocked_suffixes(prefix: str) -> BlockedInt4:
    """The tensor names of one GEMM's blocked tensors, in BlockedInt4's order."""
    return BlockedInt4(*(f"{prefix}_blocked_{part}" for part in BlockedInt4._fields))


def _gemms(layer: MoELayerShape) -> tuple[tuple[str, int, int], ...]:
    """(prefix, out_features, in_features) of the two GEMMs."""
    return ("w13", 2 * layer.intermediate, layer.hidden), ("w2", layer.hidden, layer.intermediate)


class CpuBackend(BackendDefaults):
    """Dispatches each layer to the layout of the x86 kernel that computes its scheme."""

    name = "cpu"
    layout_version = 2  # 2: one group size per layer (the kernel derives it from w13)
    numerics = Numerics("cpu")

    def refusal(self, layer: MoELayerShape) -> str | None:
        if layer.float_scheme is not None:
            return (f"the x86 CPU kernels' layouts (blocked INT4, VNNI INT8) hold integer codes; {layer.float_scheme.name} "
                    f"E2M1 codes are no integer-affine code (--backend triton or compressed-tensors writes them)")
        if layer.intermediate % layer.tp:
            return f"intermediate size {layer.intermediate} does not split over tp={layer.tp}"
        if layer.tp > 1:  # every check below is about what one rank holds
            layer = replace(layer, intermediate=layer.intermediate_per_rank, tp=1)
        return _layout(layer).refusal(layer)

    def layer_tensors(self, layer: MoELayerShape) -> list[TensorSpec]:
        return _layout(layer).layer_tensors(layer)

    def encode_expert(self, expert: ExpertWeights, layer: MoELayerShape) -> dict[str, np.ndarray]:
        return _layout(layer).encode_expert(expert, layer)

    def takes_packed(self, layer: MoELayerShape | LinearShape) -> bool:
        """The INT4 blocked layout, where a K block is whole words (the W8A8 layout's bytes are not packed)."""
        if not isinstance(layer, MoELayerShape) or _layout(layer) is not INT4_BLOCKED or layer.bits != 4:
            return False
        group_size = layer_group_size(layer)
        return group_size is not None and block_k_for(group_size) % 8 == 0

    def from_packed(self, expert: dict[str, PackedWeight], layer: MoELayerShape) -> dict[str, np.ndarray]:
        group_size, slices = layer_group_size(layer), {}
        blocked = {projection: _packed_blocked(weight, group_size) for projection, weight in expert.items()}
        for prefix, projections in FUSED_GEMMS.items():
            for name, parts in zip(blocked_suffixes(prefix), zip(*(blocked[p] for p in projections))):
                slices[name] = np.concatenate(parts)
        return slices

    def decode_expert(self, slices: dict[str, np.ndarray], layer: MoELayerShape) -> ExpertWeights:
        """Raises ValueError naming the tensor when the bytes hold something no canonical weight
        encodes to: wrong compensation sums, inexact fp32 scales, symmetric zeros other than 8."""
        return _layout(layer).decode_expert(slices, layer)

    def quantization_config(self, layer: MoELayerShape) -> dict[str, Any]:
        return _layout(layer).quantization_config(layer)


class Int4BlockedLayout:
    """W4A8 `CPUExpertsInt4`."""

    def refusal(self, layer: MoELayerShape) -> str | None:
        if layer.bits != 4:
            return (f"the x86 CPU MoE layout takes 4-bit weights, not {layer.bits}-bit "
                    f"(8-bit weights only as a W8A8 scheme with int8 activations)")
        if layer.intermediate % BLOCK_N:
            return (f"intermediate size {layer.intermediate} is not a multiple of the {BLOCK_N}-channel block "
                    f"(the gate and up halves of w13 are blocked separately)")
        if layer.hidden % BLOCK_N:
            return f"hidden size {layer.hidden} is not a multiple of the {BLOCK_N}-channel block (w2's outputs)"
        for prefix, _, in_features in _gemms(layer):
            g = layer.group_size_for(in_features)
            if in_features % g:
                return f"{prefix}: group size {g} does not divide K = {in_features}"
        if layer_group_size(layer) is None:
            sizes = " and ".join(f"{layer.group_size_for(k)} ({prefix})" for prefix, _, k in _gemms(layer))
            return (f"the kernel reads one group size per layer, and no common divisor of the group sizes "
                    f"{sizes} is <= {MAX_BLOCK_K} and a multiple of {VNNI}, or a multiple of {MAX_BLOCK_K}")
        return None

    def layer_tensors(self, layer: MoELayerShape) -> list[TensorSpec]:
        specs = []
        g = layer_group_size(layer)
        block_k = block_k_for(g)
        for prefix, out_features, in_features in _gemms(layer):
            blocks = (layer.experts, out_features // BLOCK_N)
            names = blocked_suffixes(prefix)
            block_bytes = block_k * BLOCK_N // 2 + COMPENSATION_BYTES
            specs += [
                TensorSpec(names.qweight, (*blocks, in_features // block_k, block_bytes), "U8",
                           derives_from=FUSED_GEMMS[prefix]),
                TensorSpec(names.scales, (*blocks, in_features // g, BLOCK_N), "F32", derives_from=FUSED_GEMMS[prefix]),
                TensorSpec(names.zeros, (*blocks, in_features // g, BLOCK_N), "I8", derives_from=FUSED_GEMMS[prefix]),
            ]
        return specs

    def encode_expert(self, expert: ExpertWeights, layer: MoELayerShape) -> dict[str, np.ndarray]:
        slices, g = {}, layer_group_size(layer)
        for prefix, projections in _projections(expert):
            blocked = [block_int4(regroup(weight, weight.group_size // g)) for weight in projections]
            for name, parts in zip(blocked_suffixes(prefix), zip(*blocked)):
                slices[name] = np.concatenate(parts)
        return slices

    def decode_expert(self, slices: dict[str, np.ndarray], layer: MoELayerShape) -> ExpertWeights:
        decoded = []
        for prefix, _, in_features in _gemms(layer):
            names = blocked_suffixes(prefix)
            blocked = BlockedInt4(*(slices[name] for name in names))
            projections = _gate_and_up(blocked, layer.intermediate // BLOCK_N) if prefix == "w13" else [blocked]
            source_g, g = layer.group_size_for(in_features), layer_group_size(layer)
            decoded += [coarsen(unblock_int4(projection, names, g, TORCH_NAMES[layer.scale_dtype], layer.symmetric),
                                source_g // g, names.scales) for projection in projections]
        return ExpertWeights(*decoded)

    def quantization_config(self, layer: MoELayerShape) -> dict[str, Any]:
        return {
            "bits": layer.bits,
            "group_size": layer_group_size(layer),  # both GEMMs; the kernel derives it from w13
            "source_group_size": layer.group_size,
            "has_zp": not layer.symmetric,
            "layout": "x86_int4_blocked",
            "block_n": BLOCK_N,
            "block_k": block_k_for(layer_group_size(layer)),
            "zero_point_convention": "awq",  # TRUE zero points used as stored, no +1; symmetric stores 8
            "compute": "w4a8",  # activations quantized per row to uint8, zero point 128
        }


class Int8VnniLayout:
    """W8A8 `CPUExpertsInt8`."""

    def refusal(self, layer: MoELayerShape) -> str | None:
        if layer.bits != 8 or not layer.symmetric or not is_channelwise(layer.group_size):
            return "the x86 CPU W8A8 kernel takes symmetric 8-bit weights with one scale per channel"
        for what, size in (("hidden size", layer.hidden), ("intermediate size", layer.intermediate)):
            if size % BLOCK_N:
                return (f"{what} {size} is not a multiple of {BLOCK_N}: the INT8 VNNI layout packs full "
                        f"{BLOCK_N}-channel blocks and K in multiples of {BLOCK_N} (it is N of one GEMM and K "
                        f"of the other)")
        return None

    def layer_tensors(self, layer: MoELayerShape) -> list[TensorSpec]:
        specs = []
        for prefix, out_features, in_features in _gemms(layer):
            names = vnni_suffixes(prefix)
            row_bytes = in_features + COMPENSATION_BYTES_PER_ROW
            specs += [TensorSpec(names.weight, (layer.experts, out_features, row_bytes), "I8",
                                 derives_from=FUSED_GEMMS[prefix]),
                      TensorSpec(names.scale, (layer.experts, out_features, 1), "F32", derives_from=FUSED_GEMMS[prefix])]
        return specs

    def encode_expert(self, expert: ExpertWeights, layer: MoELayerShape) -> dict[str, np.ndarray]:
        slices = {}
        for prefix, projections in _projections(expert):
            names = vnni_suffixes(prefix)
            signed = np.concatenate([packing.offset_codes_to_int8(w.codes) for w in projections])
            slices[names.weight] = pack_int8_vnni(signed)
            slices[names.scale] = packing.as_float32(np.concatenate([w.scales for w in projections]))
        return slices

    def decode_expert(self, slices: dict[str, np.ndarray], layer: MoELayerShape) -> ExpertWeights:
        decoded = []
        for prefix, _, in_features in _gemms(layer):
            names = vnni_suffixes(prefix)
            codes = packing.int8_array_to_offset_codes(unpack_int8_vnni(slices[names.weight], names.weight))
            scales = _exact_scales(slices[names.scale], TORCH_NAMES[layer.scale_dtype], names.scale)
            rows = layer.intermediate  # w13: gate rows, then up rows
            parts = (slice(0, rows), slice(rows, None)) if prefix == "w13" else (slice(None),)
            decoded += [QuantizedWeight(codes=np.ascontiguousarray(codes[part]), zeros=None,
                                        scales=np.ascontiguousarray(scales[part]), bits=8, group_size=in_features)
                        for part in parts]
        return ExpertWeights(*decoded)

    def quantization_config(self, layer: MoELayerShape) -> dict[str, Any]:
        return {
            "bits": 8,
            "group_size": -1,
            "has_zp": False,
            "layout": "x86_int8_vnni",
            "block_n": BLOCK_N,
            "compensation": "int32 128·Σ_k w[n, k] after each 32-channel block",
            "weight_scale_dtype": "float32",
            "compute": "w8a8",  # activations quantized per row to uint8, zero point 128
        }


INT4_BLOCKED, INT8_VNNI = Int4BlockedLayout(), Int8VnniLayout()


def _layout(layer: MoELayerShape) -> Int4BlockedLayout | Int8VnniLayout:
    """W8A8 schemes run the INT8 kernel; everything else the W4A8 one (which refuses non-4-bit)."""
    return INT8_VNNI if layer.activation_bits == 8 else INT4_BLOCKED


def _spread_nibbles(words: np.ndarray) -> np.ndarray:
    """uint32 words -> uint64 words with nibble t of each at bits [8t, 8t + 4) (the others zero)."""
    spread = words.astype(np.uint64)
    for shift, mask in ((16, 0x0000FFFF0000FFFF), (8, 0x00FF00FF00FF00FF), (4, 0x0F0F0F0F0F0F0F0F)):
        spread = (spread | (spread << np.uint64(shift))) & np.uint64(mask)
    return spread


def _nibble_sums(words: np.ndarray) -> np.ndarray:
    """The sum of the eight 4-bit values of each uint32 word (at most 120)."""
    pairs = (words & np.uint32(0x0F0F0F0F)) + ((words >> np.uint32(4)) & np.uint32(0x0F0F0F0F))  # 4 bytes <= 30
    return (pairs * np.uint32(0x01010101)) >> np.uint32(24)


def _packed_blocked(weight: PackedWeight, group_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`block_int4` of a 4-bit linear in the packed form, regrouped to the layer's `group_size`: (qweight, fp32
    scales, int8 zeros). Channel n (low nibble) and n + 8 (high nibble) of each 16-channel half share a byte
    for each k: their words' nibbles are spread to one byte each and or-ed, which gives, per channel pair and
    quad of k, the 4 bytes (ki) the layout keeps together; those 32-bit units are then moved to the layout's
    (nc, kc, q, h, ni) order, and the compensation sums are taken from the words."""
    n, k = weight.out_features, weight.in_features
    block_k, repeat = block_k_for(group_size), weight.group_size // group_size
    nc, kc = n // BLOCK_N, k // block_k
    zeros = weight.zero_points()
    zeros = np.full(weight.scales.shape, SYMMETRIC_ZERO, dtype=np.uint8) if zeros is None else zeros
    zeros, scales = np.repeat(zeros, repeat, axis=1), np.repeat(weight.scales, repeat, axis=1)
    words = weight.words.view(np.uint32).reshape(nc, 2, 2, 8, -1)  # (nc, h, high, ni, K/8)
    pairs = _spread_nibbles(words[:, :, 0]) | (_spread_nibbles(words[:, :, 1]) << np.uint64(4))
    quads = np.ascontiguousarray(pairs, dtype="<u8").view(np.uint32).reshape(nc, 2, 8, kc, block_k // VNNI)
    nibbles = np.ascontiguousarray(quads.transpose(0, 3, 4, 1, 2)).view(np.uint8).reshape(nc, kc, -1)
    sums = (_nibble_sums(words.reshape(n, kc, block_k // 8)).sum(axis=-1, dtype=np.int32)
            - block_k * np.repeat(zeros.astype(np.int32), group_size // block_k, axis=1))
    compensation = np.ascontiguousarray(sums.reshape(nc, BLOCK_N, kc).transpose(0, 2, 1), dtype="<i4")
    blocks = lambda per_channel: np.ascontiguousarray(  # noqa: E731 (N, G) -> (N/32, G, 32)
        per_channel.reshape(nc, BLOCK_N, -1).transpose(0, 2, 1))
    return (np.concatenate([nibbles, compensation.view(np.uint8)], axis=-1), blocks(packing.as_float32(scales)),
            blocks(zeros.view(np.int8)))


def _projections(expert: ExpertWeights) -> tuple[tuple[str, tuple[QuantizedWeight, ...]], ...]:
    return ("w13", (expert.gate, expert.up)), ("w2", (expert.down,))


def block_int4(weight: QuantizedWeight) -> BlockedInt4:
    """Canonical (N, K) 4-bit weight -> blocked tensors, with explicit shifts only."""
    n, k = weight.codes.shape
    block_k = block_k_for(weight.group_size)
    nc, kc = n // BLOCK_N, k // block_k
    zeros = weight.effective_zeros()
    # n = 32·nc + 16·h + 8·high + ni, k = block_k·kc + 4·q + ki; bytes go in (nc, kc, q, h, ni, ki) order
    # with `high` selecting the nibble.
    codes = weight.codes.reshape(nc, 2, 2, 8, kc, block_k // VNNI, VNNI).transpose(0, 4, 5, 1, 3, 6, 2)
    nibbles = packing.pack_array(codes, 4, axis=-1, container=np.uint8).reshape(nc, kc, -1)
    compensation = _compensation(weight.codes, zeros, weight.group_size, block_k)  # (N/32, K/block_k, 32)
    compensation_bytes = packing.unpack_array(compensation, 8, axis=-1)  # int32 -> 4 bytes each, little-endian
    return BlockedInt4(
        qweight=np.concatenate([nibbles, compensation_bytes], axis=-1),
        scales=_channel_blocks(packing.as_float32(weight.scales)),
        zeros=_channel_blocks(zeros.astype(np.int8)),
    )


def unblock_int4(blocked: BlockedInt4, names: BlockedInt4, group_size: int, scale_dtype: str,
                 symmetric: bool) -> QuantizedWeight:
    """Inverse of `block_int4`; checks every byte that the canonical form does not carry. `scale_dtype`: the
    source's, as torch names it."""
    nc, kc, block_bytes = blocked.qweight.shape
    block_k = (block_bytes - COMPENSATION_BYTES) * 2 // BLOCK_N
    # A block's bytes go (q, h, ni, ki): the 4 bytes of k = 4q..4q+3 move together, as one 32-bit word, to
    # (nc, h, ni, kc, q); then each byte's low nibble is channel 16h + ni, its high nibble 16h + 8 + ni.
    words = _quads(blocked.qweight)[..., : block_k * BLOCK_N // 8].reshape(nc, kc, block_k // VNNI, 2, 8)
    rows = np.ascontiguousarray(words.transpose(0, 3, 4, 1, 2)).view(np.uint8)  # (nc, h, ni, K) bytes
    codes = packing.unpack_array(rows.reshape(nc, 2, 1, 8, kc * block_k), 4, axis=2).reshape(
        nc * BLOCK_N, kc * block_k)
    zeros = _unblock_channels(blocked.zeros)
    if symmetric and bool((zeros != SYMMETRIC_ZERO).any()):
        raise ValueError(f"{names.zeros}: a symmetric layer stores zero point {SYMMETRIC_ZERO} everywhere, "
                         f"found {sorted(set(zeros[zeros != SYMMETRIC_ZERO].tolist()))[:4]}")
    if bool(((zeros < 0) | (zeros > 15)).any()):
        raise ValueError(f"{names.zeros}: 4-bit zero points must be in [0, 15]")
    zeros = zeros.astype(np.uint8)
    stored = _int32_words(blocked.qweight[..., block_bytes - COMPENSATION_BYTES:])
    wrong = stored != _compensation(codes, zeros, group_size, block_k)
    if bool(wrong.any()):
        first = np.argwhere(wrong)[0].tolist()
        raise ValueError(f"{names.qweight}: {int(wrong.sum())} compensation sum(s) disagree with the codes "
                         f"(first: channel block {first[0]}, K block {first[1]}, channel {first[2]})")
    scales = _exact_scales(_unblock_channels(blocked.scales), scale_dtype, names.scales)
    return QuantizedWeight(codes=codes, zeros=None if symmetric else zeros, scales=scales, bits=4,
                           group_size=group_size)


def pack_int8_vnni(weight: np.ndarray) -> np.ndarray:
    """Signed int8 (N, K) -> int8 (N, K + 4): per 32-channel block, byte q·128 + n·4 + ki = w[n, 4q + ki],
    then the block's 32 compensation values as little-endian int32 (explicit shifts)."""
    n, k = weight.shape
    quads = weight.view(np.uint8).reshape(n // BLOCK_N, BLOCK_N, k // VNNI, VNNI).transpose(0, 2, 1, 3)  # (nb, q, n, ki)
    compensation = packing.unpack_array(int8_compensation(weight).reshape(n // BLOCK_N, BLOCK_N), 8, axis=-1)
    blocks = np.concatenate([quads.reshape(n // BLOCK_N, -1), compensation], axis=-1)
    return blocks.view(np.int8).reshape(n, k + COMPENSATION_BYTES_PER_ROW)


def unpack_int8_vnni(packed: np.ndarray, name: str) -> np.ndarray:
    """Inverse of `pack_int8_vnni`; raises ValueError naming the tensor when a
    compensation value is not 128·Σ_k w of its channel."""
    n, row_bytes = packed.shape
    k = row_bytes - COMPENSATION_BYTES_PER_ROW
    blocks = np.ascontiguousarray(packed).view(np.uint8).reshape(n // BLOCK_N, BLOCK_N * row_bytes)
    quads = _quads(blocks)[:, : BLOCK_N * k // VNNI].reshape(n // BLOCK_N, k // VNNI, BLOCK_N)  # (nb, q, n)
    weight = np.ascontiguousarray(quads.transpose(0, 2, 1)).view(np.int8).reshape(n, k)
    wrong = _int32_words(blocks[:, BLOCK_N * k:]).reshape(-1) != int8_compensation(weight)
    if bool(wrong.any()):
        raise ValueError(f"{name}: {int(wrong.sum())} compensation value(s) disagree with 128·Σ_k w "
                         f"(first: channel {int(np.flatnonzero(wrong)[0])})")
    return weight


def int8_compensation(weight: np.ndarray) -> np.ndarray:
    """int32 (N,): 128·Σ_k w[n, k], what the u8·s8 dot product of q + 128 with w has in excess of q·w
    (int32 arithmetic, wrapping as the kernel's accumulators do)."""
    return np.int32(ACTIVATION_ZERO_POINT) * weight.sum(axis=1, dtype=np.int32)


def _quads(stored: np.ndarray) -> np.ndarray:
    """Bytes as 32-bit words of 4 consecutive bytes along the last axis, to be moved, never read as numbers
    (so byte order does not matter): a transpose moves 4 bytes at a time."""
    return np.ascontiguousarray(stored).view(np.uint32)


def _int32_words(stored: np.ndarray) -> np.ndarray:
    """Little-endian int32 words from bytes along the last axis (4 bytes a word)."""
    return np.ascontiguousarray(stored).view("<i4").astype(np.int32, copy=False)


def _exact_scales(scales32: np.ndarray, scale_dtype: str, name: str) -> np.ndarray:
    """The fp32 scales back in the source dtype's stored form; refuses any that dtype cannot hold exactly."""
    scales = packing.float32_cast(scales32, scale_dtype)
    if not np.array_equal(packing.as_float32(scales).view(np.int32), scales32.view(np.int32)):
        raise ValueError(f"{name}: scales that are not exactly {scale_dtype} values")
    return scales


def _compensation(codes: np.ndarray, zeros: np.ndarray, group_size: int, block_k: int) -> np.ndarray:
    """int32 (N/32, K/block_k, 32): Σ over each K block of (code − zero) = Σ code − block_k · zero,
    per channel (a K block lies inside one group)."""
    n, k = codes.shape
    code_sums = codes.reshape(n, k // block_k, block_k).sum(axis=-1, dtype=np.int32)
    block_zeros = np.repeat(zeros.astype(np.int32), group_size // block_k, axis=1)
    sums = code_sums - np.int32(block_k) * block_zeros
    return np.ascontiguousarray(sums.reshape(n // BLOCK_N, BLOCK_N, -1).transpose(0, 2, 1))


def _channel_blocks(per_channel: np.ndarray) -> np.ndarray:
    """(N, G) -> (N/32, G, 32)."""
    n, groups = per_channel.shape
    return np.ascontiguousarray(per_channel.reshape(n // BLOCK_N, BLOCK_N, groups).transpose(0, 2, 1))


def _unblock_channels(blocked: np.ndarray) -> np.ndarray:
    """(N/32, G, 32) -> (N, G)."""
    nc, groups, _ = blocked.shape
    return np.ascontiguousarray(blocked.transpose(0, 2, 1)).reshape(nc * BLOCK_N, groups)


def _gate_and_up(w13: BlockedInt4, gate_blocks: int) -> list[BlockedInt4]:
    """The gate's channel blocks come first, then the up's."""
    return [BlockedInt4(*(array[:gate_blocks] for array in w13)), BlockedInt4(*(array[gate_blocks:] for array in w13))]
