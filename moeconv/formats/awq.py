"""AutoAWQ "GEMM" checkpoints (quant_method "awq").

qweight int32 (K, N/8) and qzeros int32 (K/g, N/8) are packed along N, and inside each word slot s
holds column AWQ_ORDER[s] of its group of 8; scales (K/g, N). Zero points are stored as they are
(true zeros). zero_point false means symmetric with the implicit zero 8; producers may still store
qzeros then (AutoRound's AWQ export of a symmetric model writes every word 0x88888888, the zero 8
itself), which are read only to check that they are that constant.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any, Mapping

import numpy as np

from moeconv import packing
from moeconv.canonical import QuantizedWeight
from moeconv.errors import MoeconvError
from moeconv.packed import PackedWeight, transposed
from moeconv.spec import TensorSpec
from moeconv.formats.base import (
    Detection,
    FormatDefaults,
    Linear,
    Read,
    SourceFormat,
    check_bits,
    check_headers,
    checked_group_size,
    config_bool,
    config_int,
    effective_group_size,
    group_size_from_shapes,
    groups_of,
)

SYMMETRIC_WORD = packing.repeated_word(8, 4) - (1 << 32)  # 0x88888888 as the int32 it is stored as
SAMPLE_LINEARS = 96  # linears whose qzeros detection reads at most (a few KB each)

# Slot s of a packed word holds column AWQ_ORDER[s] of its 8 columns.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
NATURAL_FROM_SLOTS = tuple(AWQ_ORDER.index(column) for column in range(8))  # (0, 4, 1, 5, 2, 6, 3, 7)


def _interleave(columns: np.ndarray) -> np.ndarray:
    """(..., N) natural order -> slot order."""
    grouped = columns.reshape(*columns.shape[:-1], -1, 8)
    return grouped[..., list(AWQ_ORDER)].reshape(columns.shape)


def _natural_columns(words: np.ndarray) -> np.ndarray:
    """AWQ's (rows, N/8) int32 words -> (N, rows) uint8 codes. The words are transposed first (one
    int32 transpose moves 8 codes; transposing the unpacked bytes was most of the decode's time), then
    slot NATURAL_FROM_SLOTS[j] of word (m, r) is column 8m + j."""
    transposed = np.ascontiguousarray(words.T).view(np.uint32)
    planes = [((transposed >> np.uint32(4 * slot)) & np.uint32(0xF)).astype(np.uint8) for slot in NATURAL_FROM_SLOTS]
    return np.stack(planes, axis=1).reshape(-1, words.shape[0])


# The three rounds of an 8 x 8 nibble transpose of eight 32-bit words: (shift, mask of the low parts).
_NIBBLE_TRANSPOSE = ((16, 0x0000FFFF), (8, 0x00FF00FF), (4, 0x0F0F0F0F))


def _k_words(words: np.ndarray) -> np.ndarray:
    """AWQ's (K, N/8) words of 4-bit codes packed along N (slot s of word (k, m) holds column
    8m + AWQ_ORDER[s]) -> (N, K/8) int32 words packed along K in natural column order (slot t of word
    (n, j) holds row 8j + t). Each 8 x 8 block of nibbles (eight rows of one word column) is transposed in
    place on the words by three rounds of masked swaps (rows r and r + d exchange the high parts of one with
    the low parts of the other), then the words are put in natural column order."""
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
    return np.ascontiguousarray(natural.transpose(2, 0, 1)).reshape(m * 8, k // 8).view(np.int32)


def _natural_words(words: np.ndarray) -> np.ndarray:
    """AWQ's words packed along N in slot order -> the same words in natural order (slot j holds column j)."""
    unsigned, natural = words.view(np.uint32), np.zeros(words.shape, dtype=np.uint32)
    for column, slot in enumerate(NATURAL_FROM_SLOTS):
        natural |= ((unsigned >> np.uint32(4 * slot)) & np.uint32(0xF)) << np.uint32(4 * column)
    return natural.view(np.int32)


@dataclass(frozen=True)
class AWQ(FormatDefaults):
    bits: int = 4
    group_size: int = 128
    zero_point: bool = True
    method: str = "awq"
    activation_bits = 16  # class attribute, not a field: AWQ is weight-only

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str) -> AWQ:
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise MoeconvError(
                f"{where}: AWQ version {version!r} has a different layout; only 'gemm' checkpoints are supported"
            )
        bits = config_int(config, "bits", 4, where, "w_bit")
        group_size = config_int(config, "group_size", 128, where, "q_group_size")
        check_bits(bits, (4,), "AWQ", where)
        group_size = checked_group_size(group_size, where)
        return cls(bits=bits, group_size=group_size, zero_point=config_bool(config, "zero_point", True, where))

    @property
    def symmetric(self) -> bool:
        return not self.zero_point

    def suffixes(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales") if self.zero_point else ("qweight", "scales")

    def optional_suffixes(self) -> tuple[str, ...]:
        return () if self.zero_point else ("qzeros",)

    @classmethod
    def claims(cls, linears: list[Linear]) -> bool:
        """qweight (K, N/8): eight 4-bit codes per word along N."""
        return bool(linears) and all({"qweight", "scales"} <= set(tensors) and tuple(tensors["qweight"].shape) == (k, n // 8)
                                     for tensors, n, k in linears)

    @classmethod
    def from_data(cls, linears: list[Linear], configured: SourceFormat, read: Read,
                  detection: Detection) -> AWQ | None:
        detection.evidence.append(f"qweight {list(linears[0][0]['qweight'].shape)} is packed along N: AWQ, 4-bit")
        group_size = group_size_from_shapes([(tensors["scales"], 0, k) for tensors, _, k in linears],
                                            configured.group_size, detection)
        if group_size is None:
            return None
        check_headers(linears[:SAMPLE_LINEARS], cls(bits=4, group_size=group_size))  # the linears read below
        return cls(bits=4, group_size=group_size, zero_point=_zero_point_from_data(linears, configured, read, detection))

    def check_symmetric_zeros(self, qzeros: np.ndarray) -> None:
        """zero_point false: stored qzeros must all be the zero 8, or dropping them changes the weight."""
        if bool((qzeros != SYMMETRIC_WORD).any()):
            raise MoeconvError(f"zero_point is false but qzeros hold zero points other than 8 "
                               f"({int((qzeros != SYMMETRIC_WORD).sum())} of {prod(qzeros.shape)} words are not "
                               f"0x{SYMMETRIC_WORD & 0xFFFFFFFF:08X}); --trust-data reads them as asymmetric")

    def linear_shape(self, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, int]:
        in_features, _ = shapes["qweight"]
        return shapes["scales"][1], in_features

    def expected(self, out_features: int, in_features: int) -> dict[str, TensorSpec]:
        per_word = 32 // self.bits
        groups = groups_of(in_features, self.group_size)
        shapes = {
            "qweight": TensorSpec("qweight", (in_features, out_features // per_word), "I32"),
            "scales": TensorSpec("scales", (groups, out_features), None),
            "qzeros": TensorSpec("qzeros", (groups, out_features // per_word), "I32"),  # optional when symmetric
        }
        return shapes

    def decode(self, stored: Mapping[str, np.ndarray]) -> QuantizedWeight:
        codes = _natural_columns(stored["qweight"])
        zeros = None
        if self.zero_point:
            zeros = _natural_columns(stored["qzeros"])
        elif "qzeros" in stored:
            self.check_symmetric_zeros(stored["qzeros"])
        in_features = codes.shape[1]
        return QuantizedWeight(codes=codes, zeros=zeros, scales=transposed(stored["scales"]),
                               bits=self.bits, group_size=effective_group_size(in_features, self.group_size))

    packs = True

    def to_packed(self, stored: Mapping[str, np.ndarray]) -> PackedWeight:
        """AWQ packs along N in its interleaved order, the packed form along K in natural order (`_k_words`);
        the zero words, packed along N like the packed form's, only change slot order."""
        zero_words = None
        if self.zero_point:
            zero_words = transposed(_natural_words(stored["qzeros"]))
        elif "qzeros" in stored:
            self.check_symmetric_zeros(stored["qzeros"])
        words = _k_words(stored["qweight"])
        return PackedWeight(words=words, zero_words=zero_words, scales=transposed(stored["scales"]), bits=self.bits,
                            group_size=effective_group_size(words.shape[1] * 8, self.group_size))

    def encode(self, weight: QuantizedWeight) -> dict[str, np.ndarray]:
        tensors = {
            "qweight": packing.pack_array(_interleave(transposed(weight.codes)), self.bits, axis=1, container=np.int32),
            "scales": transposed(weight.scales),
        }
        if self.zero_point:
            zeros = weight.effective_zeros()
            tensors["qzeros"] = packing.pack_array(_interleave(transposed(zeros)), self.bits, axis=1, container=np.int32)
        return tensors

    def describe(self) -> dict[str, Any]:
        return {"method": "awq", "bits": self.bits, "group_size": self.group_size, "zero_point": self.zero_point}

    def quantization_config(self) -> dict[str, Any]:
        return {
            "quant_method": "awq",
            "version": "gemm",
            "bits": self.bits,
            "group_size": self.group_size,
            "zero_point": self.zero_point,
            "modules_to_not_convert": None,
        }


def _zero_point_from_data(linears: list[Linear], configured: SourceFormat, read: Read, detection: Detection) -> bool:
    """No qzeros: symmetric. qzeros that are all 0x88888888 (the zero 8) fit both readings: the config's
    stands, and under zero_point false they are the symmetric zero written out. Any other word: zero points."""
    with_zeros = [tensors["qzeros"] for tensors, _, _ in linears[:SAMPLE_LINEARS] if "qzeros" in tensors]
    if not with_zeros:
        detection.evidence.append("no qzeros: symmetric (zero_point false)")
        return False
    constant = all(bool((read(entry) == SYMMETRIC_WORD).all()) for entry in with_zeros)
    if not constant:
        detection.evidence.append("qzeros words differ from 0x88888888: zero points (zero_point true)")
        return True
    said = configured.zero_point if isinstance(configured, AWQ) else True
    detection.evidence.append(f"every qzeros word of {len(with_zeros)} sampled linears is 0x88888888, the symmetric "
                              f"zero 8: " + ("asymmetric with every zero 8, as configured" if said else
                                             "symmetric (zero_point false) with the zero written out"))
    return said
