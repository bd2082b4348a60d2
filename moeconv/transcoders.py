"""Packed-to-packed transcoders: one source format's stored words straight into one backend's
layout, without unpacking to the canonical form, for the pairs where the two layouts are close.

The canonical route (format.decode, then backend.encode_expert) stays the definition: every
transcoder here is proven byte-identical to it by a property test over shapes, bit widths,
symmetric and asymmetric zero points, group sizes and edge values (tests/test_transcoders.py). A
pair without a transcoder simply takes the canonical route.

GPTQ -> triton (moe_wna16): GPTQ packs codes along K into int32 words (K·b/32, N), LSB first; the
kernel reads (N, K·b/8) bytes packed along K, LSB first, so each row is a column of words read as
bytes: a transpose and a byte split. Zero points: GPTQ's (G, N·b/32) words, made true (v1 adds the
repeated-ones word back), are along N as the kernel's (N·b/8, G) bytes are: a byte split and a
transpose. AWQ -> triton: AWQ packs along N in its interleaved order, the kernel along K: each 8 x 8
block of nibbles is transposed on the words themselves (`_awq_k_words`: three rounds of masked swaps),
then the words are put in natural column order and read as bytes. GPTQ ->
compressed-tensors (experts, and the dense linears any backend writes in compressed-tensors): the
same words, transposed (`gptq_linear_to_compressed_tensors`); AWQ -> compressed-tensors: the same
words as AWQ -> triton (`awq_linear_to_compressed_tensors`). Humming's
per-linear schema holds the same words as compressed-tensors under other names. Into the x86 cpu
layout (4-bit, backends/cpu.py) each format's codes become words packed along K (`_gptq_rows`,
`_awq_rows`, `_compressed_tensors_rows`), whose nibbles are spread and moved in 32-bit units into the
layout's blocks, with the compensation sums taken from the words (`_cpu_blocked`).

They move bytes and nothing else, so they run in numpy on the stored bytes (`TensorReader.read_raw`;
BF16 scales travel as their uint16 bit patterns): a conversion whose every job has a transcoder runs
its workers without torch (`Plan.workers_need_torch`), whose import is most of a small conversion's
time on a machine without bytecode caches (docs/BENCHMARKS.md).
"""

from __future__ import annotations

from typing import Callable, Mapping, Union

import numpy as np

from moeconv import act_order, packing
from moeconv.packing import as_float32
from moeconv.backends import cpu
from moeconv.backends.base import FUSED_GEMMS
from moeconv.backends.triton import WNA16
from moeconv.canonical import MoELayerShape, effective_group_size
from moeconv.errors import MoeconvError
from moeconv.formats.awq import AWQ, NATURAL_FROM_SLOTS
from moeconv.formats.compressed_tensors import CompressedTensors
from moeconv.formats.gptq import GPTQ

Linear = Mapping[str, np.ndarray]  # one source linear's stored tensors (TensorReader.read_raw), by suffix
# A transcoder may decline one expert (None): that expert then takes the canonical route.
Transcoder = Callable[[object, Mapping[str, Linear], MoELayerShape, int], Union[dict[str, np.ndarray], None]]


def _bytes(words: np.ndarray) -> np.ndarray:
    """(rows, W) 32-bit words -> (rows, 4W) bytes, least significant first (safetensors' byte order)."""
    return np.ascontiguousarray(words, dtype=np.dtype("<u4") if words.dtype.kind == "u" else np.dtype("<i4")
                                ).view(np.uint8)


def _transposed(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array.T)


def _regrouped(array: np.ndarray, factor: int) -> np.ndarray:
    """(rows, G) scales or zero bytes with each group repeated `factor` times (canonical.regroup)."""
    return array if factor == 1 else np.repeat(array, factor, axis=1)


def _stacked_gemms(parts: Mapping[str, tuple], factor: int) -> dict[str, np.ndarray]:
    """The triton slices from each projection's (qweight bytes, scales, zero bytes or None)."""
    slices = {}
    for prefix, projections in FUSED_GEMMS.items():
        codes, scales, zeros = zip(*(parts[projection] for projection in projections))
        names = WNA16[prefix]
        slices[names.qweight] = np.concatenate(codes)
        slices[names.scales] = _regrouped(np.concatenate(scales), factor)
        if zeros[0] is not None:
            slices[names.qzeros] = _regrouped(np.concatenate(zeros), factor)
    return slices


def gptq_to_triton(fmt: GPTQ, linears: Mapping[str, Linear], layer: MoELayerShape,
                   factor: int) -> dict[str, np.ndarray] | None:
    """None for an expert with a non-trivial g_idx: the canonical route folds act-order or refuses it."""
    if not all(fmt.static_groups(linear.get("g_idx"), linear["qweight"].shape[0] * 32 // fmt.bits)
               for linear in linears.values()):
        return None

    def one(linear: Linear) -> tuple:
        codes = _bytes(linear["qweight"].T)  # (K·b/32, N) words -> (N, K·b/8) bytes
        zeros = None
        if not fmt.sym:
            true_words = packing.add_to_word_array(linear["qzeros"], fmt.zero_offset_word())
            zeros = _transposed(_bytes(true_words))  # (G, N·b/8) -> (N·b/8, G)
        return codes, _transposed(linear["scales"]), zeros

    return _stacked_gemms({projection: one(linear) for projection, linear in linears.items()}, factor)


def _awq_columns(words: np.ndarray) -> list[np.ndarray]:
    """AWQ's (rows, N/8) words as 8 planes of 4-bit codes (rows, N/8), plane j holding the columns
    8m + j. Byte b of a word holds slots 2b (low nibble) and 2b + 1; slot s holds column AWQ_ORDER[s]."""
    data = _bytes(words).reshape(words.shape[0], -1, 4)
    nibbles = {}
    for byte in range(4):
        nibbles[2 * byte], nibbles[2 * byte + 1] = data[..., byte] & 0xF, data[..., byte] >> 4
    return [nibbles[slot] for slot in NATURAL_FROM_SLOTS]


# The three rounds of an 8 x 8 nibble transpose of eight 32-bit words: (shift, mask of the low parts).
_NIBBLE_TRANSPOSE = ((16, 0x0000FFFF), (8, 0x00FF00FF), (4, 0x0F0F0F0F))


def _awq_k_words(words: np.ndarray) -> np.ndarray:
    """AWQ's (K, N/8) words of 4-bit codes packed along N (slot s of word (k, m) holds column
    8m + AWQ_ORDER[s]) -> (N, K/8) uint32 words packed along K in natural column order (slot t of word
    (n, j) holds row 8j + t), as compressed-tensors stores them; read as little-endian bytes they are
    the triton kernel's (N, K/2) codes. Each 8 x 8 block of nibbles (eight rows of one word column) is
    transposed in place on the words by three rounds of masked swaps (rows r and r + d exchange the
    high parts of one with the low parts of the other), then the words are put in natural column order."""
    k, m = words.shape
    rows = np.ascontiguousarray(words.view(np.uint32).reshape(k // 8, 8, m).transpose(1, 0, 2))  # (8, K/8, N/8)
    scratch = np.empty_like(rows[0])
    for shift, mask in _NIBBLE_TRANSPOSE:
        distance, low = shift // 4, np.uint32(mask)
        for r in (r for r in range(8) if not r & distance):
            top, bottom = rows[r], rows[r + distance]
            np.right_shift(top, np.uint32(shift), out=scratch)  # tmp = ((top >> shift) ^ bottom) & low
            np.bitwise_xor(scratch, bottom, out=scratch)
            np.bitwise_and(scratch, low, out=scratch)
            np.bitwise_xor(bottom, scratch, out=bottom)
            np.left_shift(scratch, np.uint32(shift), out=scratch)
            np.bitwise_xor(top, scratch, out=top)
    # rows[s] now holds, for every (j, m), the word of column 8m + AWQ_ORDER[s]: (8, K/8, N/8) -> (N, K/8)
    natural = rows[list(NATURAL_FROM_SLOTS)]
    return np.ascontiguousarray(natural.transpose(2, 0, 1)).reshape(m * 8, k // 8)


def _pairs(codes: np.ndarray) -> np.ndarray:
    """(2M, ...) 4-bit codes -> (M, ...) bytes, even rows in the low nibble."""
    return codes[0::2] | (codes[1::2] << 4)


def _awq_natural(words: np.ndarray) -> np.ndarray:
    """AWQ's (rows, N/8) words as (rows, N) 4-bit codes in natural column order."""
    return np.stack(_awq_columns(words), axis=2).reshape(words.shape[0], -1)


def _awq_zeros(fmt: AWQ, linear: Linear) -> np.ndarray | None:
    """An AWQ linear's (G, N) zero points in natural column order, or None under zero_point false, where
    stored qzeros must all be the zero 8 (checked as AWQ.decode checks them)."""
    if fmt.zero_point:
        return _awq_natural(linear["qzeros"])
    if "qzeros" in linear:
        fmt.check_symmetric_zeros(linear["qzeros"])
    return None


def awq_to_triton(fmt: AWQ, linears: Mapping[str, Linear], layer: MoELayerShape, factor: int) -> dict[str, np.ndarray]:
    def one(linear: Linear) -> tuple:
        codes = _bytes(_awq_k_words(linear["qweight"]))  # (N, K/8) words -> (N, K/2) bytes
        zeros = _awq_zeros(fmt, linear)
        return codes, _transposed(linear["scales"]), None if zeros is None else _pairs(_transposed(zeros))

    return _stacked_gemms({projection: one(linear) for projection, linear in linears.items()}, factor)


def gptq_linear_to_compressed_tensors(fmt: GPTQ, linear: Linear, factor: int) -> dict[str, np.ndarray] | None:
    """One GPTQ linear as compressed-tensors pack-quantized: both pack the codes along K into int32
    words, value j at bits [j·b, j·b + b), so `weight_packed` (N, K·b/32) is GPTQ's (K·b/32, N) words
    transposed; the TRUE zero points are packed along N in both, so `weight_zero_point` (N·b/32, G) is
    GPTQ's (G, N·b/32) true words (v1's repeated-ones word added back) transposed; the scales likewise.
    None for a non-trivial g_idx (the canonical route folds act-order or refuses it)."""
    qweight = linear["qweight"]
    in_features, out_features = qweight.shape[0] * 32 // fmt.bits, qweight.shape[1]
    if not fmt.static_groups(linear.get("g_idx"), in_features):
        return None
    tensors = {"weight_packed": _transposed(qweight),
               "weight_scale": _regrouped(_transposed(linear["scales"]), factor),
               "weight_shape": np.array([out_features, in_features], dtype=np.int64)}
    if not fmt.sym:
        true_words = packing.add_to_word_array(linear["qzeros"], fmt.zero_offset_word())
        tensors["weight_zero_point"] = _regrouped(_transposed(true_words), factor)
    return tensors


def _pack_rows(codes: np.ndarray, bits: int) -> np.ndarray:
    """(R, C) uint8 codes -> (R, C·b/32) int32 words packed along C, value j of a word at bits
    [j·b, j·b + b): 4-bit codes paired into bytes (even value in the low nibble), then the bytes read as
    little-endian words; 8-bit codes are the bytes."""
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4) if bits == 4 else codes
    return np.ascontiguousarray(packed).view(np.dtype("<i4"))


def awq_linear_to_compressed_tensors(fmt: AWQ, linear: Linear, factor: int) -> dict[str, np.ndarray]:
    """One AWQ linear as compressed-tensors pack-quantized: AWQ packs along N in its interleaved order,
    compressed-tensors along K in natural order (`_awq_k_words`); the zero points, unpacked into natural
    columns, are packed along N."""
    words = _awq_k_words(linear["qweight"])  # (N, K/8)
    out_features, in_features = words.shape[0], words.shape[1] * 8
    tensors = {"weight_packed": np.ascontiguousarray(words, dtype="<u4").view("<i4"),
               "weight_scale": _regrouped(_transposed(linear["scales"]), factor),
               "weight_shape": np.array([out_features, in_features], dtype=np.int64)}
    zeros = _awq_zeros(fmt, linear)
    if zeros is not None:
        tensors["weight_zero_point"] = _regrouped(_transposed(_pack_rows(zeros, fmt.bits)), factor)
    return tensors


LinearTranscoder = Callable[[object, Linear, int], Union[dict[str, np.ndarray], None]]


def _humming_names(tensors: dict[str, np.ndarray] | None) -> dict[str, np.ndarray] | None:
    """Humming's per-linear schema holds the same words as compressed-tensors' under its own names, and
    no weight_shape (backends/humming.py)."""
    if tensors is None:
        return None
    renamed = {"weight": tensors["weight_packed"], "weight_scale": tensors["weight_scale"]}
    if "weight_zero_point" in tensors:
        renamed["zero_point"] = tensors["weight_zero_point"]
    return renamed


def gptq_linear_to_humming(fmt: GPTQ, linear: Linear, factor: int) -> dict[str, np.ndarray] | None:
    return _humming_names(gptq_linear_to_compressed_tensors(fmt, linear, factor))


def awq_linear_to_humming(fmt: AWQ, linear: Linear, factor: int) -> dict[str, np.ndarray]:
    return _humming_names(awq_linear_to_compressed_tensors(fmt, linear, factor))


def _expert_linears(one: LinearTranscoder, fmt: object, linears: Mapping[str, Linear], layer: MoELayerShape,
                    factor: int) -> dict[str, np.ndarray] | None:
    """An expert's three linears, each through `one`, under the layer's projection names
    (PerLinearBackend.encode_expert); None if any declines."""
    slices = {}
    for name, projection in zip(layer.projection_names, ("gate", "up", "down")):
        tensors = one(fmt, linears[projection], factor)
        if tensors is None:
            return None
        slices.update({f"{name}.{suffix}": array for suffix, array in tensors.items()})
    return slices


def gptq_to_compressed_tensors(fmt: GPTQ, linears: Mapping[str, Linear], layer: MoELayerShape,
                               factor: int) -> dict[str, np.ndarray] | None:
    return _expert_linears(gptq_linear_to_compressed_tensors, fmt, linears, layer, factor)


def awq_to_compressed_tensors(fmt: AWQ, linears: Mapping[str, Linear], layer: MoELayerShape,
                              factor: int) -> dict[str, np.ndarray]:
    return _expert_linears(awq_linear_to_compressed_tensors, fmt, linears, layer, factor)


def gptq_to_humming(fmt: GPTQ, linears: Mapping[str, Linear], layer: MoELayerShape,
                    factor: int) -> dict[str, np.ndarray] | None:
    return _expert_linears(gptq_linear_to_humming, fmt, linears, layer, factor)


def awq_to_humming(fmt: AWQ, linears: Mapping[str, Linear], layer: MoELayerShape, factor: int) -> dict[str, np.ndarray]:
    return _expert_linears(awq_linear_to_humming, fmt, linears, layer, factor)


def _ct_words(fmt: CompressedTensors, linear: Linear) -> tuple[np.ndarray, np.ndarray | None] | None:
    """A compressed-tensors pack-quantized linear's codes (N, K·b/32) and true zero words (N·b/32, G) or
    None, checked as CompressedTensors.decode checks them; None for a weight_g_idx that is not k // g."""
    packed = linear["weight_packed"]
    shape = (packed.shape[0], packed.shape[1] * 32 // fmt.bits)
    stated = tuple(int(size) for size in linear["weight_shape"].reshape(-1))
    if stated != shape:
        raise MoeconvError(f"weight_shape says {list(stated)}, weight_packed holds {list(shape)}")
    g_idx = linear.get("weight_g_idx")
    if g_idx is not None and act_order.group_order(
            g_idx, effective_group_size(shape[1], fmt.group_size)).kind != act_order.STATIC:
        return None
    return packed, None if fmt.symmetric else linear["weight_zero_point"]


def compressed_tensors_linear_to_compressed_tensors(fmt: CompressedTensors, linear: Linear,
                                                    factor: int) -> dict[str, np.ndarray] | None:
    """The normalised compressed-tensors linear: the same words (regrouped where asked), without a
    trivial weight_g_idx."""
    words = _ct_words(fmt, linear)
    if words is None:
        return None
    codes, zeros = words
    tensors = {"weight_packed": codes, "weight_scale": _regrouped(linear["weight_scale"], factor),
               "weight_shape": np.array([codes.shape[0], codes.shape[1] * 32 // fmt.bits], dtype=np.int64)}
    if zeros is not None:
        tensors["weight_zero_point"] = _regrouped(zeros, factor)
    return tensors


def compressed_tensors_linear_to_humming(fmt: CompressedTensors, linear: Linear,
                                         factor: int) -> dict[str, np.ndarray] | None:
    return _humming_names(compressed_tensors_linear_to_compressed_tensors(fmt, linear, factor))


def compressed_tensors_to_compressed_tensors(fmt: CompressedTensors, linears: Mapping[str, Linear],
                                             layer: MoELayerShape, factor: int) -> dict[str, np.ndarray] | None:
    return _expert_linears(compressed_tensors_linear_to_compressed_tensors, fmt, linears, layer, factor)


def compressed_tensors_to_humming(fmt: CompressedTensors, linears: Mapping[str, Linear], layer: MoELayerShape,
                                  factor: int) -> dict[str, np.ndarray] | None:
    return _expert_linears(compressed_tensors_linear_to_humming, fmt, linears, layer, factor)


def compressed_tensors_to_triton(fmt: CompressedTensors, linears: Mapping[str, Linear], layer: MoELayerShape,
                                 factor: int) -> dict[str, np.ndarray] | None:
    """compressed-tensors packs codes along K into int32 words, LSB first: read as bytes, they are the
    kernel's (N, K·b/8) codes. Its true zero points are packed along N in (N·b/32, G) words: the bytes of
    each word, in order down the rows, are the kernel's (N·b/8, G) zero bytes."""
    words = {projection: _ct_words(fmt, linear) for projection, linear in linears.items()}
    if any(found is None for found in words.values()):
        return None

    def one(projection: str) -> tuple:
        codes, zeros = words[projection]
        if zeros is not None:
            groups = zeros.shape[1]
            zeros = np.ascontiguousarray(_bytes(zeros).reshape(zeros.shape[0], groups, 4).transpose(0, 2, 1))
            zeros = zeros.reshape(-1, groups)
        return _bytes(codes), np.ascontiguousarray(linears[projection]["weight_scale"]), zeros

    return _stacked_gemms({projection: one(projection) for projection in linears}, factor)


def _gptq_rows(fmt: GPTQ, linear: Linear) -> tuple | None:
    """A 4-bit GPTQ linear's (N, K/8) words packed along K (slot t of word (n, j) holds row 8j + t), its
    (N, G) true zero points (None: symmetric) and (N, G) scales as stored; None for a non-trivial g_idx."""
    qweight = linear["qweight"]
    if not fmt.static_groups(linear.get("g_idx"), qweight.shape[0] * 32 // fmt.bits):
        return None
    zeros = None
    if not fmt.sym:
        true_words = packing.add_to_word_array(linear["qzeros"], fmt.zero_offset_word())
        zeros = packing.unpack_array(true_words, fmt.bits, axis=1).T
    return qweight.view(np.uint32).T, zeros, linear["scales"].T


def _awq_rows(fmt: AWQ, linear: Linear) -> tuple:
    """`_gptq_rows` of an AWQ linear."""
    zeros = _awq_zeros(fmt, linear)
    return _awq_k_words(linear["qweight"]), None if zeros is None else zeros.T, linear["scales"].T


def _compressed_tensors_rows(fmt: CompressedTensors, linear: Linear) -> tuple | None:
    """`_gptq_rows` of a compressed-tensors pack-quantized linear."""
    words = _ct_words(fmt, linear)
    if words is None:
        return None
    packed, zero_words = words
    zeros = None if zero_words is None else packing.unpack_array(zero_words, fmt.bits, axis=0)
    return packed.view(np.uint32), zeros, linear["weight_scale"]


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


def _cpu_blocked(rows: np.ndarray, zeros: np.ndarray | None, scales: np.ndarray, repeat: int,
                 group_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One 4-bit linear's (N, K/8) row words in the x86 blocked layout (backends/cpu.py: block_int4), its
    zero points and scales repeated `repeat` times to the layer's group size: (qweight, fp32 scales, int8
    zeros). Channel n (low nibble) and n + 8 (high nibble) of each 16-channel half share a byte for each
    k: their words' nibbles are spread to one byte each and or-ed, which gives, per channel pair and
    quad of k, the 4 bytes (ki) the layout keeps together; those 32-bit units are then moved to the
    layout's (nc, kc, q, h, ni) order."""
    n, k = rows.shape[0], rows.shape[1] * 8
    block_k = cpu.block_k_for(group_size)
    nc, kc = n // cpu.BLOCK_N, k // block_k
    zeros = np.full(scales.shape, cpu.SYMMETRIC_ZERO, dtype=np.uint8) if zeros is None else zeros
    zeros, scales = np.repeat(zeros, repeat, axis=1), np.repeat(scales, repeat, axis=1)
    words = np.ascontiguousarray(rows, dtype=np.uint32).reshape(nc, 2, 2, 8, -1)  # (nc, h, high, ni, K/8)
    pairs = _spread_nibbles(words[:, :, 0]) | (_spread_nibbles(words[:, :, 1]) << np.uint64(4))
    quads = np.ascontiguousarray(pairs, dtype="<u8").view(np.uint32).reshape(nc, 2, 8, kc, block_k // cpu.VNNI)
    nibbles = np.ascontiguousarray(quads.transpose(0, 3, 4, 1, 2)).view(np.uint8).reshape(nc, kc, -1)
    sums = (_nibble_sums(words.reshape(n, kc, block_k // 8)).sum(axis=-1, dtype=np.int32)
            - block_k * np.repeat(zeros.astype(np.int32), group_size // block_k, axis=1))
    compensation = np.ascontiguousarray(sums.reshape(nc, cpu.BLOCK_N, kc).transpose(0, 2, 1), dtype="<i4")
    blocks = lambda per_channel: np.ascontiguousarray(  # noqa: E731 (N, G) -> (N/32, G, 32)
        per_channel.reshape(nc, cpu.BLOCK_N, -1).transpose(0, 2, 1))
    return (np.concatenate([nibbles, compensation.view(np.uint8)], axis=-1), blocks(as_float32(scales)),
            blocks(zeros.view(np.int8)))


def _expert_to_cpu(rows_of: Callable[[object, Linear], tuple | None], fmt: object, linears: Mapping[str, Linear],
                   layer: MoELayerShape, factor: int) -> dict[str, np.ndarray] | None:
    """An expert into the x86 INT4 blocked layout from a format's `rows_of` (the W8A8 layout takes the
    canonical route); None where a linear declines, a K block is not whole words, or an fp16 scale is
    a NaN."""
    group_size = cpu.layer_group_size(layer)
    if cpu.block_k_for(group_size) % 8:
        return None
    blocked = {}
    for projection, linear in linears.items():
        found = rows_of(fmt, linear)
        if found is None:
            return None
        rows, zeros, scales = found
        if scales.dtype == np.float16 and np.isnan(scales).any():
            return None  # torch's fp16 -> fp32 (the canonical route) quiets signalling NaNs, numpy's does not
        repeat = factor * layer.group_size_for(rows.shape[1] * 8) // group_size
        blocked[projection] = _cpu_blocked(rows, zeros, scales, repeat, group_size)
    slices = {}
    for prefix, projections in FUSED_GEMMS.items():
        for name, parts in zip(cpu.blocked_suffixes(prefix), zip(*(blocked[p] for p in projections))):
            slices[name] = np.concatenate(parts)
    return slices


def gptq_to_cpu(fmt: GPTQ, linears: Mapping[str, Linear], layer: MoELayerShape,
                factor: int) -> dict[str, np.ndarray] | None:
    return _expert_to_cpu(_gptq_rows, fmt, linears, layer, factor)


def awq_to_cpu(fmt: AWQ, linears: Mapping[str, Linear], layer: MoELayerShape,
               factor: int) -> dict[str, np.ndarray] | None:
    return _expert_to_cpu(_awq_rows, fmt, linears, layer, factor)


def compressed_tensors_to_cpu(fmt: CompressedTensors, linears: Mapping[str, Linear], layer: MoELayerShape,
                              factor: int) -> dict[str, np.ndarray] | None:
    return _expert_to_cpu(_compressed_tensors_rows, fmt, linears, layer, factor)


# (format, per-linear backend) -> (expert transcoder, dense linear transcoder)
_PER_LINEAR = {(GPTQ, "compressed-tensors"): (gptq_to_compressed_tensors, gptq_linear_to_compressed_tensors),
               (AWQ, "compressed-tensors"): (awq_to_compressed_tensors, awq_linear_to_compressed_tensors),
               (GPTQ, "humming"): (gptq_to_humming, gptq_linear_to_humming),
               (AWQ, "humming"): (awq_to_humming, awq_linear_to_humming),
               (CompressedTensors, "compressed-tensors"): (compressed_tensors_to_compressed_tensors,
                                                           compressed_tensors_linear_to_compressed_tensors),
               (CompressedTensors, "humming"): (compressed_tensors_to_humming, compressed_tensors_linear_to_humming)}


_CPU = {GPTQ: gptq_to_cpu, AWQ: awq_to_cpu, CompressedTensors: compressed_tensors_to_cpu}


def _per_linear(fmt: object, backend_name: str | None) -> tuple[Transcoder, LinearTranscoder] | None:
    if isinstance(fmt, GPTQ) and fmt.bits in (4, 8):
        return _PER_LINEAR.get((GPTQ, backend_name))
    if isinstance(fmt, AWQ) and fmt.bits == 4:
        return _PER_LINEAR.get((AWQ, backend_name))
    if isinstance(fmt, CompressedTensors) and fmt.packed and fmt.bits in (4, 8):
        return _PER_LINEAR.get((CompressedTensors, backend_name))
    return None


def find(fmt: object, backend_name: str, layer: MoELayerShape) -> Transcoder | None:
    """The expert transcoder for this pair and layer, or None (the canonical route)."""
    if layer.activation_bits != 16:
        return None
    if backend_name == "triton" and isinstance(fmt, GPTQ) and fmt.bits in (4, 8):
        return gptq_to_triton
    if backend_name == "triton" and isinstance(fmt, AWQ) and fmt.bits == 4:
        return awq_to_triton
    if backend_name == "triton" and isinstance(fmt, CompressedTensors) and fmt.packed and fmt.bits in (4, 8):
        return compressed_tensors_to_triton
    if backend_name == "cpu":  # the INT4 blocked layout; W8A8 (activation_bits 8) was left above
        if layer.bits != 4 or isinstance(fmt, CompressedTensors) and not fmt.packed:
            return None
        return next((transcoder for kind, transcoder in _CPU.items() if isinstance(fmt, kind)), None)
    pair = _per_linear(fmt, backend_name)
    return pair[0] if pair else None


def find_linear(fmt: object, backend_name: str | None, activation_bits: int = 16) -> LinearTranscoder | None:
    """The transcoder of a dense quantized linear written in `backend_name`'s layout, or None."""
    pair = _per_linear(fmt, backend_name) if activation_bits == 16 else None
    return pair[1] if pair else None
