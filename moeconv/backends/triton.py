"""The Triton `moe_wna16` layout (vLLM `TritonWNA16Experts`, moeconv's own reference kernel).

Per MoE layer, experts stacked, gate/up fused gate rows first (docs/FORMAT.md; vLLM vllm/model_executor/layers/quantization/moe_wna16.py):
  w13_qweight uint8 (E, 2I, H·b/8): 4-bit byte [e, n, j] = c[n, 2j] | c[n, 2j+1] << 4; 8-bit one code a byte
  w13_scales  (E, 2I, H/g) in the source dtype
  w13_qzeros  uint8 (E, 2I·b/8, H/g), asymmetric only, TRUE zeros, 4-bit: even n in the low nibble
  w2_qweight, w2_scales, w2_qzeros likewise with N = H, K = I.

W8A8 INT8 schemes (activation_bits 8) take the int8 layout of vLLM `TritonExperts` (§6) instead:
  w13_weight       int8 (E, 2I, H): the signed weight, i.e. the canonical code − 128
  w13_weight_scale fp32 (E, 2I, 1): per-channel scale; fp16/bf16 -> fp32 is exact, and decoding
                   casts back to the source dtype (MoELayerShape.scale_dtype), so it round-trips
  w2_weight, w2_weight_scale likewise with N = H, K = I. Activations: dynamic per-token int8.

Float-coded experts (float_codes.py: MXFP4, NVFP4) take the float layouts (`layout` "mxfp4" / "nvfp4"): the
parameters of vLLM's compressed-tensors MXFP4 / NVFP4 MoE methods, stacked, which the vLLM plugin fills by copy
(compressed_tensors_moe_w4a4_mxfp4.py, compressed_tensors_moe_w4a4_nvfp4.py :: create_weights):
  w13_weight_packed        uint8 (E, 2I, H/2): the E2M1 codes two a byte, element 2j in the low nibble of byte j
  w13_weight_scale         (E, 2I, H/block): the block scale bytes, U8 (UE8M0, MXFP4) or F8_E4M3 (NVFP4)
  w13_weight_global_scale  NVFP4: F32 (E, 2), gate's and up's, divided by (compressed-tensors' convention)
  w13_input_global_scale   NVFP4 W4A4: F32 (E, 2), the static input global scales, divided by
  w2_* likewise with N = H, K = I; w2's global scales F32 (E,).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from moeconv import packing
from moeconv.backends.compressed_tensors import float_experts_refusal
from moeconv.backends.base import FUSED_GEMMS, BackendDefaults, ExpertWeights, Numerics
from moeconv.spec import TORCH_NAMES, TensorSpec
from moeconv.canonical import LinearShape, MoELayerShape, QuantizedWeight, is_channelwise
from moeconv.float_codes import DIVIDE, FloatWeight

if TYPE_CHECKING:
    from moeconv.packed import PackedWeight


class WNA16Names(NamedTuple):
    """The moe_wna16 tensors of one fused GEMM (`w13` or `w2`)."""

    qweight: str
    scales: str
    qzeros: str


class Int8Names(NamedTuple):
    """The W8A8 int8 tensors of one fused GEMM."""

    weight: str
    weight_scale: str


class FloatNames(NamedTuple):
    """The float-coded tensors of one fused GEMM (the global scales: NVFP4 only, the input's: W4A4 only)."""

    weight_packed: str
    weight_scale: str
    weight_global_scale: str
    input_global_scale: str


# The layout's tensor names, declared once (the backend, kernels/runners.py and the vLLM
# plugin read them here): <gemm>_<part>, e.g. w13_qweight, w2_weight_scale.
WNA16 = {gemm: WNA16Names(*(f"{gemm}_{part}" for part in WNA16Names._fields)) for gemm in FUSED_GEMMS}
INT8 = {gemm: Int8Names(*(f"{gemm}_{part}" for part in Int8Names._fields)) for gemm in FUSED_GEMMS}
FLOAT = {gemm: FloatNames(*(f"{gemm}_{part}" for part in FloatNames._fields)) for gemm in FUSED_GEMMS}

# The `layout` values of the config: the integer ones, and a float scheme's name (float_codes.FloatScheme.name).
WNA16_LAYOUT, INT8_LAYOUT = "moe_wna16", "int8_w8a8"
FLOAT_LAYOUTS = ("mxfp4", "nvfp4")


# What one tensor-parallel rank's share of the intermediate size I is in each tensor's split dimension
# (the vLLM plugin's shards.py): "rows" (output channels), "bytes" (b-bit codes packed along I), "groups"
# (scale or zero groups along I), or None (not split: whole on every rank).
# By layout: the int8 and float layouts share the name w2_weight_scale, split differently.
_FLOAT_SPLITS = {
    FLOAT["w13"].weight_packed: "rows", FLOAT["w13"].weight_scale: "rows",
    FLOAT["w2"].weight_packed: "bytes", FLOAT["w2"].weight_scale: "groups",
    **{names.weight_global_scale: None for names in FLOAT.values()},
    **{names.input_global_scale: None for names in FLOAT.values()},
}
SPLITS = {
    WNA16_LAYOUT: {
        WNA16["w13"].qweight: "rows", WNA16["w13"].scales: "rows", WNA16["w13"].qzeros: "bytes",
        WNA16["w2"].qweight: "bytes", WNA16["w2"].scales: "groups", WNA16["w2"].qzeros: "groups",
    },
    INT8_LAYOUT: {
        INT8["w13"].weight: "rows", INT8["w13"].weight_scale: "rows",
        INT8["w2"].weight: "rows", INT8["w2"].weight_scale: None,
    },
    **{layout: _FLOAT_SPLITS for layout in FLOAT_LAYOUTS},
}
GEMM_OF = {name: gemm for gemm in FUSED_GEMMS for name in (*WNA16[gemm], *INT8[gemm], *FLOAT[gemm])}  # tensor -> GEMM


class TritonBackend(BackendDefaults):
    name = "triton"
    layout_version = 1
    float_global_convention = DIVIDE  # the float layouts' global scales: vLLM's compressed-tensors methods'
    numerics = Numerics("triton", float_kernel="triton-fp4-stacked")

    def dense_linear_backend(self, source_format: Any) -> str | None:
        """vLLM's GPTQ is symmetric only (`AutoGPTQConfig`; the release's `dense_refusal`, engines/), so an
        asymmetric GPTQ source's attention, shared experts and dense MLPs are written in compressed-tensors
        pack-quantized with TRUE zero points (the `compressed-tensors` backend's linears), which vLLM serves;
        the plugin reads them with the config's `dense_quantization_config`."""
        return "compressed-tensors" if source_format.method == "gptq" and not source_format.symmetric else None

    def refusal(self, layer: MoELayerShape) -> str | None:
        if layer.float_scheme is not None:
            return float_experts_refusal(layer)
        if layer.activation_bits == 8:
            return _int8_refusal(layer)
        if layer.bits not in (4, 8):
            return f"the moe_wna16 kernels take 4- or 8-bit weights, not {layer.bits}-bit"
        if layer.intermediate % layer.tp:
            return f"intermediate size {layer.intermediate} does not split over tp={layer.tp}"
        per_rank = layer.intermediate_per_rank
        if layer.bits == 4 and (layer.hidden % 2 or per_rank % 2):
            return f"4-bit packing needs even sizes (hidden {layer.hidden}, intermediate per rank {per_rank})"
        for what, in_features in (("hidden size", layer.hidden), ("intermediate size per rank", per_rank)):
            # The configured g itself (not g capped at K): moe_wna16 reads both GEMMs with one group size.
            if not is_channelwise(layer.group_size) and in_features % layer.group_size:
                return f"group size {layer.group_size} does not divide the {what} {in_features}"
        return None

    def layer_tensors(self, layer: MoELayerShape) -> list[TensorSpec]:
        if layer.float_scheme is not None:
            return _float_layer_tensors(layer)
        if layer.activation_bits == 8:
            return _int8_layer_tensors(layer)
        specs = []
        per_byte = 8 // layer.bits
        for prefix, out_features, in_features in (
            ("w13", 2 * layer.intermediate, layer.hidden),
            ("w2", layer.hidden, layer.intermediate),
        ):
            groups = in_features // layer.group_size_for(in_features)
            e = layer.experts
            made_of, names = FUSED_GEMMS[prefix], WNA16[prefix]
            specs.append(TensorSpec(names.qweight, (e, out_features, in_features // per_byte), "U8",
                                    derives_from=made_of))
            specs.append(TensorSpec(names.scales, (e, out_features, groups), layer.scale_dtype,
                                    derives_from=made_of))
            if not layer.symmetric:
                specs.append(TensorSpec(names.qzeros, (e, out_features // per_byte, groups), "U8",
                                        derives_from=made_of))
        return specs

    def encode_expert(self, expert: ExpertWeights, layer: MoELayerShape) -> dict[str, np.ndarray]:
        slices = {}
        for prefix, rows in (("w13", (expert.gate, expert.up)), ("w2", (expert.down,))):
            if layer.activation_bits == 8:
                slices.update(_int8_encode(prefix, rows))
                continue
            # Pack each projection, then stack the packed rows (gate first): smaller than stacking codes.
            names = WNA16[prefix]
            slices[names.qweight] = np.concatenate(
                [packing.pack_array(w.codes, w.bits, axis=1, container=np.uint8) for w in rows])
            slices[names.scales] = np.concatenate([w.scales for w in rows])
            if rows[0].zeros is not None:
                zeros = np.concatenate([w.zeros for w in rows])
                slices[names.qzeros] = packing.pack_array(zeros, rows[0].bits, axis=0, container=np.uint8)
        return slices

    def from_float(self, expert: dict[str, FloatWeight], layer: MoELayerShape) -> dict[str, np.ndarray]:
        """Each GEMM's projections' bytes stacked (gate rows first), the global scales divided by (the plan
        refused a source whose reciprocal is not exact before a byte was written)."""
        slices = {}
        for prefix, projections in FUSED_GEMMS.items():
            names, rows = FLOAT[prefix], [expert[projection].in_convention(DIVIDE) for projection in projections]
            slices[names.weight_packed] = np.concatenate([weight.packed for weight in rows])
            slices[names.weight_scale] = np.concatenate([weight.scales for weight in rows])
            for name, field in ((names.weight_global_scale, "global_scale"), (names.input_global_scale, "input_scale")):
                values = [getattr(weight, field) for weight in rows]
                if values[0] is not None:  # w13: (2,), gate's then up's; w2: one value, ()
                    slices[name] = np.stack(values) if len(values) > 1 else values[0]
        return slices

    def takes_packed(self, layer: MoELayerShape | LinearShape) -> bool:
        return layer.activation_bits == 16  # the int8 layout's codes are not packed

    def from_packed(self, expert: dict[str, PackedWeight], layer: MoELayerShape) -> dict[str, np.ndarray]:
        """The words' bytes are the kernel's codes packed along K, the zero words' bytes down the rows its
        zero points packed along N: each GEMM's projections stacked, gate rows first."""
        slices = {}
        for prefix, projections in FUSED_GEMMS.items():
            names, rows = WNA16[prefix], [expert[projection] for projection in projections]
            slices[names.qweight] = np.concatenate([weight.code_bytes() for weight in rows])
            slices[names.scales] = np.concatenate([weight.scales for weight in rows])
            if rows[0].zero_words is not None:
                slices[names.qzeros] = np.concatenate([weight.zero_bytes() for weight in rows])
        return slices

    def decode_expert(self, slices: dict[str, np.ndarray], layer: MoELayerShape) -> ExpertWeights:
        if layer.float_scheme is not None:
            return _float_decode(slices, layer)
        decoded = {}
        for prefix in ("w13", "w2"):
            if layer.activation_bits == 8:
                decoded[prefix] = _int8_decode(prefix, slices, layer)
                continue
            names = WNA16[prefix]
            codes = packing.unpack_array(slices[names.qweight], layer.bits, axis=1)
            zeros_packed = slices.get(names.qzeros)
            zeros = None if zeros_packed is None else packing.unpack_array(zeros_packed, layer.bits, axis=0)
            decoded[prefix] = QuantizedWeight(
                codes=codes,
                zeros=zeros,
                scales=slices[names.scales],
                bits=layer.bits,
                group_size=layer.group_size_for(codes.shape[1]),
            )
        gate, up = _split_rows(decoded["w13"], layer.intermediate)
        return ExpertWeights(gate=gate, up=up, down=decoded["w2"])

    def quantization_config(self, layer: MoELayerShape) -> dict[str, Any]:
        scheme = layer.float_scheme
        if scheme is not None:
            return {"bits": 4, "group_size": scheme.block, "has_zp": False, "layout": scheme.name,
                    "weight_bits_order": "even k in the low nibble", "scale_dtype": scheme.scale_dtype,
                    "scale_encoding": scheme.scale_encoding,
                    "global_scale": None if scheme.global_convention is None else DIVIDE,
                    "input_global_scale": scheme.input_scale}
        if layer.activation_bits == 8:
            return {"bits": 8, "group_size": -1, "has_zp": False, "layout": "int8_w8a8",
                    "weight_scale_dtype": "float32", "activations": "dynamic per-token symmetric int8"}
        return {
            "bits": layer.bits,
            "group_size": layer.group_size,
            "has_zp": not layer.symmetric,
            "layout": "moe_wna16",
            "weight_bits_order": "even k in the low nibble" if layer.bits == 4 else "one code per byte",
            "scale_dtype": layer.scale_dtype,  # the stored scales' dtype: the vLLM plugin keeps it
        }


def _split_rows(weight: QuantizedWeight, rows: int) -> tuple[QuantizedWeight, QuantizedWeight]:
    """The first `rows` output rows and the rest (gate and up of w13)."""
    def part(index: slice) -> QuantizedWeight:
        return QuantizedWeight(codes=np.ascontiguousarray(weight.codes[index]),
                               zeros=None if weight.zeros is None else np.ascontiguousarray(weight.zeros[index]),
                               scales=np.ascontiguousarray(weight.scales[index]), bits=weight.bits,
                               group_size=weight.group_size)

    return part(slice(0, rows)), part(slice(rows, None))


def _int8_refusal(layer: MoELayerShape) -> str | None:
    if layer.bits != 8 or not layer.symmetric or not is_channelwise(layer.group_size):
        return "the W8A8 int8 kernels take symmetric 8-bit weights with one scale per channel"
    if layer.intermediate % layer.tp:
        return f"intermediate size {layer.intermediate} does not split over tp={layer.tp}"
    return None


def _int8_layer_tensors(layer: MoELayerShape) -> list[TensorSpec]:
    e, h, i = layer.experts, layer.hidden, layer.intermediate
    return [
        TensorSpec(INT8["w13"].weight, (e, 2 * i, h), "I8", derives_from=FUSED_GEMMS["w13"]),
        TensorSpec(INT8["w13"].weight_scale, (e, 2 * i, 1), "F32", derives_from=FUSED_GEMMS["w13"]),
        TensorSpec(INT8["w2"].weight, (e, h, i), "I8", derives_from=FUSED_GEMMS["w2"]),
        TensorSpec(INT8["w2"].weight_scale, (e, h, 1), "F32", derives_from=FUSED_GEMMS["w2"]),
    ]


def _int8_encode(prefix: str, rows: tuple[QuantizedWeight, ...]) -> dict[str, np.ndarray]:
    """Rows stacked gate first, as in the moe_wna16 path; the scales widened to float32 exactly
    (packing.as_float32: torch's own cast would quiet a float16 signalling NaN)."""
    names = INT8[prefix]
    return {names.weight: np.concatenate([packing.offset_codes_to_int8(w.codes) for w in rows]),
            names.weight_scale: packing.as_float32(np.concatenate([w.scales for w in rows]))}


def _int8_decode(prefix: str, slices: dict[str, np.ndarray], layer: MoELayerShape) -> QuantizedWeight:
    """The int8 layout's stored arrays back to the canonical form: the codes' bytes moved, the F32 scales cast
    back to the source's scale dtype, rounding as torch's casts do (packing.float32_cast)."""
    names = INT8[prefix]
    codes = packing.int8_array_to_offset_codes(slices[names.weight])
    return QuantizedWeight(codes=codes, zeros=None, bits=8, group_size=codes.shape[1],
                           scales=packing.float32_cast(slices[names.weight_scale], TORCH_NAMES[layer.scale_dtype]))


def _float_layer_tensors(layer: MoELayerShape) -> list[TensorSpec]:
    scheme, e = layer.float_scheme, layer.experts
    specs = []
    for prefix, out_features, in_features in (("w13", 2 * layer.intermediate, layer.hidden),
                                              ("w2", layer.hidden, layer.intermediate)):
        names, made_of = FLOAT[prefix], FUSED_GEMMS[prefix]
        per_expert = (e, len(made_of)) if len(made_of) > 1 else (e,)
        specs.append(TensorSpec(names.weight_packed, (e, out_features, in_features // 2), "U8", derives_from=made_of))
        specs.append(TensorSpec(names.weight_scale, (e, out_features, in_features // scheme.block), scheme.scale_dtype,
                                derives_from=made_of))
        if scheme.global_convention is not None:
            specs.append(TensorSpec(names.weight_global_scale, per_expert, "F32", derives_from=made_of))
        if scheme.input_scale:
            specs.append(TensorSpec(names.input_global_scale, per_expert, "F32", derives_from=made_of))
    return specs


def _float_decode(slices: dict[str, np.ndarray], layer: MoELayerShape) -> ExpertWeights:
    """The float layouts' slices back to one FloatWeight a projection (global scales divided by)."""
    scheme = layer.float_scheme.in_convention(DIVIDE)
    weights = {}
    for prefix, projections in FUSED_GEMMS.items():
        names, rows = FLOAT[prefix], layer.intermediate if prefix == "w13" else layer.hidden
        scalars = {field: slices[name].reshape(-1) for field, name in
                   (("global_scale", names.weight_global_scale), ("input_scale", names.input_global_scale))
                   if name in slices}
        for index, projection in enumerate(projections):
            part = slice(index * rows, (index + 1) * rows)
            weights[projection] = FloatWeight(
                np.ascontiguousarray(slices[names.weight_packed][part]),
                np.ascontiguousarray(slices[names.weight_scale][part]).view(np.uint8), scheme,
                **{field: values[index].astype(np.float32).reshape(()).copy() for field, values in scalars.items()})
    return ExpertWeights(**weights)
