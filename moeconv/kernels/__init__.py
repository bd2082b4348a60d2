"""moeconv's Triton fused-MoE kernels (``moe_wna16`` W4A16/W8A16 in `fused_moe`, INT8 W8A8 in `int8_moe`),
their float references (`reference`, `cpu_reference`) and the table `verify` runs them from (`runners`).
Nothing is imported here: `verify --level lossless` reads `runners` without loading torch or Triton."""
