"""NVIDIA ModelOpt's NVFP4 export (quant_method "modelopt", quant_algo "NVFP4"; vLLM's `modelopt_fp4`).

What `export_hf_checkpoint` of nvidia-modelopt 0.47.0 writes for every NVFP4 linear (docs/FLOAT_SOURCES.md
section 4, measured on its output, tests/packers/make_float_modelopt.py):

  weight          uint8 (N, K/2): E2M1 codes, element 2j in the low nibble of byte j
  weight_scale    F8_E4M3 (N, K/16): the block scale
  weight_scale_2  F32 scalar: s2 = amax / (6 · 448), MULTIPLIED by: W = E2M1(c) · s · s2
  input_scale     F32 scalar: the static input global scale, amax(x) / (6 · 448) (NVFP4 is W4A4)

The bytes go into the canonical float form as they are, s2 in ModelOpt's convention: the reciprocal of
compressed-tensors' `weight_global_scale` (float_codes.py). ModelOpt reads code 0x8 as +0.0 where
compressed-tensors reads -0.0: equal as reals, and the code byte is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from moeconv.errors import MoeconvError
from moeconv.float_codes import MULTIPLY, FloatScheme, FloatWeight, nvfp4
from moeconv.formats.base import Detection, FormatDefaults, Linear, Read, SourceFormat, config_int
from moeconv.formats.float_linear import float_weight
from moeconv.spec import TensorSpec

QUANT_ALGO = "NVFP4"
BLOCK = 16
GLOBAL, INPUT = "weight_scale_2", "input_scale"
MODELOPT_VERSION = "0.47.0"


@dataclass(frozen=True)
class ModelOptNvfp4(FormatDefaults):
    method: str = "modelopt"
    bits = 4
    group_size = BLOCK
    activation_bits = 4  # W4A4: each linear stores its static input scale
    float_scheme: FloatScheme = nvfp4(MULTIPLY, True)
    vector_suffixes = (GLOBAL, INPUT)  # scalars

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str) -> ModelOptNvfp4:
        if config.get("quant_algo") != QUANT_ALGO:
            raise MoeconvError(f"{where}: ModelOpt quant_algo {config.get('quant_algo')!r} is not {QUANT_ALGO!r}")
        group_size = config_int(config, "group_size", BLOCK, where)
        if group_size != BLOCK:
            raise MoeconvError(f"{where}: ModelOpt NVFP4 group_size {group_size}: NVFP4 blocks are {BLOCK} wide")
        if config.get("kv_cache_quant_algo") is not None:
            raise MoeconvError(f"{where}: ModelOpt kv_cache_quant_algo {config['kv_cache_quant_algo']!r}: the KV-cache "
                               f"scales are not carried into an output yet; refusing rather than dropping them")
        return cls()

    @property
    def symmetric(self) -> bool:
        return True

    def suffixes(self) -> tuple[str, ...]:
        return ("weight", "weight_scale", GLOBAL, INPUT)

    def optional_suffixes(self) -> tuple[str, ...]:
        return ()

    @classmethod
    def claims(cls, linears: list[Linear]) -> bool:
        """weight bytes (N, K/2), two E2M1 codes each, beside an F8_E4M3 weight_scale and a weight_scale_2."""
        return bool(linears) and all(
            {"weight", "weight_scale", GLOBAL} <= set(tensors) and tensors["weight"].dtype == "U8"
            and tuple(tensors["weight"].shape) == (n, k // 2) and tensors["weight_scale"].dtype == "F8_E4M3"
            for tensors, n, k in linears)

    @classmethod
    def from_data(cls, linears: list[Linear], configured: SourceFormat, read: Read,
                  detection: Detection) -> ModelOptNvfp4 | None:
        blocks = {k // tensors["weight_scale"].shape[1] if len(tensors["weight_scale"].shape) == 2 and
                  tensors["weight_scale"].shape[1] else None for tensors, _, k in linears}
        if blocks != {BLOCK}:
            detection.evidence.append(f"weight_scale columns give blocks of {sorted(map(str, blocks))}, not {BLOCK}")
            return None
        detection.evidence.append(f"weight U8 {list(linears[0][0]['weight'].shape)} (two E2M1 codes a byte), "
                                  f"weight_scale F8_E4M3 per {BLOCK} and {GLOBAL}: ModelOpt NVFP4")
        return cls()

    def linear_shape(self, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, int]:
        out_features, width = shapes["weight"]
        return out_features, width * 2

    def expected(self, out_features: int, in_features: int) -> dict[str, TensorSpec]:
        return {"weight": TensorSpec("weight", (out_features, in_features // 2), "U8"),
                "weight_scale": TensorSpec("weight_scale", (out_features, in_features // BLOCK), "F8_E4M3"),
                GLOBAL: TensorSpec(GLOBAL, (), "F32"), INPUT: TensorSpec(INPUT, (), "F32")}

    def decode(self, stored: Mapping[str, np.ndarray]) -> FloatWeight:
        return float_weight(self.float_scheme, stored["weight"], stored["weight_scale"],
                            {"global_scale": (GLOBAL, stored[GLOBAL]), "input_scale": (INPUT, stored[INPUT])})

    def encode(self, weight: FloatWeight) -> dict[str, np.ndarray]:
        """The canonical float form -> ModelOpt's arrays, the global scales multiplied by (exactly, or refused)."""
        weight = weight.in_convention(MULTIPLY)
        return {"weight": weight.packed, "weight_scale": weight.scales, GLOBAL: weight.global_scale,
                INPUT: weight.input_scale}

    def describe(self) -> dict[str, Any]:
        return {"method": self.method, "quant_algo": QUANT_ALGO, "bits": 4, "group_size": BLOCK, "symmetric": True,
                "codes": self.float_scheme.describe()}

    def quantization_config(self) -> dict[str, Any]:
        return {"quant_method": self.method, "quant_algo": QUANT_ALGO, "group_size": BLOCK,
                "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"],
                "producer": {"name": "modelopt", "version": MODELOPT_VERSION}}
