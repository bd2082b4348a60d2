"""The Humming standard schema (`quant_method: "humming"`; docs/FORMAT.md).

Per expert and projection, under the checkpoint's own names (`<module>.<e>.<projection>.<suffix>`),
and for every dense quantized linear (`<module>.<suffix>`), unpadded and N-first:
  weight        int32 (N, K·b/32): codes packed along K, value i of every 32 at stream bits
                [i·b, i·b + b), stream bit t = bit t mod 32 of word t div 32 (4-bit: GPTQ's
                qweight transposed; 8-bit: the bytes of the codes, i.e. int8 ^ 0x80 for W8A8)
  weight_scale  (N, K/g) in the source dtype, (N, 1) channel-wise
  zero_point    int32 (N·b/32, K/g), asymmetric only: TRUE zero points packed along N the same way
                (GPTQ v1's stored z − 1 is corrected by the source decoder, never copied)

Every word is built with explicit shifts (moeconv.packing), never by viewing bytes as int32, so the
output does not depend on the host's byte order. What depends on the GPU (the kernel repack, the
scale and zero-point permutations, padding N to 256 and K to 128, signed conversion for int8
activations) stays at load time (§4.6).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moeconv.spec import TensorSpec
from moeconv.backends.base import with_fused_names
from moeconv.backends.per_linear import PerLinearBackend, from_packed_words, packed_words, per_rank_refusal
from moeconv.canonical import LinearShape, MoELayerShape, QuantizedWeight, is_channelwise

if TYPE_CHECKING:
    import numpy as np

    from moeconv.packed import PackedWeight

# Humming's pack kernels work on runs of 32 values (upstream asserts L % 32 == 0).
PACK_RUN = 32
_DTYPE_NAMES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}
_MODEL_DTYPES = {"float16": "F16", "half": "F16", "bfloat16": "BF16", "float32": "F32", "float": "F32"}


class HummingBackend(PerLinearBackend):
    name = "humming"
    layout_version = 1

    def refusal(self, layer: MoELayerShape) -> str | None:
        if layer.float_scheme is not None:
            return (f"moeconv writes Humming's integer schema only; its FP4 weight types ({layer.float_scheme.name}) are "
                    f"not written yet (--backend compressed-tensors writes them)")
        return per_rank_refusal(layer, lambda what, size: _pack_refusal(what, size)
                                or _group_refusal(what, size, layer.group_size)) or _bits_refusal(layer.bits)

    def linear_refusal(self, linear: LinearShape) -> str | None:
        return (_pack_refusal("output size", linear.out_features) or _pack_refusal("input size", linear.in_features)
                or _group_refusal("input size", linear.in_features, linear.group_size) or _bits_refusal(linear.bits))

    def linear_tensors(self, linear: LinearShape) -> list[TensorSpec]:
        n, k, bits = linear.out_features, linear.in_features, linear.bits
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

    def decode_linear(self, tensors: dict[str, np.ndarray], linear: LinearShape) -> QuantizedWeight:
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
        if _MODEL_DTYPES.get(str(model_dtype)) != layer.scale_dtype:
            config["bs_dtype"] = _DTYPE_NAMES[layer.scale_dtype]
        config["ignored_layers"] = with_fused_names(unquantized_modules)
        return config


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
