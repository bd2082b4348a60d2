"""A vLLM plugin that serves moeconv's stacked `triton` outputs as they are on disk.

`pip install moeconv` next to vLLM registers it (entry point `vllm.general_plugins`: moeconv =
moeconv.vllm_plugin:register). A `--backend triton` output's config says `quant_method: "moeconv"`;
with the plugin, `vllm serve OUT` creates each MoE layer's parameters with exactly the shapes and
dtypes moeconv wrote, loads each stacked tensor with one copy (this rank's slice of it under tensor
parallelism), does nothing after loading, and runs vLLM's own moe_wna16 Triton experts on them. The
dense layers load through the source's own quantization method, which the config records.

`register` also wraps vLLM's default loader so a tensor named `<layer>.<stacked name>` goes straight to
its parameter (model classes' own `load_weights` know only per-expert and fused names).

This module imports no vLLM; `register` imports `moeconv.vllm_plugin.method`, which does.
`shards.py` holds the tensor-parallel slicing, vLLM-free, so it is tested without vLLM.
"""

from __future__ import annotations

QUANT_METHOD = "moeconv"


def register() -> None:
    """vLLM calls this at start-up (in every process) for each `vllm.general_plugins` entry point."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    from moeconv.vllm_plugin.method import MoeconvConfig, route_stacked_tensors

    register_quantization_config(QUANT_METHOD)(MoeconvConfig)
    route_stacked_tensors()
