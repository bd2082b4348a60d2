"""The Humming standard schema (`quant_method: "humming"`; docs/FORMAT.md).

Per expert and projection, under the checkpoint's own names (`<module>.<e>.<projection>.<suffix>`),
and for every dense quantized linear (`<module>.<suffix>`), unpadded and N-first:
  weight        int32 (N, K·b/32): codes packed along K, value i of every 32 at stream bits
                [i·b, i·b + b), stream bit t = bit t mod 32 of word t div 32 (4-bit: GPTQ's
                qweight transposed; 8-bit: the bytes of the codes, i.e. int8 ^ 0x80 for W8A8)
  weight_scale  (N, K/g) in the source dtype, (N, 1) channel-wise
  zero_point    int32 (N·b/32, K/g), asymmetric only: TRUE zero points packed along N the same way
                (GPTQ v1's stored z − 1 is corrected by the source decoder, never copied)

Float-coded sources (float_codes.py: MXFP4, NVFP4) take Humming's FP4 weight types
(`humming/schema/humming.py`, `HummingWeightSchema`: b_dtype float4e2m1), per linear:
  weight          int32 (N, K/8): the E2M1 codes, code i of every 8 at bits [4i, 4i + 4) of its word: the
                  producers' bytes (element 2j in the low nibble of byte j) read as little-endian int32
                  words, as Humming's compressed-tensors schema reads `weight_packed` (viewed as torch.int32)
  weight_scale    MXFP4: F8_E8M0 (N, K/32); NVFP4: F8_E4M3 (N, K/16): the scale bytes as stored, under
                  the dtype of the parameter Humming creates (float8_e8m0fnu, float8_e4m3fn), so a loader's
                  copy keeps the bytes (a U8 tensor copied into a float8_e8m0fnu parameter converts by value)
  weight_scale_2  NVFP4: F32 (1,), the global scale MULTIPLIED by (ModelOpt's `weight_scale_2` as it is; a
                  compressed-tensors `weight_global_scale` g as 1 / g where that is exact, else the plan refuses)
(NVFP4 W4A4 sources, whose linears store a static input global scale, are refused: vLLM's Humming MoE
method has no parameter for it.)

Every word is built with explicit shifts (moeconv.packing), never by viewing bytes as int32, so the
output does not depend on the host's byte order. What depends on
the GPU (the kernel repack, the scale and zero-point permutations, padding N to 256 and K to 128, signed
conversion for int8 activations) stays at load time (§4.6).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from moeconv import packing
from moeconv.float_codes import E4M3, MULTIPLY, UE8M0, FloatScheme, FloatWeight
from moeconv.spec import TensorSpec
from moeconv.backends.base import Numerics, with_fused_names
from moeconv.backends.per_linear import (PerLinearBackend, from_packed_words, packed_words, per_rank_refusal,
                                         projection_shapes)
from moeconv.canonical import PROJECTIONS, LinearShape, MoELayerShape, QuantizedWeight, is_channelwise

if TYPE_CHECKING:
    from moeconv.packed import PackedWeight

# Humming's pack kernels work on runs of 32 values (upstream asserts L % 32 == 0).
PACK_RUN = 32
_DTYPE_NAMES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}
_MODEL_DTYPES = {"float16": "F16", "half": "F16", "bfloat16": "BF16", "float32": "F32", "float": "F32"}
# Float codes: the safetensors dtype of each scale encoding (the dtype of the parameter Humming's schema
# creates: get_tensors_attrs maps bs_dtype float8e8m0 to torch.float8_e8m0fnu, float8e4m3 to float8_e4m3fn),
# and the schema's names for the code and scale types.
FLOAT_SCALE_DTYPES = {UE8M0: "F8_E8M0", E4M3: "F8_E4M3"}
FLOAT_SCALE_TYPES = {UE8M0: "float8e8m0", E4M3: "float8e4m3"}
FP4_CODES = "float4e2m1"
WEIGHT_SCALE_2 = "weight_scale_2"


class HummingBackend(PerLinearBackend):
    name = "humming"
    layout_version = 1
    float_global_convention = MULTIPLY
    # integer codes: the triton layout's kernel on the output re-encoded (per_linear); float codes: the FP4
    # kernel on the output's own words and scale bytes (kernels/runners.py: humming-fp4)
    numerics = Numerics("triton", layout="triton", float_kernel="humming-fp4")

    def refusal(self, layer: MoELayerShape) -> str | None:
        if layer.expert_biases:
            return ("its experts carry biases (gpt-oss), which moeconv does not write into Humming's schema; vLLM "
                    "serves the gpt-oss checkpoint as it is (--moe-backend humming), and --cast bf16 writes gpt-oss's own BF16 form")
        if layer.float_scheme is not None:
            return _input_scale_refusal(layer.float_scheme) or per_rank_refusal(layer, _pack_refusal)
        return per_rank_refusal(layer, lambda what, size: _pack_refusal(what, size)
                                or _group_refusal(what, size, layer.group_size)) or _bits_refusal(layer.bits)

    def linear_refusal(self, linear: LinearShape) -> str | None:
        if linear.float_scheme is not None:
            return _input_scale_refusal(linear.float_scheme) or _pack_refusal("output size", linear.out_features) or _pack_refusal("input size",
                                                                                       linear.in_features)
        return (_pack_refusal("output size", linear.out_features) or _pack_refusal("input size", linear.in_features)
                or _group_refusal("input size", linear.in_features, linear.group_size) or _bits_refusal(linear.bits))

    def linear_tensors(self, linear: LinearShape) -> list[TensorSpec]:
        n, k, bits = linear.out_features, linear.in_features, linear.bits
        scheme = linear.float_scheme
        if scheme is not None:
            specs = [TensorSpec("weight", (n, k * 4 // 32), "I32"),
                     TensorSpec("weight_scale", (n, k // scheme.block), FLOAT_SCALE_DTYPES[scheme.scale_encoding])]
            if scheme.global_convention is not None:
                specs.append(TensorSpec(WEIGHT_SCALE_2, (1,), "F32"))
            return specs
        groups = k // linear.effective_group_size
        specs = [TensorSpec("weight", (n, k * bits // 32), "I32"),
                 TensorSpec("weight_scale", (n, groups), linear.scale_dtype)]
        if not linear.symmetric:
            specs.append(TensorSpec("zero_point", (n * bits // 32, groups), "I32"))
        return specs

    def encode_linear(self, weight: QuantizedWeight, linear: LinearShape) -> dict[str, np.ndarray]:
        codes, zeros = packed_words(weight)
        tensors = {"weight": codes, "weight_scale": weight.scales}
        if zeros is not None:
            tensors["zero_point"] = zeros
        return tensors

    def from_float(self, expert: dict[str, FloatWeight], layer: MoELayerShape) -> dict[str, np.ndarray]:
        return {f"{name}.{suffix}": array
                for name, projection, linear in zip(layer.projection_names, PROJECTIONS, projection_shapes(layer))
                for suffix, array in self.from_float_linear(expert[projection], linear).items()}

    def from_float_linear(self, weight: FloatWeight, linear: LinearShape) -> dict[str, np.ndarray]:
        """The code bytes as int32 words, byte i of each word at bits [8i, 8i + 8) (explicit shifts: the same
        bytes in a little-endian file), the scale bytes as they are, the global scales multiplied by (the plan refused what is not exact before a byte was written)."""
        weight = weight.in_convention(MULTIPLY)
        words = packing.pack_array(weight.packed, 8, axis=1, container=np.int32)
        arrays = {"weight": words, "weight_scale": weight.scales}
        if weight.global_scale is not None:
            arrays[WEIGHT_SCALE_2] = weight.global_scale.reshape(1)
        return arrays

    def decode_linear(self, tensors: dict[str, np.ndarray], linear: LinearShape) -> QuantizedWeight | FloatWeight:
        if linear.float_scheme is not None:
            return decode_float(tensors, linear.float_scheme)
        return from_packed_words(tensors["weight"], tensors.get("zero_point"), tensors["weight_scale"], linear)

    def from_packed_linear(self, weight: PackedWeight, linear: LinearShape) -> dict[str, np.ndarray]:
        """The same words as compressed-tensors', under Humming's names."""
        tensors = {"weight": weight.words, "weight_scale": weight.scales}
        if weight.zero_words is not None:
            tensors["zero_point"] = weight.zero_words
        return tensors

    def quantization_config(self, layer: MoELayerShape) -> dict[str, Any]:
        """The weight schema as `HummingWeightSchema.from_config` reads it. Channel-wise is group size
        0; zero points need GROUP scales upstream, so asymmetric channel-wise says "group" explicitly
        (group size 0 then means the whole K: the same (N, 1) scales). The group size is written as
        `weight_scale_group_size`, not its alias `group_size`: Humming's loader also parses the config
        as an INPUT schema, where `group_size` means the activation-scale group, and then refuses the
        layer (docs/BENCHMARKS.md, "Humming's own loader")."""
        if layer.float_scheme is not None:
            return float_config(layer.float_scheme)
        config: dict[str, Any] = {
            "quant_method": "humming",
            "b_dtype": f"uint{layer.bits}",
            "weight_scale_group_size": 0 if is_channelwise(layer.group_size) else layer.group_size,
            "has_zero_point": not layer.symmetric,
        }
        if not layer.symmetric and is_channelwise(layer.group_size):
            config["weight_scale_type"] = "group"
        if layer.activation_bits == 8:
            # Humming takes the activation precision from its input schema (VLLM_HUMMING_INPUT_QUANT_CONFIG
            # in vLLM, §6); this records what the source's scheme did.
            config["activations"] = "dynamic per-token symmetric int8"
        return config

    def checkpoint_quantization_config(self, layer: MoELayerShape, model_dtype: str | None,
                                       unquantized_modules: list[str],
                                       fp8_block_modules: tuple[str, ...] = ()) -> dict[str, Any]:
        """Scales keep the source dtype; `bs_dtype` says so when that is not the model dtype (Humming
        otherwise assumes the params dtype). `ignored_layers` is the first key Humming's vLLM config
        reads for linears to leave in float (it would quantize them online otherwise), fused names included
        (base.FUSED_SHARDS)."""
        config = self.quantization_config(layer)
        if layer.float_scheme is None and _MODEL_DTYPES.get(str(model_dtype)) != layer.scale_dtype:
            config["bs_dtype"] = _DTYPE_NAMES[layer.scale_dtype]
        config["ignored_layers"] = with_fused_names(unquantized_modules)
        return config


def decode_float(tensors: dict[str, np.ndarray], scheme: FloatScheme) -> FloatWeight:
    """One float-coded linear of this layout back in the canonical float form (the inverse of
    `from_float_linear`): the words' bytes, least significant first, are the codes two a byte; the scale bytes
    as stored."""
    packed = packing.unpack_array(tensors["weight"], 8, axis=1)
    global_scale = tensors[WEIGHT_SCALE_2].reshape(()).astype(np.float32) if WEIGHT_SCALE_2 in tensors else None
    return FloatWeight(packed, np.asarray(tensors["weight_scale"], dtype=np.uint8), scheme.in_convention(MULTIPLY),
                       global_scale)


def float_config(scheme: FloatScheme) -> dict[str, Any]:
    """`HummingWeightSchema.from_config`'s fields for FP4 weights (what its compressed-tensors schema's
    `to_humming_schema` gives for mxfp4- and nvfp4-pack-quantized): E2M1 codes, group scales of the scheme's
    encoding, NVFP4's per-tensor secondary scale. No input schema: the activations stay in the model dtype
    (W4A4 sources are refused: `_input_scale_refusal`)."""
    config: dict[str, Any] = {
        "quant_method": "humming",
        "b_dtype": FP4_CODES,
        "bs_dtype": FLOAT_SCALE_TYPES[scheme.scale_encoding],
        "weight_scale_group_size": scheme.block,
        "weight_scale_type": "group",
        "weight_scale_2_type": "none" if scheme.global_convention is None else "tensor",
        "has_zero_point": False,
    }
    return config


def _input_scale_refusal(scheme: FloatScheme) -> str | None:
    """NVFP4 W4A4 (a static input global scale per linear): Humming's schema names it (`input_scale_2` of the input
    schema `static_tensor_dynamic_group`, which HummingLinearMethod registers), but vLLM's HummingMoEMethod
    registers no input scale for the experts (`create_weights` makes the weight schema's tensors only), so
    `RoutedExperts.load_weights` refuses the checkpoint (AttributeError: no parameter 'w2_input_scale_2');
    leaving the scales out would drop source bytes that verify could not check."""
    if not scheme.input_scale:
        return None
    return ("its linears store a static input global scale (NVFP4 W4A4), and vLLM's Humming MoE method registers none "
            "for the experts (HummingMoEMethod.create_weights), so the output would not load; --backend "
            "compressed-tensors keeps it")


def _bits_refusal(bits: int) -> str | None:
    if bits not in (4, 8):
        return f"moeconv writes (and verifies with its Triton kernel) 4- and 8-bit Humming weights, not {bits}-bit"
    return None


def _pack_refusal(what: str, size: int) -> str | None:
    if size % PACK_RUN:
        return f"Humming packs runs of {PACK_RUN} values: the {what} {size} is not a multiple of {PACK_RUN}"
    return None


def _group_refusal(what: str, in_features: int, group_size: int) -> str | None:
    if not is_channelwise(group_size) and in_features % group_size:
        return f"group size {group_size} does not divide the {what} {in_features}"
    return None
