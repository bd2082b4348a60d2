"""DeepSeek-V4's FP4 routed experts under its FP8 config (`expert_dtype: fp4`), as transformers 5.24.0 and vLLM (the
release moeconv/engines names) read them (docs/FLOAT_SOURCES.md section 6: transformers `integrations/finegrained_fp8.py` `FP8Experts`,
`Fp8Dequantize`; vLLM `models/deepseek_v4/quant_config.py`, `models/deepseek_v4/*/model.py`).

Per routed expert linear `layers.L.ffn.experts.E.w{1,2,3}` (N out, K in; w1 gate, w3 up, w2 down):

  weight  I8 (N, K/2): two E2M1 codes a byte, element 2j in the low nibble of byte j (the bytes are those of
          compressed-tensors' weight_packed; safetensors calls them I8)
  scale   F8_E8M0 (N, K/32): one UE8M0 scale per 32 inputs of a row, 2^(b - 127)

The codes and scale bytes go into the canonical float form (MXFP4) as they are; a scale byte 0xFF (NaN in E8M0:
torch's float8_e8m0fnu reads it as NaN) is refused naming the tensor. The dense linears beside them (attention,
shared experts: `weight` F8_E4M3 with a `scale` F8_E8M0 per 128 x 128 tile) are not this format's: the plan
describes or refuses them (survey.fp8_block_linears).

The config: `quant_method: fp8` with `fmt: e4m3`, `scale_fmt: ue8m0`, `weight_block_size: [128, 128]`,
`activation_scheme: dynamic`, and `expert_dtype: fp4` (DeepSeek-V4 writes it at the top of config.json, V4.1 in the
quantization config; transformers moves V4's into it, configuration_deepseek_v4.py, and so does the survey). An FP8
config without `expert_dtype: fp4` holds FP8 experts (DeepSeek-V4-Flash-Base, DeepSeek-V3), which moeconv does not
read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


from moeconv.errors import MoeconvError
from moeconv.formats.float_linear import Mxfp4Pair
from moeconv.float_codes import MXFP4, FloatScheme

METHOD = "fp8"
WEIGHT, SCALE = "weight", "scale"
BLOCK = 32
# What DeepSeek-V4's FP4-expert config says (vLLM's DeepseekV4FP8Config.from_config writes the same for the
# checkpoints it reroutes, "the runtime layout matches the DeepSeek-native fp8 checkpoint"): each value changes
# what the bytes mean, so any other is refused.
CONFIG = {"fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
KNOWN = {"quant_method", "expert_dtype", *CONFIG, "ignored_layers", "modules_to_not_convert"}
# docs/FLOAT_SOURCES.md section 6: what blocks the normalised compressed-tensors output
UNCONVERTED = (
    "DeepSeek-V4's FP4 experts are read exactly, but its FP8 dense linears (attention, shared experts) carry one "
    "E8M0 `scale` per 128x128 tile, which compressed-tensors' FP8_BLOCK group stores as a float `weight_scale` "
    "(an exact rewrite moeconv does not do yet), and no engine has been shown to serve a compressed-tensors "
    "DeepSeek-V4; vLLM serves the checkpoint as it is (quant_method fp8 with expert_dtype fp4: its "
    "deepseek_v4_fp8 method, Mxfp4MoEMethod for the experts)")


@dataclass(frozen=True)
class DeepSeekV4Fp4(Mxfp4Pair):
    codes = (WEIGHT, "I8")
    scale = (SCALE, "F8_E8M0")
    evidence = "DeepSeek-V4 FP4 experts"
    method: str = METHOD
    float_scheme: FloatScheme = MXFP4
    unconverted: str | None = UNCONVERTED

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str) -> DeepSeekV4Fp4:
        field = f"{where}: quantization_config"
        if config.get("expert_dtype") != "fp4":
            raise MoeconvError(f"{field}: quant_method 'fp8' with expert_dtype {config.get('expert_dtype')!r}: moeconv "
                               f"reads DeepSeek-V4's FP4 experts under an FP8 config (expert_dtype 'fp4'), not FP8 "
                               f"experts")
        for key, value in CONFIG.items():
            if config.get(key) != value:
                raise MoeconvError(f"{field}.{key} is {config.get(key)!r}; DeepSeek-V4's FP8 config with FP4 experts "
                                   f"says {value!r}")
        other = sorted(set(config) - KNOWN)
        if other:
            raise MoeconvError(f"{field}: key {other[0]!r} is not one DeepSeek-V4's FP8 config has; refusing rather "
                               f"than ignoring it")
        return cls()

    def describe(self) -> dict[str, Any]:
        return {"method": self.method, "producer": "DeepSeek-V4 (expert_dtype fp4 under its FP8 config)", "bits": 4,
                "group_size": BLOCK, "symmetric": True, "codes": self.float_scheme.describe(),
                "dense_linears": "FP8 E4M3, one E8M0 scale per 128x128 tile"}

    def quantization_config(self) -> dict[str, Any]:
        return {"quant_method": self.method, **CONFIG, "expert_dtype": "fp4"}
