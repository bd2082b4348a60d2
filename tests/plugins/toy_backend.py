"""A toy backend, the whole of it in one module: each layer's experts stacked, codes one per byte,
gate and up rows concatenated into w13 and down into w2, zero points and scales alongside; `from_packed`
takes every packing format's fast path.
Registered by tests/test_plugins.py to prove that a backend needs this module and one registry
entry, and nothing else in moeconv: verify checks its numerics with the Triton kernel by re-encoding
it into the triton layout (`Numerics(layout="triton")`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from moeconv.backends.base import FUSED_GEMMS, BackendDefaults, ExpertWeights, Numerics
from moeconv.canonical import MoELayerShape, QuantizedWeight
from moeconv.packed import PackedWeight
from moeconv.packing import unpack_array
from moeconv.spec import TensorSpec


class ToyBackend(BackendDefaults):
    name = "toy"
    layout_version = 1
    numerics = Numerics("triton", layout="triton")

    def refusal(self, layer: MoELayerShape) -> str | None:
        return None if not layer.symmetric else "the toy layout stores zero points, so asymmetric sources only"

    def layer_tensors(self, layer: MoELayerShape) -> list[TensorSpec]:
        specs = []
        for prefix, rows, k in (("w13", 2 * layer.intermediate, layer.hidden), ("w2", layer.hidden, layer.intermediate)):
            groups = k // layer.group_size_for(k)
            made_of = FUSED_GEMMS[prefix]
            specs += [TensorSpec(f"{prefix}.codes", (layer.experts, rows, k), "U8", derives_from=made_of),
                      TensorSpec(f"{prefix}.zeros", (layer.experts, rows, groups), "U8", derives_from=made_of),
                      TensorSpec(f"{prefix}.scales", (layer.experts, rows, groups), layer.scale_dtype,
                                 derives_from=made_of)]
        return specs

    def encode_expert(self, expert: ExpertWeights, layer: MoELayerShape) -> dict[str, np.ndarray]:
        slices = {}
        for prefix, projections in FUSED_GEMMS.items():
            weights = [getattr(expert, projection) for projection in projections]
            slices[f"{prefix}.codes"] = np.concatenate([w.codes for w in weights])
            slices[f"{prefix}.zeros"] = np.concatenate([w.zeros for w in weights])
            slices[f"{prefix}.scales"] = np.concatenate([w.scales for w in weights])
        return slices

    def takes_packed(self, layer: MoELayerShape) -> bool:
        return True

    def from_packed(self, expert: dict[str, PackedWeight], layer: MoELayerShape) -> dict[str, np.ndarray]:
        """The fast path from every format that packs: the codes unpacked from the words."""
        slices = {}
        for prefix, projections in FUSED_GEMMS.items():
            weights = [expert[projection] for projection in projections]
            slices[f"{prefix}.codes"] = np.concatenate([unpack_array(w.words, w.bits, axis=1) for w in weights])
            slices[f"{prefix}.zeros"] = np.concatenate([w.zero_points() for w in weights])
            slices[f"{prefix}.scales"] = np.concatenate([w.scales for w in weights])
        return slices

    def decode_expert(self, slices: dict[str, np.ndarray], layer: MoELayerShape) -> ExpertWeights:
        decoded = {}
        for prefix, projections in FUSED_GEMMS.items():
            rows = layer.intermediate if prefix == "w13" else layer.hidden
            for index, projection in enumerate(projections):
                part = slice(index * rows, (index + 1) * rows)
                codes = slices[f"{prefix}.codes"][part]
                decoded[projection] = QuantizedWeight(
                    codes=codes, zeros=slices[f"{prefix}.zeros"][part], scales=slices[f"{prefix}.scales"][part],
                    bits=layer.bits, group_size=layer.group_size_for(codes.shape[1]))
        return ExpertWeights(**decoded)

    def quantization_config(self, layer: MoELayerShape) -> dict[str, Any]:
        return {"bits": layer.bits, "group_size": layer.group_size, "layout": "toy-stacked-bytes"}
