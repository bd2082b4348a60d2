"""A vLLM plugin that serves moeconv's stacked `triton` outputs on the MoE backend vLLM itself would pick.

`pip install moeconv` next to vLLM registers it (entry point `vllm.general_plugins`: moeconv =
moeconv.engines.vllm_plugin:register). A `--backend triton` output's config says `quant_method: "moeconv"`;
with the plugin, `vllm serve OUT` parses that config strictly, serves each MoE layer with the method
vLLM builds for the `compressed-tensors` output of the same source (so vLLM's own oracle picks the
backend for the machine: Humming on Hopper, Marlin, Triton, vLLM's CPU experts; `--moe-backend`
overrides it), fills that method's parameters by one copy of this rank's part of each stacked tensor,
and lets its own post-load repack run. The dense layers load through the source's own quantization
method, which the config records.

`register` also wraps vLLM's default loader so a tensor named `<layer>.<stacked name>` goes straight to
its parameter (model classes' own `load_weights` know only per-expert and fused names).

This module imports no vLLM; `register` imports `moeconv.engines.vllm_plugin.method`, which does. `config.py`
(the config's parsing) and `shards.py` (which part of a stacked tensor fills which parameter, per
tensor-parallel rank) are vLLM-free, so they are tested without vLLM.
"""

from __future__ import annotations

from moeconv.backends.triton_config import QUANT_METHOD


def register() -> None:
    """vLLM calls this at start-up (in every process) for each `vllm.general_plugins` entry point."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    from moeconv.engines.vllm_plugin.method import MoeconvConfig, route_stacked_tensors

    register_quantization_config(QUANT_METHOD)(MoeconvConfig)
    route_stacked_tensors()
