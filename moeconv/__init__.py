"""moeconv: convert quantized MoE checkpoints into the layouts serving kernels read, once, offline, verified."""

__version__ = "0.1.0"
