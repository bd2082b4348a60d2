"""NVIDIA ModelOpt's INT4 export (quant_method "modelopt", quant_algo "W4A16_AWQ").

What `export_hf_checkpoint` of nvidia-modelopt 0.47.0 writes for every 4-bit integer linear (its
`quant_utils.pack_int4_in_uint8` and `get_scaling_factor`; measured on its own output,
tests/packers/make_modelopt.py):

  weight           uint8 (N/2, K): signed codes q in [-8, 7] packed along N, two's-complement nibbles,
                   row 2m in the low nibble of byte (m, k) and row 2m+1 in the high one
  weight_scale     float32 (N, K/g): the amax of each block of g inputs / 7; no zero points (symmetric)
  pre_quant_scale  (K,) in the model dtype, AWQ only: the exported layer computes (x · s) · Wᵀ

The canonical codes are q + 8 (each nibble with its top bit flipped), zeros None (the implicit 8),
scales as stored. ModelOpt names every 4-bit integer block quantizer "int4_awq", so a checkpoint
calibrated without AWQ is W4A16_AWQ too; its hf_quant_config.json says `pre_quant_scale: true` even
when no linear stores one. The config (config.json's `quantization_config`, completed by
hf_quant_config.json's `quantization`: reader.py) carries `quant_algo`, `group_size` and
`has_zero_point`.

`pre_quant_scale` scales the layer's input channels at run time. No layout moeconv writes has a place
for it (the canonical form is the weight alone), and folding it into the codes would change them, so
a linear whose pre_quant_scale is not exactly 1 is refused, naming the reason and the linears: every
routed expert's is read up front (detection), a dense linear's when a backend converts it. One that
is all ones means nothing and is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from moeconv import packing
from moeconv.canonical import QuantizedWeight
from moeconv.errors import MoeconvError
from moeconv.formats.base import (
    Detection,
    FormatDefaults,
    Linear,
    Read,
    SourceFormat,
    check_headers,
    checked_group_size,
    config_bool,
    config_int,
    effective_group_size,
    group_size_from_shapes,
    groups_of,
)
from moeconv.spec import TensorSpec

QUANT_ALGO = "W4A16_AWQ"
PRE_QUANT_SCALE = "pre_quant_scale"
SIGN_FLIP = 0x8  # a two's-complement nibble XOR 8 is the offset-binary code q + 8
SHOWN = 3  # linears named in a refusal


def _scale_refusal(names: list[str], total: int) -> str:
    shown = ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
    return (f"{PRE_QUANT_SCALE} is not 1 on {len(names)} of {total} linears ({shown}): ModelOpt's AWQ scales "
            f"these linears' input channels at run time, which no layout moeconv writes can hold, and dropping "
            f"it would change every output; refusing rather than converting without it (a ModelOpt export "
            f"calibrated without AWQ, e.g. INT4_BLOCKWISE_WEIGHT_ONLY_CFG, stores none)")


@dataclass(frozen=True)
class ModelOpt(FormatDefaults):
    group_size: int = 128
    bits: int = 4
    method: str = "modelopt"
    activation_bits = 16  # class attributes, not fields: W4A16 is weight-only and symmetric
    vector_suffixes = (PRE_QUANT_SCALE,)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str) -> ModelOpt:
        algo = config.get("quant_algo")
        if algo != QUANT_ALGO:
            raise MoeconvError(f"{where}: ModelOpt quant_algo {algo!r} is not read: moeconv reads ModelOpt's 4-bit "
                               f"integer weights ({QUANT_ALGO!r}) and its NVFP4; its FP8, MXFP4, W4A8 and mixed-precision "
                               f"exports are other formats")
        if config_bool(config, "has_zero_point", False, where):
            raise MoeconvError(f"{where}: ModelOpt has_zero_point true: its int4 export stores no zero points "
                               f"(quant_utils.pack_int4_in_uint8), so this config describes data moeconv cannot read")
        return cls(group_size=checked_group_size(config_int(config, "group_size", 128, where), where))

    @property
    def symmetric(self) -> bool:
        return True

    def suffixes(self) -> tuple[str, ...]:
        return ("weight", "weight_scale")

    def optional_suffixes(self) -> tuple[str, ...]:
        return (PRE_QUANT_SCALE,)

    @classmethod
    def claims(cls, linears: list[Linear]) -> bool:
        """weight (N/2, K): two 4-bit codes per byte along N, beside weight_scale (N, G)."""
        return bool(linears) and all(
            {"weight", "weight_scale"} <= set(tensors) and tuple(tensors["weight"].shape) == (n // 2, k)
            and tensors["weight_scale"].shape[:1] == (n,) for tensors, n, k in linears)

    @classmethod
    def from_data(cls, linears: list[Linear], configured: SourceFormat, read: Read,
                  detection: Detection) -> ModelOpt | None:
        """The group size from the scales; every routed expert's pre_quant_scale read, and the checkpoint
        refused if any is not 1 (see the module doc)."""
        detection.evidence.append(f"weight {list(linears[0][0]['weight'].shape)} holds two 4-bit codes a byte "
                                  f"along N: ModelOpt int4")
        group_size = group_size_from_shapes([(tensors["weight_scale"], 1, k) for tensors, _, k in linears],
                                            configured.group_size, detection)
        if group_size is None:
            return None
        check_headers(linears, cls(group_size=group_size))  # every pre_quant_scale is read below
        stored = [tensors[PRE_QUANT_SCALE] for tensors, _, _ in linears if PRE_QUANT_SCALE in tensors]
        scaled = [entry.name.rsplit(".", 1)[0] for entry in stored if not bool((read(entry) == 1).all())]
        if scaled:
            raise MoeconvError(f"{stored[0].file}: {_scale_refusal(scaled, len(linears))}")
        detection.evidence.append(f"{len(stored)} of {len(linears)} expert linears store a {PRE_QUANT_SCALE}, "
                                  f"all ones" if stored else f"no expert linear stores a {PRE_QUANT_SCALE}")
        return cls(group_size=group_size)

    def linear_shape(self, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, int]:
        return shapes["weight_scale"][0], shapes["weight"][1]

    def expected(self, out_features: int, in_features: int) -> dict[str, TensorSpec]:
        groups = groups_of(in_features, self.group_size)
        return {
            "weight": TensorSpec("weight", (out_features // 2, in_features), "U8"),
            "weight_scale": TensorSpec("weight_scale", (out_features, groups), None),
            PRE_QUANT_SCALE: TensorSpec(PRE_QUANT_SCALE, (in_features,), None),  # AWQ only
        }

    def decode(self, stored: Mapping[str, np.ndarray]) -> QuantizedWeight:
        scale = stored.get(PRE_QUANT_SCALE)
        if scale is not None and not bool((packing.as_float32(scale) == 1).all()):
            raise MoeconvError(_scale_refusal(["this linear"], 1))
        codes = packing.unpack_array(stored["weight"], self.bits, axis=0) ^ np.uint8(SIGN_FLIP)
        return QuantizedWeight(codes=codes, zeros=None, scales=stored["weight_scale"], bits=self.bits,
                               group_size=effective_group_size(codes.shape[1], self.group_size))

    def encode(self, weight: QuantizedWeight) -> dict[str, np.ndarray]:
        if not weight.symmetric:
            raise ValueError("ModelOpt's int4 export is symmetric: it has no zero points to write")
        return {"weight": packing.pack_array(weight.codes ^ np.uint8(SIGN_FLIP), self.bits, axis=0, container=np.uint8),
                "weight_scale": weight.scales}

    def describe(self) -> dict[str, Any]:
        return {"method": "modelopt", "quant_algo": QUANT_ALGO, "bits": self.bits, "group_size": self.group_size,
                "symmetric": True}

    def quantization_config(self) -> dict[str, Any]:
        return {"quant_method": "modelopt", "quant_algo": QUANT_ALGO, "group_size": self.group_size,
                "has_zero_point": False, "pre_quant_scale": True,
                "producer": {"name": "modelopt", "version": "0.47.0"}}
