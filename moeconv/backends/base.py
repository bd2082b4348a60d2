"""What every backend provides."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch

from moeconv.canonical import MoELayerShape, QuantizedWeight


class TensorSpec(NamedTuple):
    """An output tensor's suffix (appended to the experts module path), shape and safetensors dtype."""

    suffix: str
    shape: tuple[int, ...]
    dtype: str


class ExpertWeights(NamedTuple):
    gate: QuantizedWeight
    up: QuantizedWeight
    down: QuantizedWeight


class Backend(Protocol):
    name: str
    layout_version: int

    def refusal(self, layer: MoELayerShape) -> str | None:
        """Why this backend cannot take the layer, or None if it can."""

    def layer_tensors(self, layer: MoELayerShape) -> list[TensorSpec]:
        """The stacked tensors of one MoE layer. Dim 0 is the expert, and expert e's slice of every
        tensor is the contiguous e-th block of its bytes, so experts can be written one at a time."""

    def encode_expert(self, expert: ExpertWeights, layer: MoELayerShape) -> dict[str, torch.Tensor]:
        """One expert's slice (without the expert dim) of every tensor of `layer_tensors`. `layer`
        carries what the canonical weights cannot (activation_bits: W8A8 and W8A16 weights are alike)."""

    def decode_expert(self, slices: dict[str, torch.Tensor], layer: MoELayerShape) -> ExpertWeights:
        """Inverse of `encode_expert`."""

    def quantization_config(self, layer: MoELayerShape) -> dict[str, Any]:
        """Backend fields of the output's quantization config."""
