"""The engines moeconv's outputs are served by: one module per engine release, and each engine's plugin
(`vllm_plugin/`, `sglang_plugin/`: the entry points `vllm.general_plugins` and `sglang.srt.plugins`)."""
