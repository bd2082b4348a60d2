"""GPTQ checkpoints (quant_method "gptq"; AutoGPTQ, GPTQModel, optimum, AutoRound).

qweight int32 (K·b/32, N) packed along K; qzeros int32 (K/g, N·b/32) packed along N; scales (K/g, N);
g_idx (K,). `checkpoint_format` "gptq" (v1) stores zero − 1, "gptq_v2" stores true zeros.

v1 cannot store a zero of 0 cleanly and producers disagree on what they write. GPTQModel makes v1
by subtracting 0x11111111 (4-bit) from each packed word, borrows crossing slots; AutoGPTQ ORs a
sign-extended −1 into the word. We decode v1 as the exact inverse of GPTQModel's arithmetic (add the
repeated-ones word back, modulo 2^32), which is right for every GPTQModel checkpoint and for every
group whose zero is not 0 in AutoGPTQ ones; groups whose stored slot is all ones (2^b − 1) are the
ones to look at, and `suspicious_zero_slots` counts them for the reports.
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
    check_bits,
    check_group_size,
    config_bool,
    config_int,
    effective_group_size,
    groups_of,
)

V1, V2 = "gptq", "gptq_v2"


@dataclass(frozen=True)
class GPTQ:
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    checkpoint_format: str = V1
    method: str = "gptq"
    activation_bits = 16  # class attribute, not a field: GPTQ is weight-only

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str) -> GPTQ:
        bits = config_int(config, "bits", 4, where)
        group_size = config_int(config, "group_size", 128, where)
        check_bits(bits, (2, 4, 8), "GPTQ", where)
        check_group_size(group_size, where)
        checkpoint_format = config.get("checkpoint_format", V1)
        if not isinstance(checkpoint_format, str):
            raise MoeconvError(f"{where}: checkpoint_format must be a string, not {checkpoint_format!r}")
        checkpoint_format = checkpoint_format.lower()
        if checkpoint_format not in (V1, V2):
            raise MoeconvError(
                f"{where}: GPTQ checkpoint_format {checkpoint_format!r} is not supported (expected 'gptq' or 'gptq_v2')"
            )
        return cls(
            bits=bits,
            group_size=group_size,
            sym=config_bool(config, "sym", True, where),
            checkpoint_format=checkpoint_format,
        )

    @property
    def symmetric(self) -> bool:
        return self.sym

    def suffixes(self) -> tuple[str, ...]:
        return ("qweight", "scales") if self.sym else ("qweight", "qzeros", "scales")

    def optional_suffixes(self) -> tuple[str, ...]:
        return ("g_idx", "qzeros") if self.sym else ("g_idx",)

    def linear_shape(self, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, int]:
        packed_rows, out_features = shapes["qweight"]
        return out_features, packed_rows * 32 // self.bits

    def expected(self, out_features: int, in_features: int) -> dict[str, TensorSpec]:
        per_word = 32 // self.bits
        groups = groups_of(in_features, self.group_size)
        return {
            "qweight": TensorSpec("qweight", (in_features // per_word, out_features), "I32"),
            "qzeros": TensorSpec("qzeros", (groups, out_features // per_word), "I32"),
            "scales": TensorSpec("scales", (groups, out_features), None),
            "g_idx": TensorSpec("g_idx", (in_features,), "I32"),
        }

    def _zero_offset_word(self) -> int:
        return packing.repeated_word(1, self.bits) if self.checkpoint_format == V1 else 0

    def decode(self, tensors: Mapping[str, torch.Tensor]) -> QuantizedWeight:
        # Transpose the packed words (b/8 of the bytes of the codes), then unpack along the rows.
        codes = packing.unpack(tensors["qweight"].T.contiguous(), self.bits, dim=1)
        in_features = codes.shape[1]
        group_size = effective_group_size(in_features, self.group_size)
        g_idx = tensors.get("g_idx")
        if g_idx is not None and not torch.equal(
            g_idx.to(torch.int64), torch.arange(in_features, dtype=torch.int64) // group_size
        ):
            raise MoeconvError(
                "g_idx is not the trivial k // group_size (act-order, desc_act=true); "
                "moeconv does not convert act-order checkpoints yet"
            )
        zeros = None
        if not self.sym:
            true_words = packing.add_to_words(tensors["qzeros"], self._zero_offset_word())
            zeros = packing.unpack(true_words, self.bits, dim=1).T.contiguous()
        return QuantizedWeight(
            codes=codes,
            zeros=zeros,
            scales=tensors["scales"].T.contiguous(),
            bits=self.bits,
            group_size=group_size,
        )

    def encode(self, weight: QuantizedWeight) -> dict[str, torch.Tensor]:
        """Writes what GPTQModel writes: v1 zeros as true-zero words minus the repeated-ones word."""
        true_words = packing.pack(weight.effective_zeros().T, self.bits, dim=1, container=torch.int32)
        return {
            "qweight": packing.pack(weight.codes.T, self.bits, dim=0, container=torch.int32),
            "qzeros": packing.add_to_words(true_words, -self._zero_offset_word()),
            "scales": weight.scales.T.contiguous(),
            "g_idx": torch.arange(weight.in_features, dtype=torch.int32) // weight.group_size,
        }

    @property
    def has_ambiguous_zeros(self) -> bool:
        """v1 asymmetric: a true zero of 0 has no clean v1 encoding (see module doc)."""
        return not self.sym and self.checkpoint_format == V1

    def suspicious_zero_slots(self, qzeros: torch.Tensor) -> int:
        """v1 asymmetric only: stored zero slots that are all ones, i.e. true zero 0 (see module doc)."""
        if not self.has_ambiguous_zeros:
            return 0
        return int((packing.unpack(qzeros, self.bits, dim=1) == (1 << self.bits) - 1).sum())

    def describe(self) -> dict[str, Any]:
        return {
            "method": "gptq",
            "bits": self.bits,
            "group_size": self.group_size,
            "sym": self.sym,
            "checkpoint_format": self.checkpoint_format,
        }

    def quantization_config(self) -> dict[str, Any]:
        return {
            "quant_method": "gptq",
            "bits": self.bits,
            "group_size": self.group_size,
            "sym": self.sym,
            "desc_act": False,
            "checkpoint_format": self.checkpoint_format,
            "format": self.checkpoint_format,
        }
