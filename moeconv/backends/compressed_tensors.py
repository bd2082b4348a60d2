"""A normalised compressed-tensors checkpoint (`quant_method: "compressed-tensors"`; docs/FORMAT.md): the
"make it servable" target. Stock vLLM loads compressed-tensors MoE checkpoints through its own
`CompressedTensorsWNA16MoEMethod` (W4A16 / W8A16, symmetric or asymmetric) and
`CompressedTensorsW8A8Int8MoEMethod`, so any source moeconv reads (AWQ, GPTQ v1 or v2, mislabelled or
not) becomes a checkpoint an engine serves with the zero points right: GPTQ v1's stored z − 1 is
corrected by the source decoder, and compressed-tensors stores the true zero.

Per expert and projection under the checkpoint's own names, and for every dense quantized linear:
  pack-quantized (W4A16, W8A16):
    weight_packed      int32 (N, K·b/32): the canonical codes (compressed-tensors' offset-binary
                       c = q + 2^(b−1)) packed along K, value j of each word at bits [j·b, j·b + b)
    weight_scale       (N, K/g) in the source dtype; (N, 1) channel-wise
    weight_shape       int64 [N, K]
    weight_zero_point  int32 (N·b/32, K/g), asymmetric only: the TRUE zero points, offset-binary like
                       the codes, packed along N
  int-quantized (W8A8 sources stay W8A8):
    weight             int8 (N, K): canonical code − 128
    weight_scale       (N, 1) in the source dtype
  nvfp4-pack-quantized / mxfp4-pack-quantized (float-coded sources: float_codes.py), as llm-compressor writes them:
    weight_packed        uint8 (N, K/2): E2M1 codes, element 2j in the low nibble of byte j
    weight_scale         NVFP4: F8_E4M3 (N, K/16); MXFP4: U8 (N, K/32), the scale bytes as the source's
    weight_global_scale  NVFP4: F32 (1,), divided by (compressed-tensors' convention: a ModelOpt source's
                         weight_scale_2 is written as its reciprocal where that is exact, else refused)
    input_global_scale   NVFP4 W4A4: F32 (1,), the static input global scale, in the same convention
Words are built with explicit shifts (moeconv.packing), so the bytes do not depend on the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from moeconv import packing
from moeconv.float_codes import DIVIDE, MXFP4, FloatScheme, FloatWeight
from moeconv.formats.compressed_tensors_float import float_arrays
from moeconv.spec import TensorSpec
from moeconv.backends.base import Numerics, with_fused_names
from moeconv.backends.per_linear import (PerLinearBackend, from_packed_words, packed_words, per_rank_refusal,
                                         projection_shapes)
from moeconv.canonical import PROJECTIONS, LinearShape, MoELayerShape, QuantizedWeight, is_channelwise

if TYPE_CHECKING:
    from moeconv.packed import PackedWeight

# The compressed-tensors release vLLM pins (engines/: its targets); the config below is what its
# QuantizationConfig reads.
COMPRESSED_TENSORS_TARGET = "0.17.0"
PACK_QUANTIZED, INT_QUANTIZED = "pack-quantized", "int-quantized"
NVFP4_PACK_QUANTIZED, MXFP4_PACK_QUANTIZED = "nvfp4-pack-quantized", "mxfp4-pack-quantized"
GLOBAL_SCALE, INPUT_SCALE = "weight_global_scale", "input_global_scale"
FLOAT_QUANTIZED, MIXED_PRECISION = "float-quantized", "mixed-precision"
# FP8 block-scaled linears (DeepSeek's and MiniMax's `weight` F8_E4M3 + `weight_scale_inv`): compressed-tensors'
# FP8_BLOCK scheme, the same block grid and the same multiplier (`weight_scale_inv` is what the FP8 codes
# are multiplied by, as compressed-tensors' `weight_scale` is), activations quantized per token-group of 128
# at run time (what DeepSeek's fp8 kernels do).
FP8_BLOCK = 128
# The token embedding's module name in every family moeconv reads. An embedding is no `Linear` target, so
# it is never in `ignore` (llm-compressor lists none); SGLang's w8a8_int8 method, which serves
# compressed-tensors W8A8, answers an ignored embedding with a linear method and refuses to start.
EMBEDDING = "embed_tokens"


# gpt-oss's experts carry a bias per linear. vLLM (the release engines/ names) loads a compressed-tensors MoE layer through methods that
# register no expert bias: CompressedTensorsW4A4Mxfp4MoEMethod.create_weights (compressed_tensors_moe/
# compressed_tensors_moe_w4a4_mxfp4.py, what mxfp4-pack-quantized experts get) registers w13/w2 weight_packed and
# weight_scale only, and GptOssModel._load_weights_other (models/gpt_oss.py) then has no `w13_bias` parameter to put
# a bias into. vLLM serves the gpt-oss source itself through its own `mxfp4` method (quantization/mxfp4.py:
# GptOssMxfp4Config, GptOssMxfp4MoEMethod registers w13_bias and w2_bias). docs/FLOAT_SOURCES.md section 5.
EXPERT_BIASES_REFUSAL = (
    "its experts carry biases (gpt-oss's gate_up_proj_bias, down_proj_bias) and vLLM's compressed-tensors "
    "MXFP4 MoE method registers none (CompressedTensorsW4A4Mxfp4MoEMethod.create_weights), so its GptOssForCausalLM "
    "would have no parameter to load them into; vLLM serves the gpt-oss checkpoint as it is with its own mxfp4 method "
    "(GptOssMxfp4MoEMethod, which takes w13_bias and w2_bias), and --cast bf16 writes gpt-oss's own BF16 form")


def float_experts_refusal(layer: MoELayerShape) -> str | None:
    """Why vLLM's compressed-tensors MXFP4 / NVFP4 MoE methods cannot hold the float-coded layer (their parameters
    are this backend's expert tensors, and the triton backend's float layouts stack them): expert biases, or a
    rank's share of K that is not whole blocks."""
    if layer.expert_biases:
        return EXPERT_BIASES_REFUSAL
    block = layer.float_scheme.block
    return per_rank_refusal(layer, lambda what, size: None if size % block == 0 else
                            f"the {what} {size} is not a multiple of the {block}-element block")


def _format(activation_bits: int, scheme: FloatScheme | None = None) -> str:
    if scheme is not None:
        return MXFP4_PACK_QUANTIZED if scheme.name == MXFP4.name else NVFP4_PACK_QUANTIZED
    return INT_QUANTIZED if activation_bits == 8 else PACK_QUANTIZED


class CompressedTensorsBackend(PerLinearBackend):
    name = "compressed-tensors"
    layout_version = 1
    float_global_convention = DIVIDE
    # integer codes: the triton layout's kernel on the output re-encoded (per_linear); float codes: the FP4
    # kernel on the output's own bytes (kernels/fp4_moe.py)
    numerics = Numerics("triton", layout="triton", float_kernel="triton-fp4")

    def refusal(self, layer: MoELayerShape) -> str | None:
        if layer.float_scheme is not None:
            return float_experts_refusal(layer)
        if layer.expert_biases:
            return EXPERT_BIASES_REFUSAL
        return per_rank_refusal(layer, lambda what, size: _refusal(what, size, layer.bits, layer.group_size,
                                                                   layer.symmetric, layer.activation_bits))

    def linear_refusal(self, linear: LinearShape) -> str | None:
        if linear.float_scheme is not None:
            block = linear.float_scheme.block
            return None if linear.in_features % block == 0 else \
                f"the input size {linear.in_features} is not a multiple of the {block}-element block"
        return (_refusal("input size", linear.in_features, linear.bits, linear.group_size, linear.symmetric,
                         linear.activation_bits)
                or (None if linear.symmetric else  # zero points pack along N
                    _refusal("output size", linear.out_features, linear.bits, -1, linear.symmetric,
                             linear.activation_bits)))

    def linear_tensors(self, linear: LinearShape) -> list[TensorSpec]:
        n, k, bits = linear.out_features, linear.in_features, linear.bits
        scheme = linear.float_scheme
        if scheme is not None:
            specs = [TensorSpec("weight_packed", (n, k // 2), "U8"),
                     TensorSpec("weight_scale", (n, k // scheme.block), scheme.scale_dtype)]
            if scheme.global_convention is not None:
                specs.append(TensorSpec(GLOBAL_SCALE, (1,), "F32"))
            if scheme.input_scale:
                specs.append(TensorSpec(INPUT_SCALE, (1,), "F32"))
            return specs
        if linear.activation_bits == 8:
            return [TensorSpec("weight", (n, k), "I8"), TensorSpec("weight_scale", (n, 1), linear.scale_dtype)]
        groups = k // linear.effective_group_size
        specs = [TensorSpec("weight_packed", (n, k * bits // 32), "I32"),
                 TensorSpec("weight_scale", (n, groups), linear.scale_dtype),
                 TensorSpec("weight_shape", (2,), "I64")]
        if not linear.symmetric:
            specs.append(TensorSpec("weight_zero_point", (n * bits // 32, groups), "I32"))
        return specs

    def encode_linear(self, weight: QuantizedWeight, linear: LinearShape) -> dict[str, np.ndarray]:
        if linear.activation_bits == 8:
            return {"weight": packing.offset_codes_to_int8(weight.codes), "weight_scale": weight.scales}
        codes, zeros = packed_words(weight)
        tensors = {"weight_packed": codes, "weight_scale": weight.scales,
                   "weight_shape": np.array(weight.codes.shape, dtype=np.int64)}
        if zeros is not None:
            tensors["weight_zero_point"] = zeros
        return tensors

    def from_float(self, expert: dict[str, FloatWeight], layer: MoELayerShape) -> dict[str, np.ndarray]:
        return {f"{name}.{suffix}": array
                for name, projection, linear in zip(layer.projection_names, PROJECTIONS, projection_shapes(layer))
                for suffix, array in self.from_float_linear(expert[projection], linear).items()}

    def from_float_linear(self, weight: FloatWeight, linear: LinearShape) -> dict[str, np.ndarray]:
        """The bytes as they are, the global scales divided by (the plan refused what is not exact before a
        byte was written): the compressed-tensors format's own arrays."""
        return float_arrays(weight)

    def decode_linear(self, tensors: dict[str, np.ndarray], linear: LinearShape) -> QuantizedWeight | FloatWeight:
        """Inverse of `encode_linear` (and of `from_float_linear` for float codes); raises ValueError when
        weight_shape is not [N, K]."""
        scheme = linear.float_scheme
        if scheme is not None:
            scalars = {field: tensors[suffix].reshape(()).copy() for field, suffix in
                       (("global_scale", GLOBAL_SCALE), ("input_scale", INPUT_SCALE)) if suffix in tensors}
            return FloatWeight(tensors["weight_packed"], tensors["weight_scale"].view(np.uint8),
                               scheme.in_convention(DIVIDE), **scalars)
        if linear.activation_bits == 8:
            return QuantizedWeight(codes=packing.int8_array_to_offset_codes(tensors["weight"]), zeros=None,
                                   scales=tensors["weight_scale"], bits=8, group_size=linear.in_features)
        stated = tensors["weight_shape"].tolist()
        if stated != [linear.out_features, linear.in_features]:
            raise ValueError(f"weight_shape says {stated}, not [{linear.out_features}, {linear.in_features}]")
        return from_packed_words(tensors["weight_packed"], tensors.get("weight_zero_point"), tensors["weight_scale"],
                                 linear)

    def from_packed_linear(self, weight: PackedWeight, linear: LinearShape) -> dict[str, np.ndarray]:
        """pack-quantized's words are the packed form's."""
        tensors = {"weight_packed": weight.words, "weight_scale": weight.scales,
                   "weight_shape": np.array([weight.out_features, weight.in_features], dtype=np.int64)}
        if weight.zero_words is not None:
            tensors["weight_zero_point"] = weight.zero_words
        return tensors

    # DeepSeek's `weight_scale_inv` renamed; a compressed-tensors source's own FP8_BLOCK `weight_scale` kept
    fp8_block_suffixes = {"weight": "weight", "weight_scale_inv": "weight_scale", "weight_scale": "weight_scale"}

    def quantization_config(self, layer: MoELayerShape) -> dict[str, Any]:
        return self.checkpoint_quantization_config(layer, None, [])

    def checkpoint_quantization_config(self, layer: MoELayerShape, model_dtype: str | None,
                                       unquantized_modules: list[str],
                                       fp8_block_modules: tuple[str, ...] = ()) -> dict[str, Any]:
        """What compressed-tensors' `QuantizationConfig` reads: one config group for every Linear
        (experts and dense quantized linears share the source's scheme), the float linears ignored
        (the embedding is not a linear: EMBEDDING), and the FP8 block-scaled linears, if any, in a group
        of their own that names them (a module name is matched before the `Linear` class)."""
        fmt = _format(layer.activation_bits, layer.float_scheme)
        channelwise = is_channelwise(layer.group_size) or fmt == INT_QUANTIZED
        weights = {"num_bits": layer.bits, "type": "int", "symmetric": layer.symmetric,
                   "strategy": "channel" if channelwise else "group",
                   "group_size": None if channelwise else layer.group_size,
                   "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax",
                   "observer_kwargs": {}}
        activations = None
        if layer.activation_bits == 8:
            activations = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "group_size": None,
                           "block_structure": None, "dynamic": True, "actorder": None, "observer": None,
                           "observer_kwargs": {}}
        groups = {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations,
                              "output_activations": None, "format": fmt}}
        if layer.float_scheme is not None:
            groups["group_0"] = _float_group(layer.float_scheme, fmt)
        if fp8_block_modules:
            groups["group_1"] = _fp8_block_group(fp8_block_modules)
        return {
            "quant_method": "compressed-tensors",
            "format": MIXED_PRECISION if fp8_block_modules else fmt,
            "config_groups": groups,
            "ignore": with_fused_names([name for name in unquantized_modules if name.rpartition(".")[2] != EMBEDDING]),
            "quantization_status": "compressed",
            "kv_cache_scheme": None,
            "sparsity_config": {},
            "transform_config": {},
            "global_compression_ratio": None,
            "version": COMPRESSED_TENSORS_TARGET,
        }


def _float_group(scheme: FloatScheme, fmt: str) -> dict[str, Any]:
    """The config group compressed-tensors writes for a float scheme (its presets NVFP4, NVFP4A16, MXFP4A16 in
    compressed_tensors/quantization/quant_scheme.py), what vLLM reads to pick its NVFP4 or MXFP4 MoE method."""
    scale_dtype = "torch.uint8" if scheme.name == MXFP4.name else "torch.float8_e4m3fn"
    strategy = "group" if scheme.name == MXFP4.name else "tensor_group"
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": strategy, "group_size": scheme.block,
               "block_structure": None, "dynamic": False, "actorder": None, "observer": "memoryless_minmax",
               "observer_kwargs": {}, "scale_dtype": scale_dtype, "zp_dtype": None}
    activations = None
    if scheme.input_scale:  # a static global scale per linear, block scales at run time
        activations = {**weights, "dynamic": "local", "observer": "static_minmax"}
    return {"targets": ["Linear"], "weights": weights, "input_activations": activations, "output_activations": None,
            "format": fmt}


def _fp8_block_group(modules: tuple[str, ...]) -> dict[str, Any]:
    return {
        "targets": sorted(modules),
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "group_size": None,
                    "block_structure": [FP8_BLOCK, FP8_BLOCK], "dynamic": False, "actorder": None,
                    "observer": "minmax", "observer_kwargs": {}},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group",
                              "group_size": FP8_BLOCK, "block_structure": None, "dynamic": True, "actorder": None,
                              "observer": None, "observer_kwargs": {}},
        "output_activations": None,
        "format": FLOAT_QUANTIZED,
    }


def _refusal(what: str, size: int, bits: int, group_size: int, symmetric: bool, activation_bits: int) -> str | None:
    if activation_bits == 8:
        if bits != 8 or not symmetric or not is_channelwise(group_size):
            return "compressed-tensors int-quantized (W8A8) takes symmetric 8-bit weights with one scale per channel"
        return None
    if bits not in (4, 8):
        return f"moeconv writes (and verifies) 4- and 8-bit pack-quantized weights, not {bits}-bit"
    if size % (32 // bits):
        return f"pack-quantized packs {32 // bits} values per int32: the {what} {size} is not a multiple of that"
    if not is_channelwise(group_size) and size % group_size:
        return f"group size {group_size} does not divide the {what} {size}"
    return None
