"""AutoAWQ "GEMM" checkpoints (quant_method "awq").

qweight int32 (K, N/8) and qzeros int32 (K/g, N/8) are packed along N, and inside each word slot s
holds column AWQ_ORDER[s] of its group of 8; scales (K/g, N). Zero points are stored as they are
(true zeros). zero_point false means symmetric with the implicit zero 8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from moeconv import packing
from moeconv.canonical import QuantizedWeight
from moeconv.errors import MoeconvError
from moeconv.spec import TensorSpec
from moeconv.formats.base import (
    Detection,
    FormatDefaults,
    Linear,
    Read,
    SourceFormat,
    check_bits,
    checked_group_size,
    config_bool,
    config_int,
    effective_group_size,
    group_size_from_shapes,
    groups_of,
)

# Slot s of a packed word holds column AWQ_ORDER[s] of its 8 columns.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
NATURAL_FROM_SLOTS = tuple(AWQ_ORDER.index(column) for column in range(8))  # (0, 4, 1, 5, 2, 6, 3, 7)


def _interleave(columns: torch.Tensor) -> torch.Tensor:
    """(..., N) natural order -> slot order."""
    grouped = columns.reshape(*columns.shape[:-1], -1, 8)
    return grouped[..., list(AWQ_ORDER)].reshape(columns.shape)


def _natural_columns(words: torch.Tensor) -> torch.Tensor:
    """AWQ's (rows, N/8) int32 words -> (N, rows) uint8 codes. The words are transposed first (one
    int32 transpose moves 8 codes; transposing the unpacked bytes was most of the decode's time), then
    slot NATURAL_FROM_SLOTS[j] of word (m, r) is column 8m + j (the arithmetic shift's sign bits fall
    outside the 0xF mask)."""
    transposed = words.T.contiguous()
    planes = [((transposed >> (4 * slot)) & 0xF).to(torch.uint8) for slot in NATURAL_FROM_SLOTS]
    return torch.stack(planes, dim=1).reshape(-1, words.shape[0])


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
        return None if group_size is None else cls(bits=4, group_size=group_size, zero_point="qzeros" in linears[0][0])

    def linear_shape(self, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, int]:
        in_features, _ = shapes["qweight"]
        return shapes["scales"][1], in_features

    def expected(self, out_features: int, in_features: int) -> dict[str, TensorSpec]:
        per_word = 32 // self.bits
        groups = groups_of(in_features, self.group_size)
        shapes = {
            "qweight": TensorSpec("qweight", (in_features, out_features // per_word), "I32"),
            "scales": TensorSpec("scales", (groups, out_features), None),
        }
        if self.zero_point:
            shapes["qzeros"] = TensorSpec("qzeros", (groups, out_features // per_word), "I32")
        return shapes

    def decode(self, tensors: Mapping[str, torch.Tensor]) -> QuantizedWeight:
        codes = _natural_columns(tensors["qweight"])
        zeros = None
        if self.zero_point:
            zeros = _natural_columns(tensors["qzeros"])
        in_features = codes.shape[1]
        return QuantizedWeight(
            codes=codes,
            zeros=zeros,
            scales=tensors["scales"].T.contiguous(),
            bits=self.bits,
            group_size=effective_group_size(in_features, self.group_size),
        )

    def encode(self, weight: QuantizedWeight) -> dict[str, torch.Tensor]:
        tensors = {
            "qweight": packing.pack(_interleave(weight.codes.T), self.bits, dim=1, container=torch.int32),
            "scales": weight.scales.T.contiguous(),
        }
        if self.zero_point:
            zeros = weight.effective_zeros()
            tensors["qzeros"] = packing.pack(_interleave(zeros.T), self.bits, dim=1, container=torch.int32)
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
