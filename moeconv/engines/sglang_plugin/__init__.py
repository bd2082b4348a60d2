"""An SGLang plugin that serves moeconv's stacked `triton` outputs through SGLang's own Triton MoE method.

`pip install moeconv` next to SGLang registers it (entry point `sglang.srt.plugins`: moeconv =
moeconv.engines.sglang_plugin:register; SGLang's `load_plugins()` calls it at the start of each of its processes,
filtered by SGLANG_PLUGINS). A `--backend triton` output's config says `quant_method: "moeconv"`; with the
plugin, SGLang parses that config strictly (config.py), serves each MoE layer with SGLang's
`MoeWNA16Method` (`layers/quantization/moe_wna16.py`: its parameters are the stacked tensors under the
same names and layout, TRUE zero points, run by SGLang's Triton MoE runner with no repack), fills each of
them with one copy of this rank's part of the stacked tensor (shards.py), counts what it wrote and refuses
in `process_weights_after_loading`, naming the parameter, when a stacked parameter was never filled. The
dense layers load through the method SGLang builds for the source's own config (or for the
compressed-tensors config moeconv wrote them in, for an asymmetric GPTQ source).

Built for the SGLang release engines/ names only (ENGINE_VERSION). SGLang has no declared way to register a quantization
method: `register` inserts "moeconv" into the module-level dict `QUANTIZATION_METHODS`
(`layers/quantization/__init__.py`), which `ModelConfig._verify_quantization` and
`get_quantization_config` read at call time, and `MoeWNA16Method`'s constructor, `create_weights` and
parameter names are internals; so under any other SGLang release the registered config only refuses,
in one line naming both versions.

This module imports no SGLang until `register` runs; config.py and shards.py are SGLang-free, so they are
tested without SGLang (tests/test_sglang_plugin.py).
"""

from __future__ import annotations

from moeconv.backends.triton_config import QUANT_METHOD
from moeconv.engines import SGLANG

ENGINE_VERSION = SGLANG.version  # the one release whose MoeWNA16Method and loaders this plugin was checked against


def installed_sglang() -> str:
    from importlib.metadata import version

    return version("sglang")


def register() -> None:
    """SGLang calls this in each process (`sglang.srt.plugins.load_plugins`)."""
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS

    if installed_sglang() != ENGINE_VERSION:
        from moeconv.engines.sglang_plugin.config import refusing_config

        QUANTIZATION_METHODS[QUANT_METHOD] = refusing_config(installed_sglang())
        return
    from moeconv.engines.sglang_plugin.method import MoeconvConfig, check_loads

    QUANTIZATION_METHODS[QUANT_METHOD] = MoeconvConfig
    check_loads()
