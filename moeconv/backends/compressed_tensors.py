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
Words are built with explicit shifts (moeconv.packing), so the bytes do not depend on the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from moeconv import packing
from moeconv.spec import TensorSpec
from moeconv.backends.base import Serving, vllm_serve, with_fused_names
from moeconv.backends.per_linear import PerLinearBackend, from_packed_words, packed_words, per_rank_refusal
from moeconv.canonical import LinearShape, MoELayerShape, QuantizedWeight, is_channelwise

if TYPE_CHECKING:
    from moeconv.packed import PackedWeight

# The compressed-tensors release vLLM 0.33 pins; the config below is what its QuantizationConfig reads.
COMPRESSED_TENSORS_TARGET = "0.17.0"
PACK_QUANTIZED, INT_QUANTIZED = "pack-quantized", "int-quantized"
FLOAT_QUANTIZED, MIXED_PRECISION = "float-quantized", "mixed-precision"
# FP8 block-scaled linears (DeepSeek's and MiniMax's `weight` F8_E4M3 + `weight_scale_inv`): compressed-tensors'
# FP8_BLOCK scheme, the same block grid and the same multiplier (`weight_scale_inv` is what the FP8 codes
# are multiplied by, as compressed-tensors' `weight_scale` is), activations quantized per token-group of 128
# at run time (what DeepSeek's fp8 kernels do).
FP8_BLOCK = 128
# The token embedding's module name in every family moeconv reads. An embedding is no `Linear` target, so
# it is never in `ignore` (llm-compressor lists none); SGLang 0.5.23's w8a8_int8 method, which serves
# compressed-tensors W8A8, answers an ignored embedding with a linear method and refuses to start.
EMBEDDING = "embed_tokens"


def _format(activation_bits: int) -> str:
    return INT_QUANTIZED if activation_bits == 8 else PACK_QUANTIZED


class CompressedTensorsBackend(PerLinearBackend):
    name = "compressed-tensors"
    layout_version = 1
    # What the output is for, recorded in moeconv.json (kernel layouts and loaders age).
    targets = {"engine": "vllm==0.33.0", "compressed-tensors": "0.17.0 (QuantizationConfig)"}

    def serving(self, layer: MoELayerShape) -> Serving:
        return Serving("stock vLLM 0.33", vllm_serve(layer))

    def refusal(self, layer: MoELayerShape) -> str | None:
        return per_rank_refusal(layer, lambda what, size: _refusal(what, size, layer.bits, layer.group_size,
                                                                   layer.symmetric, layer.activation_bits))

    def linear_refusal(self, linear: LinearShape) -> str | None:
        return (_refusal("input size", linear.in_features, linear.bits, linear.group_size, linear.symmetric,
                         linear.activation_bits)
                or (None if linear.symmetric else  # zero points pack along N
                    _refusal("output size", linear.out_features, linear.bits, -1, linear.symmetric,
                             linear.activation_bits)))

    def linear_tensors(self, linear: LinearShape) -> list[TensorSpec]:
        n, k, bits = linear.out_features, linear.in_features, linear.bits
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

    def decode_linear(self, tensors: dict[str, np.ndarray], linear: LinearShape) -> QuantizedWeight:
        """Inverse of `encode_linear`; raises ValueError when weight_shape is not [N, K]."""
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

    fp8_block_suffixes = {"weight": "weight", "weight_scale_inv": "weight_scale"}

    def quantization_config(self, layer: MoELayerShape) -> dict[str, Any]:
        return self.checkpoint_quantization_config(layer, None, [])

    def checkpoint_quantization_config(self, layer: MoELayerShape, model_dtype: str | None,
                                       unquantized_modules: list[str],
                                       fp8_block_modules: tuple[str, ...] = ()) -> dict[str, Any]:
        """What compressed-tensors' `QuantizationConfig` reads: one config group for every Linear
        (experts and dense quantized linears share the source's scheme), the float linears ignored
        (the embedding is not a linear: EMBEDDING), and the FP8 block-scaled linears, if any, in a group
        of their own that names them (a module name is matched before the `Linear` class)."""
        fmt = _format(layer.activation_bits)
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
