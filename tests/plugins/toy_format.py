"""A toy source format, the whole of it in one module: codes stored one per byte, (N, K); true zero
points one per byte, (N, G); scales (N, G); `to_packed` gives every layout's fast path. Registered by tests/test_plugins.py to prove that a
format needs this module and one registry entry, and nothing else in moeconv."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from moeconv.canonical import QuantizedWeight, effective_group_size, groups_of
from moeconv.formats.base import Detection, FormatDefaults, Linear, Read, SourceFormat, checked_group_size, config_int
from moeconv.packed import PackedWeight, from_codes
from moeconv.spec import TensorSpec


@dataclass(frozen=True)
class ToyFormat(FormatDefaults):
    bits: int = 4
    group_size: int = 32
    method: str = "toyq"
    activation_bits = 16
    vector_suffixes = ()
    audited_suffixes = ("zeros",)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str) -> ToyFormat:
        return cls(bits=config_int(config, "bits", 4, where),
                   group_size=checked_group_size(config_int(config, "group_size", 32, where), where))

    @property
    def symmetric(self) -> bool:
        return False

    def suffixes(self) -> tuple[str, ...]:
        return ("codes", "zeros", "scales")

    def optional_suffixes(self) -> tuple[str, ...]:
        return ()

    def linear_shape(self, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, int]:
        return tuple(shapes["codes"])

    def expected(self, out_features: int, in_features: int) -> dict[str, TensorSpec]:
        groups = groups_of(in_features, self.group_size)
        return {"codes": TensorSpec("codes", (out_features, in_features), "U8"),
                "zeros": TensorSpec("zeros", (out_features, groups), "U8"),
                "scales": TensorSpec("scales", (out_features, groups), None)}

    def decode(self, stored: Mapping[str, np.ndarray]) -> QuantizedWeight:
        codes = stored["codes"]
        return QuantizedWeight(codes=codes, zeros=stored["zeros"], scales=stored["scales"], bits=self.bits,
                               group_size=effective_group_size(codes.shape[1], self.group_size))

    packs = True

    def to_packed(self, stored: Mapping[str, np.ndarray]) -> PackedWeight | None:
        """The fast path into every layout that takes the packed form."""
        codes = stored["codes"]
        return from_codes(codes, stored["zeros"], stored["scales"], self.bits,
                          effective_group_size(codes.shape[1], self.group_size))

    def encode(self, weight: QuantizedWeight) -> dict[str, np.ndarray]:
        return {"codes": weight.codes, "zeros": weight.effective_zeros(), "scales": weight.scales}

    def audit(self, tensors: Mapping[str, np.ndarray]) -> dict[str, int]:
        """Zero points outside the code range: a damaged toy checkpoint."""
        return {"toy_zeros_out_of_range": int((tensors["zeros"] >= 1 << self.bits).sum())} if "zeros" in tensors else {}

    @classmethod
    def claims(cls, linears: list[Linear]) -> bool:
        return bool(linears) and all({"codes", "zeros", "scales"} <= set(tensors) for tensors, _, _ in linears)

    @classmethod
    def from_data(cls, linears: list[Linear], configured: SourceFormat, read: Read,
                  detection: Detection) -> ToyFormat | None:
        top = max(int(read(tensors["codes"]).max()) for tensors, _, _ in linears[:8])
        bits = next(b for b in (2, 4, 8) if top < 1 << b)
        bits = max(bits, configured.bits if isinstance(configured, ToyFormat) else bits)
        detection.evidence.append(f"largest code {top}: fits {bits} bits")
        tensors, _, k = linears[0]
        groups = tensors["scales"].shape[1]
        return cls(bits=bits, group_size=k // groups if groups > 1 else configured.group_size)

    def describe(self) -> dict[str, Any]:
        return {"method": self.method, "bits": self.bits, "group_size": self.group_size}

    def quantization_config(self) -> dict[str, Any]:
        return {"quant_method": self.method, "bits": self.bits, "group_size": self.group_size}
