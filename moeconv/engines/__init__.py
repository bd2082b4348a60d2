"""The engines moeconv's outputs are served by: one module per engine release (`vllm_0_33.py`,
`sglang_0_5_23.py`), each declaring an `EngineRelease` (engines/base.py) with every "this release serves,
refuses, casts" fact, and each engine's plugin (`vllm_plugin/`, `sglang_plugin/`: the entry points
`vllm.general_plugins` and `sglang.srt.plugins`). The plan asks the releases named here; moving to a new
release is its module and its line below.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping

from moeconv.engines import sglang_0_5_23, vllm_0_33
from moeconv.engines.base import FLOAT_CODES, EngineRelease, Output, Serving

if TYPE_CHECKING:
    from moeconv.canonical import MoELayerShape
    from moeconv.formats import SourceFormat

VLLM: EngineRelease = vllm_0_33.RELEASE
SGLANG: EngineRelease = sglang_0_5_23.RELEASE
# Both plugins read the triton output's config, made for vLLM's loaders: the dense layers it copies are held
# to that release's (SGLang's own methods for them were not run on these outputs).
_dense_refusal = vllm_0_33.dense_refusal


def output_of(backend: str, layer: MoELayerShape, source_format: SourceFormat, dense_converted: bool,
              source_config: Mapping[str, Any] | None = None, model_type: str = "", attention_quantized: bool = False,
              model_dtype: str | None = None, model_config: Mapping[str, Any] | None = None) -> Output:
    """The question every release is asked (Output's fields), with why its copied dense layers load nowhere."""
    output = Output(backend, layer, source_format, dense_converted, source_config, model_type, attention_quantized,
                    model_dtype, model_config)
    return replace(output, dense_refusal=_dense_refusal(output))


def targets(backend: str, float_codes: bool = False) -> dict[str, str]:
    """What an output of the backend records it is for (moeconv.json's `targets`): the vLLM release's, whose
    kernels the layouts were built for (its entry for the backend's float layouts where it names one apart:
    FLOAT_CODES); {} for a backend no release names."""
    apart = f"{backend}{FLOAT_CODES}"
    return dict(VLLM.targets.get(apart if float_codes and apart in VLLM.targets else backend, {}))


__all__ = ["EngineRelease", "Output", "SGLANG", "Serving", "VLLM", "output_of", "targets"]
