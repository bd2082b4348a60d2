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
from moeconv.formats.gptq import GPTQ
from moeconv.formats.modelopt import ModelOpt

# quant_method in the checkpoint's config -> the class that reads it (AutoRound's reads its config into
# the GPTQ or AWQ format its packing names).
REGISTRY: dict[str, type] = {"awq": AWQ, "gptq": GPTQ, "compressed-tensors": CompressedTensors,
                             "auto-round": AutoRound, "intel/auto-round": AutoRound, "modelopt": ModelOpt}


def format_from_config(config: Mapping[str, Any], where: str) -> SourceFormat:
    """The source format a `quantization_config` (or quantize_config.json) describes."""
    method = str(config.get("quant_method", "")).lower()
    if method not in REGISTRY:
        supported = ", ".join(sorted(REGISTRY))
        raise MoeconvError(
            f"{where}: unsupported quant_method {method or '(missing)'!r}; supported: {supported}"
        )
    return REGISTRY[method].from_config(config, where)


__all__ = ["AWQ", "AutoRound", "CompressedTensors", "GPTQ", "ModelOpt", "REGISTRY", "SourceFormat", "format_from_config"]
