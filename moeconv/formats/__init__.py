"""Source checkpoint formats: one module per format, each a small frozen dataclass holding the
format's parameters (read from the checkpoint's quantization config) that decodes one linear's
tensors to the canonical form and encodes them back (the encoder makes synthetic checkpoints).

Formats map tensors to tensors; they know nothing of files, backends or each other.
"""

from __future__ import annotations

from typing import Any, Mapping

from moeconv.errors import MoeconvError
from moeconv.formats.autoround import AutoRound
from moeconv.formats.awq import AWQ
from moeconv.formats.base import SourceFormat
from moeconv.formats.compressed_tensors import CompressedTensors
from moeconv.formats.compressed_tensors_float import MXFP4_FORMAT, NVFP4_FORMAT, CompressedTensorsFloat
from moeconv.formats.deepseek_v4_fp4 import DeepSeekV4Fp4
from moeconv.formats.gpt_oss_mxfp4 import GptOssMxfp4
from moeconv.formats.gptq import GPTQ
from moeconv.formats.modelopt import ModelOpt
from moeconv.formats.modelopt_nvfp4 import ModelOptNvfp4

# quant_method in the checkpoint's config -> the class that reads it (AutoRound's reads its config into
# the GPTQ or AWQ format its packing names); "quant_method:scheme" where a method's config names a scheme
# another class reads (its `format`, a config group's `format`, or ModelOpt's `quant_algo`).
REGISTRY: dict[str, type] = {"awq": AWQ, "gptq": GPTQ, "compressed-tensors": CompressedTensors,
                             "auto-round": AutoRound, "intel/auto-round": AutoRound, "modelopt": ModelOpt,
                             f"compressed-tensors:{NVFP4_FORMAT}": CompressedTensorsFloat,
                             f"compressed-tensors:{MXFP4_FORMAT}": CompressedTensorsFloat,
                             "modelopt:NVFP4": ModelOptNvfp4, "mxfp4": GptOssMxfp4,
                             "fp8": DeepSeekV4Fp4}  # FP4 experts under DeepSeek-V4's FP8 config only


def format_from_config(config: Mapping[str, Any], where: str) -> SourceFormat:
    """The source format a `quantization_config` (or quantize_config.json) describes."""
    method = str(config.get("quant_method", "")).lower()
    if method not in REGISTRY:
        supported = ", ".join(sorted(name for name in REGISTRY if ":" not in name))
        raise MoeconvError(
            f"{where}: unsupported quant_method {method or '(missing)'!r}; supported: {supported}"
        )
    schemes = [f"{method}:{name}" for name in _schemes_named(config)]
    return REGISTRY[next((key for key in schemes if key in REGISTRY), method)].from_config(config, where)


def _schemes_named(config: Mapping[str, Any]) -> list[str]:
    """The scheme names a config gives: its `quant_algo` and `format`, and each config group's `format`."""
    groups = config.get("config_groups")
    named = [config.get("quant_algo"), config.get("format")]
    named += [group.get("format") for group in groups.values() if isinstance(group, Mapping)] \
        if isinstance(groups, Mapping) else []
    return [name for name in named if isinstance(name, str)]


__all__ = ["AWQ", "AutoRound", "CompressedTensors", "CompressedTensorsFloat", "DeepSeekV4Fp4", "GPTQ", "GptOssMxfp4", "ModelOpt", "ModelOptNvfp4",
           "REGISTRY", "SourceFormat", "format_from_config"]
