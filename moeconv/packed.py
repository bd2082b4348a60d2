"""The packed form: the second meeting point of formats and layouts, for the fast path.

Most formats and layouts store a linear's codes packed along K into 32-bit words and its zero points
packed along N, which is the packed form (the words of compressed-tensors pack-quantized). A format that
can put its stored words into it (`to_packed`, moving bits, never unpacking the codes) and a layout that
can take its words from it (`from_packed`) meet here, so that N formats and M layouts cost N + M: a new
format gets every layout's fast path. The canonical form (canonical.py) stays the definition: every pair's
packed route is proven byte-identical to decode -> encode (tests/test_packed.py). All numpy, on the stored
arrays (`TensorReader.read_raw`: BF16 scales as their uint16 bit patterns).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeconv import packing


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """One linear `W[n, k] = (code[n, k] − zero[n, k // g]) · scales[n, k // g]`, packed.

    words: int32 (N, K·b/32), codes packed along K, value j of a word at bits [j·b, j·b + b).
    zero_words: int32 (N·b/32, G), the TRUE zero points packed along N the same way, or None for the
    implicit 2^(b−1) (symmetric).
    scales: (N, G) as stored (float16, float32, or BF16 as uint16 bit patterns).
    group_size: g, with g == K for channel-wise quantization (as `QuantizedWeight`)."""

    words: np.ndarray
    zero_words: np.ndarray | None
    scales: np.ndarray
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        n, width = self.words.shape
        assert self.words.dtype == np.int32, self.words.dtype
        groups = width * 32 // self.bits // self.group_size
        assert self.scales.shape == (n, groups), (self.scales.shape, n, groups)
        if self.zero_words is not None:
            assert self.zero_words.dtype == np.int32, self.zero_words.dtype
            assert self.zero_words.shape == (n * self.bits // 32, groups), (self.zero_words.shape, n, groups)

    @property
    def out_features(self) -> int:
        return self.words.shape[0]

    @property
    def in_features(self) -> int:
        return self.words.shape[1] * 32 // self.bits

    def regrouped(self, factor: int) -> PackedWeight:
        """`canonical.regroup` of the packed form: every scale and zero word repeated `factor` times along G."""
        if factor == 1:
            return self
        return PackedWeight(words=self.words, scales=np.repeat(self.scales, factor, axis=1),
                            zero_words=None if self.zero_words is None else np.repeat(self.zero_words, factor, axis=1),
                            bits=self.bits, group_size=self.group_size // factor)

    def code_bytes(self) -> np.ndarray:
        """The codes as (N, K·b/8) bytes packed along K, least significant first (the words' bytes in order)."""
        return little_endian_bytes(self.words)

    def zero_bytes(self) -> np.ndarray | None:
        """The zero points as (N·b/8, G) bytes packed along N, least significant first; None if symmetric."""
        if self.zero_words is None:
            return None
        rows, groups = self.zero_words.shape
        split = little_endian_bytes(self.zero_words).reshape(rows, groups, 4).transpose(0, 2, 1)
        return np.ascontiguousarray(split).reshape(rows * 4, groups)

    def zero_points(self) -> np.ndarray | None:
        """The (N, G) uint8 true zero points, unpacked; None if symmetric."""
        return None if self.zero_words is None else packing.unpack_array(self.zero_words, self.bits, axis=0)


def little_endian_bytes(words: np.ndarray) -> np.ndarray:
    """(rows, W) 32-bit words -> (rows, 4W) bytes, least significant first (safetensors' byte order)."""
    return np.ascontiguousarray(words, dtype=np.dtype("<u4") if words.dtype.kind == "u" else np.dtype("<i4")
                                ).view(np.uint8)


def words(values: np.ndarray, bits: int) -> np.ndarray:
    """(R, C) uint8 values (< 2^bits) -> (R, C·b/32) int32 words packed along C, value j of a word at bits
    [j·b, j·b + b)."""
    per = 32 // bits
    slots = values.reshape(values.shape[0], -1, per).astype(np.uint32)
    packed = slots[..., 0].copy()
    for slot in range(1, per):
        packed |= slots[..., slot] << np.uint32(slot * bits)
    return packed.view(np.int32)


def from_codes(codes: np.ndarray, zeros: np.ndarray | None, scales: np.ndarray, bits: int,
               group_size: int) -> PackedWeight | None:
    """The packed form of a linear stored as unpacked (N, K) codes and (N, G) true zero points (or None); None
    where a value does not fit in `bits` (the canonical route carries it as it is, for verify to find)."""
    if any(values is not None and (values >> np.uint8(bits)).any() for values in (codes, zeros)):
        return None
    zero_words = None if zeros is None else transposed(words(transposed(zeros), bits))
    return PackedWeight(words=words(codes, bits), zero_words=zero_words, scales=scales, bits=bits,
                        group_size=group_size)


def transposed(array: np.ndarray) -> np.ndarray:
    """A 2-D array transposed, contiguous (the formats that store (K, N) where the packed form is (N, K))."""
    return np.ascontiguousarray(array.T)
