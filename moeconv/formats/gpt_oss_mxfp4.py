"""gpt-oss's MXFP4 experts (`quant_method: mxfp4`), as transformers 5.24.0 reads them (docs/FLOAT_SOURCES.md
section 5: `integrations/mxfp4.py` `_convert_moe_packed_tensors`, `Mxfp4GptOssExperts`).

On disk the experts are stacked per layer (`mlp.experts.gate_up_proj_blocks [E, 2I, H/32, 16]`, ...); the
architecture's naming scheme (models.py: `StackedExperts`) says which rows of which stacked tensor are one
expert's gate, up or down projection, and the survey hands this module one linear at a time (survey.ExpertSlice),
as the suffixes below (N out, K in):

  blocks  uint8 (N, K/2): 16 bytes a block of 32 codes along K, element 2j in the low nibble of byte j (the
          stored [N, K/32, 16] read as rows of bytes, which it is: the layout of compressed-tensors' weight_packed)
  scales  uint8 (N, K/32): UE8M0, 2^(b - 127)
  bias    float (N,): the linear's bias, stored beside the codes (bf16 in gpt-oss), not quantized

The codes and scale bytes go into the canonical float form as they are (a scale byte 0xFF, reserved for NaN, is
refused naming the tensor; transformers reads it as 2^128). The bias is no part of the quantized weight: it is
read and kept apart (`bias`), and no layout moeconv writes has a place for it yet (backends/compressed_tensors.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from moeconv.errors import MoeconvError
from moeconv.float_codes import MXFP4, FloatScheme
from moeconv.formats.float_linear import Mxfp4Pair
from moeconv.spec import TensorSpec

METHOD = "mxfp4"
BLOCKS, SCALES, BIAS = "blocks", "scales", "bias"
BLOCK = 32
TRANSFORMERS_VERSION = "5.24.0"  # whose reader docs/FLOAT_SOURCES.md section 5 and the fixture's truth come from


@dataclass(frozen=True)
class GptOssMxfp4(Mxfp4Pair):
    codes = (BLOCKS, "U8")
    scale = (SCALES, "U8")
    evidence = "gpt-oss MXFP4"
    modules_to_not_convert: tuple[str, ...] | None = None  # as config.json says; gpt-oss names its unquantized modules
    method: str = METHOD
    float_scheme: FloatScheme = MXFP4
    vector_suffixes = (BIAS,)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str) -> GptOssMxfp4:
        """gpt-oss's `{"quant_method": "mxfp4", "modules_to_not_convert": [...]}`; any other key would say
        something this module does not read, so it is refused."""
        other = sorted(set(config) - {"quant_method", "modules_to_not_convert"})
        if other:
            raise MoeconvError(f"{where}: quantization_config key {other[0]!r} is not one gpt-oss's MXFP4 config has "
                               f"(quant_method, modules_to_not_convert); refusing rather than ignoring it")
        modules = config.get("modules_to_not_convert")
        if modules is not None and (not isinstance(modules, list) or not all(isinstance(m, str) for m in modules)):
            raise MoeconvError(f"{where}: quantization_config.modules_to_not_convert must be a list of module names, "
                               f"not {modules!r}")
        return cls(modules_to_not_convert=None if modules is None else tuple(modules))

    def optional_suffixes(self) -> tuple[str, ...]:
        return (BIAS,)

    def expected(self, out_features: int, in_features: int) -> dict[str, TensorSpec]:
        return {**super().expected(out_features, in_features), BIAS: TensorSpec(BIAS, (out_features,), None)}

    @staticmethod
    def bias(stored: Mapping[str, np.ndarray]) -> np.ndarray | None:
        """The linear's stored bias, as stored (bf16 as its uint16 bit patterns), or None."""
        return stored.get(BIAS)

    def describe(self) -> dict[str, Any]:
        return {"method": self.method, "producer": "gpt-oss (transformers GptOssForCausalLM)", "bits": 4,
                "group_size": BLOCK, "symmetric": True, "codes": self.float_scheme.describe(),
                "modules_to_not_convert": None if self.modules_to_not_convert is None
                else list(self.modules_to_not_convert)}

    def quantization_config(self) -> dict[str, Any]:
        return {"quant_method": self.method,
                "modules_to_not_convert": None if self.modules_to_not_convert is None
                else list(self.modules_to_not_convert)}
