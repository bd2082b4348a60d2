"""The Triton `moe_wna16` layout (vLLM `TritonWNA16Experts`, moeconv's own reference kernel).

Per MoE layer, experts stacked, gate/up fused gate rows first (vllm-layouts.md §3.1):
  w13_qweight uint8 (E, 2I, H·b/8): 4-bit byte [e, n, j] = c[n, 2j] | c[n, 2j+1] << 4; 8-bit one code a byte
  w13_scales  (E, 2I, H/g) in the source dtype
  w13_qzeros  uint8 (E, 2I·b/8, H/g), asymmetric only, TRUE zeros, 4-bit: even n in the low nibble
  w2_qweight, w2_scales, w2_qzeros likewise with N = H, K = I.
"""

from __future__ import annotations

from typing import Any

import torch

from moeconv import packing
from moeconv.backends.base import ExpertWeights, TensorSpec
from moeconv.canonical import MoELayerShape, QuantizedWeight


class TritonBackend:
    name = "triton"
    layout_version = 1

    def refusal(self, layer: MoELayerShape) -> str | None:
        if layer.bits not in (4, 8):
            return f"the moe_wna16 kernels take 4- or 8-bit weights, not {layer.bits}-bit"
        if layer.bits == 4 and (layer.hidden % 2 or layer.intermediate % 2):
            return "4-bit packing needs even hidden and intermediate sizes"
        for in_features in (layer.hidden, layer.intermediate):
            if in_features % layer.group_size_for(in_features):
                return f"group size {layer.group_size} does not divide {in_features}"
        return None

    def layer_tensors(self, layer: MoELayerShape) -> list[TensorSpec]:
        specs = []
        per_byte = 8 // layer.bits
        for prefix, out_features, in_features in (
            ("w13", 2 * layer.intermediate, layer.hidden),
            ("w2", layer.hidden, layer.intermediate),
        ):
            groups = in_features // layer.group_size_for(in_features)
            e = layer.experts
            specs.append(TensorSpec(f"{prefix}_qweight", (e, out_features, in_features // per_byte), "U8"))
            specs.append(TensorSpec(f"{prefix}_scales", (e, out_features, groups), layer.scale_dtype))
            if not layer.symmetric:
                specs.append(TensorSpec(f"{prefix}_qzeros", (e, out_features // per_byte, groups), "U8"))
        return specs

    def encode_expert(self, expert: ExpertWeights) -> dict[str, torch.Tensor]:
        slices = {}
        for prefix, rows in (("w13", (expert.gate, expert.up)), ("w2", (expert.down,))):
            # Pack each projection, then stack the packed rows (gate first): smaller than stacking codes.
            slices[f"{prefix}_qweight"] = torch.cat(
                [packing.pack(w.codes, w.bits, dim=1, container=torch.uint8) for w in rows])
            slices[f"{prefix}_scales"] = torch.cat([w.scales for w in rows])
            if rows[0].zeros is not None:
                zeros = torch.cat([w.zeros for w in rows])
                slices[f"{prefix}_qzeros"] = packing.pack(zeros, rows[0].bits, dim=0, container=torch.uint8)
        return slices

    def decode_expert(self, slices: dict[str, torch.Tensor], layer: MoELayerShape) -> ExpertWeights:
        decoded = {}
        for prefix in ("w13", "w2"):
            codes = packing.unpack(slices[f"{prefix}_qweight"], layer.bits, dim=1)
            zeros_packed = slices.get(f"{prefix}_qzeros")
            zeros = None if zeros_packed is None else packing.unpack(zeros_packed, layer.bits, dim=0)
            decoded[prefix] = QuantizedWeight(
                codes=codes,
                zeros=zeros,
                scales=slices[f"{prefix}_scales"],
                bits=layer.bits,
                group_size=layer.group_size_for(codes.shape[1]),
            )
        gate, up = _split_rows(decoded["w13"], layer.intermediate)
        return ExpertWeights(gate=gate, up=up, down=decoded["w2"])

    def quantization_config(self, layer: MoELayerShape) -> dict[str, Any]:
        return {
            "bits": layer.bits,
            "group_size": layer.group_size,
            "has_zp": not layer.symmetric,
            "layout": "moe_wna16",
            "weight_bits_order": "even k in the low nibble" if layer.bits == 4 else "one code per byte",
        }


def _split_rows(weight: QuantizedWeight, rows: int) -> tuple[QuantizedWeight, QuantizedWeight]:
    def part(index: slice) -> QuantizedWeight:
        zeros = None if weight.zeros is None else weight.zeros[index].contiguous()
        return QuantizedWeight(
            codes=weight.codes[index].contiguous(),
            zeros=zeros,
            scales=weight.scales[index].contiguous(),
            bits=weight.bits,
            group_size=weight.group_size,
        )

    return part(slice(0, rows)), part(slice(rows, None))
