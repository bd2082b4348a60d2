"""The output's `quantization_config` as the SGLang plugin reads it (no SGLang here).

The stacked layout is parsed by the same strict parser as the vLLM plugin's (moeconv.backends.triton_config:
every value that decides how the bytes are read is checked, never coerced, each refusal one line starting
`moeconv:`). What SGLang's MoeWNA16Method cannot hold is refused on top of it: the int8 W8A8 layout (SGLang
has an int8 MoE method only under its own `w8a8_int8` config, whose parameters this plugin does not
fill), channel-wise scales (MoeWNA16Method reads one group size for both GEMMs and divides by it), and
the float layouts (MXFP4 / NVFP4 codes: MoeWNA16Method holds integer codes; SGLang serves them from the
compressed-tensors output with its own methods).
"""

from __future__ import annotations

from typing import Any

from moeconv.backends.triton_config import FLOAT_LAYOUTS, INT8_LAYOUT, PluginRefusal, StackedLayout, parse
from moeconv.engines.sglang_plugin import ENGINE_VERSION


def parse_for_sglang(config: Any) -> StackedLayout:
    """The stacked layout of a moeconv `triton` output, if SGLang's MoeWNA16Method serves it; else a
    PluginRefusal saying why."""
    stacked = parse(config)
    if stacked.layout == INT8_LAYOUT:
        raise PluginRefusal(f"the int8 W8A8 stacked layout is not served on SGLang by this plugin (SGLang "
                            f"{ENGINE_VERSION} serves int8 MoE through its w8a8_int8 method): convert with --backend "
                            "compressed-tensors and serve with --quantization w8a8_int8")
    if stacked.layout in FLOAT_LAYOUTS:
        raise PluginRefusal(f"the {stacked.layout} stacked layout is served by moeconv's vLLM plugin only (SGLang's "
                            f"MoeWNA16Method, which this plugin fills, holds integer codes): convert with --backend "
                            "compressed-tensors, which SGLang loads with its own float MoE methods")
    if stacked.channelwise:
        raise PluginRefusal("channel-wise scales: SGLang's MoeWNA16Method divides both GEMMs by one group size; "
                            "convert with --backend compressed-tensors")
    return stacked


def refusing_config(installed: str) -> type:
    """A config class for an SGLang release this plugin was not built for: it refuses when SGLang builds it
    (the first thing SGLang does with a `moeconv` output), naming both versions."""
    from sglang.srt.layers.quantization.base_config import QuantizationConfig

    class RefusingConfig(QuantizationConfig):
        @classmethod
        def from_config(cls, config: dict[str, Any]) -> RefusingConfig:
            raise PluginRefusal(f"this plugin was built for SGLang {ENGINE_VERSION}, not {installed}; convert "
                                f"with --backend compressed-tensors, or use SGLang {ENGINE_VERSION}")

        @classmethod
        def get_name(cls) -> str:
            return "moeconv"

        @classmethod
        def get_supported_act_dtypes(cls) -> list:
            return []

        @classmethod
        def get_min_capability(cls) -> int:
            return 0

        @staticmethod
        def get_config_filenames() -> list[str]:
            return []

        def get_quant_method(self, layer: Any, prefix: str) -> None:
            return None

        def get_scaled_act_names(self) -> list[str]:
            return []

    return RefusingConfig
