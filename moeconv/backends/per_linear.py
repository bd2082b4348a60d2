"""What the whole-checkpoint schemas (`humming`, `compressed-tensors`) share: every quantized linear is
converted on its own, routed experts per expert and projection under the checkpoint's own names
(`<module>.<e>.<projection>.<suffix>`), dense quantized linears under theirs. A subclass says how ONE
linear is laid out (`linear_tensors`, `encode_linear`, `decode_linear`) and what its config is."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from moeconv import packing
from moeconv.backends.base import BackendDefaults, ExpertWeights, LinearLayout, Numerics
from moeconv.spec import TensorSpec
from moeconv.canonical import PROJECTIONS, LinearShape, MoELayerShape, QuantizedWeight

if TYPE_CHECKING:
    from moeconv.float_codes import FloatWeight
    from moeconv.packed import PackedWeight


class PerLinearBackend(BackendDefaults):
    """A backend and its own linear layout in one: an expert is its three projections, each laid out as a
    dense linear is (`LinearLayout`)."""

    fp8_block_suffixes: dict[str, str] | None = None
    # The engines' kernels for these schemas compute the same GEMMs as the Triton kernel on the stacked
    # layout, so verify re-encodes the output into that layout through the canonical form.
    numerics = Numerics("triton", layout="triton")

    @property
    def linear_layout(self) -> LinearLayout:
        return self

    def from_float_linear(self, weight: FloatWeight, linear: LinearShape) -> dict[str, np.ndarray]:
        raise NotImplementedError(f"backend {self.name!r} takes no float codes")

    def layer_tensors(self, layer: MoELayerShape) -> list[TensorSpec]:
        return [spec._replace(name=f"{name}.{spec.name}", per_expert=True, derives_from=(projection,))
                for name, projection, linear in zip(layer.projection_names, PROJECTIONS, projection_shapes(layer))
                for spec in self.linear_tensors(linear)]

    def encode_expert(self, expert: ExpertWeights, layer: MoELayerShape) -> dict[str, np.ndarray]:
        return {f"{name}.{suffix}": tensor
                for name, projection, linear in zip(layer.projection_names, PROJECTIONS, projection_shapes(layer))
                for suffix, tensor in self.encode_linear(getattr(expert, projection), linear).items()}

    def takes_packed(self, layer: MoELayerShape | LinearShape) -> bool:
        return layer.activation_bits == 16  # W8A8's int8 codes are not packed

    def from_packed(self, expert: dict[str, PackedWeight], layer: MoELayerShape) -> dict[str, np.ndarray]:
        return {f"{name}.{suffix}": array
                for name, projection, linear in zip(layer.projection_names, PROJECTIONS, projection_shapes(layer))
                for suffix, array in self.from_packed_linear(expert[projection], linear).items()}

    def decode_expert(self, slices: dict[str, np.ndarray], layer: MoELayerShape) -> ExpertWeights:
        decoded = {}
        for name, projection, linear in zip(layer.projection_names, PROJECTIONS, projection_shapes(layer)):
            prefix = f"{name}."
            own = {key[len(prefix):]: tensor for key, tensor in slices.items() if key.startswith(prefix)}
            decoded[projection] = self.decode_linear(own, linear)
        return ExpertWeights(**decoded)


def per_rank_refusal(layer: MoELayerShape, check) -> str | None:
    """The tensor-parallel split, then `check(what, size)` for the two K's one rank holds (H for gate and
    up, I / tp for down; the same sizes are the N's of the other GEMM)."""
    if layer.intermediate % layer.tp:
        return f"intermediate size {layer.intermediate} does not split over tp={layer.tp}"
    for what, size in (("hidden size", layer.hidden), ("intermediate size per rank", layer.intermediate_per_rank)):
        reason = check(what, size)
        if reason:
            return reason
    return None


def projection_shapes(layer: MoELayerShape) -> tuple[LinearShape, LinearShape, LinearShape]:
    """gate, up, down of one expert, as standalone linears (these schemas do not fuse them on disk)."""
    def linear(out_features: int, in_features: int) -> LinearShape:
        return LinearShape(out_features, in_features, layer.bits, layer.group_size, layer.symmetric,
                           layer.scale_dtype, layer.activation_bits, layer.float_scheme)

    gate_up = linear(layer.intermediate, layer.hidden)
    return gate_up, gate_up, linear(layer.hidden, layer.intermediate)


def packed_words(weight: QuantizedWeight) -> tuple[np.ndarray, np.ndarray | None]:
    """The word layout both schemas use: codes packed along K into int32 (N, K·b/32), value j of each
    word at bits [j·b, j·b + b); TRUE zero points packed along N the same way (N·b/32, G), or None."""
    codes = packing.pack_array(weight.codes, weight.bits, axis=1, container=np.int32)
    zeros = None if weight.zeros is None else packing.pack_array(weight.zeros, weight.bits, axis=0, container=np.int32)
    return codes, zeros


def from_packed_words(codes: np.ndarray, zeros: np.ndarray | None, scales: np.ndarray,
                      linear: LinearShape) -> QuantizedWeight:
    """Inverse of `packed_words`."""
    return QuantizedWeight(codes=packing.unpack_array(codes, linear.bits, axis=1),
                           zeros=None if zeros is None else packing.unpack_array(zeros, linear.bits, axis=0),
                           scales=scales, bits=linear.bits, group_size=linear.effective_group_size)
