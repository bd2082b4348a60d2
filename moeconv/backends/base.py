"""What every backend provides."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch

from moeconv.canonical import LinearShape, MoELayerShape, QuantizedWeight
from moeconv.spec import TensorSpec


# The two GEMMs of a fused MoE layer and the canonical projections each is made of (gate rows first).
FUSED_GEMMS = {"w13": ("gate", "up"), "w2": ("down",)}


class ExpertWeights(NamedTuple):
    gate: QuantizedWeight
    up: QuantizedWeight
    down: QuantizedWeight


class Numerics(NamedTuple):
    """How `verify` checks a backend's numerics: the reference kernel that computes the fused MoE (a key
    of moeconv.kernels.runners.LAYER_KERNELS), reading the backend's own tensors, or (`layout`) those of
    the named backend the output is re-encoded into through the canonical form."""

    kernel: str
    layout: str | None = None


class Serving(NamedTuple):
    """Which engine loads a backend's output as it is on disk, and how (`how` may name `{output}`); engine
    None: none does yet, and `how` says why and the way out. What the docs measured with `make test-engines`."""

    engine: str | None
    how: str


def vllm_serve(layer: MoELayerShape) -> str:
    """The `vllm serve` line for an output folder, at the tensor-parallel size it was checked for."""
    return "vllm serve {output}" + (f" --tensor-parallel-size {layer.tp}" if layer.tp > 1 else "")


class Backend(Protocol):
    name: str
    layout_version: int
    targets: dict[str, str]  # the engine and kernel-package versions the output is for
    numerics: Numerics

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

    def serving(self, layer: MoELayerShape) -> Serving:
        """Which engine serves this layout for the layer (layer.tp: the size it is served with)."""


class DenseLinearBackend(Backend, Protocol):
    """A backend whose scheme covers the whole checkpoint (`converts_dense_linears = True`): dense
    quantized linears (attention, shared experts, dense MLPs) are converted too, and its config is the
    checkpoint's own quantization_config rather than a section of moeconv's."""

    converts_dense_linears: bool

    def linear_refusal(self, linear: LinearShape) -> str | None:
        """Why this backend cannot take the dense linear, or None if it can."""

    def linear_tensors(self, linear: LinearShape) -> list[TensorSpec]:
        """The tensors of one dense linear; suffixes are appended to the linear's module path."""

    def encode_linear(self, weight: QuantizedWeight, linear: LinearShape) -> dict[str, torch.Tensor]: ...

    def decode_linear(self, tensors: dict[str, torch.Tensor], linear: LinearShape) -> QuantizedWeight: ...

    def checkpoint_quantization_config(self, layer: MoELayerShape, model_dtype: str | None,
                                       unquantized_modules: list[str]) -> dict[str, Any]:
        """The whole `quantization_config`; `unquantized_modules` are the linears left in float."""


def converts_dense_linears(backend: Backend) -> bool:
    """Backends without the attribute leave dense linears to pass through."""
    return bool(getattr(backend, "converts_dense_linears", False))
